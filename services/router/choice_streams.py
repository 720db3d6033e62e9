"""One choice of a response, built from its ``Delta`` events: what the HTTP API sends for
each delta of a stream, and the whole choice of a non-streamed response.

A chat choice parses tool calls out of its text (when the request has tools and
``tool_choice`` is not "none") and streams them as OpenAI does: a call's first chunk
carries ``index``, ``id``, ``type: "function"`` and ``function: {name, arguments: ""}``,
the next ones ``{index, function: {arguments: fragment}}``. A completions choice prepends
its echoed prompt (``echo``) and drops the one token a prompt-only request
(``echo`` + ``max_tokens: 0``) had to generate.

Each choice keeps the scheduler's decisions (its first delta's, completed by its last
delta's pause decision) and sends them as ``weft`` with its finish: on the stream chunk
that carries ``finish_reason``, and on the choice of a non-streamed response.

The ids and logprobs of a delta ride on the first chunk sent for it; a delta whose text is
still held back (a stop string or tool tag may be starting) gets a chunk with an empty
``delta`` when it has ids or logprobs to carry.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from services.router.http_responses import choice_error_body
from services.router.logprobs_format import CompletionLogprobs, TokenText, chat_logprobs
from services.router.openai_format import ChatFormatter, CompletionFormatter, weft_body
from services.router.schema import Delta, ServingNotes, Usage
from services.router.tool_parsers import ToolCall, ToolCallArgsDelta, ToolCallFormat, ToolCallStart


class ChatChoice:
    def __init__(self, index: int, tools: ToolCallFormat | None, text: TokenText | None, return_token_ids: bool,
                 session_id: str = "") -> None:
        self.index = index
        self.tools = tools
        self.text = text  # None: no logprobs asked
        self.return_token_ids = return_token_ids
        self.parts: list[str] = []
        self.ids: list[int] = []
        self.logprobs: list[dict[str, Any]] = []
        self.last: Delta | None = None
        self.parser = tools.stream_parser() if tools is not None else None
        self.num_calls = 0
        self.notes = _Notes(session_id)

    # -- non-streamed ----------------------------------------------------------------
    def add(self, delta: Delta) -> None:
        self.notes.add(delta)
        self.parts.append(delta.text)
        self.ids.extend(delta.token_ids)
        if self.text is not None:
            self.logprobs += chat_logprobs(self.text, delta.token_ids, delta.logprobs, delta.top_logprobs)
        self.last = delta

    def body(self, fmt: ChatFormatter) -> dict[str, Any]:
        content: str | None = "".join(self.parts)
        calls: list[ToolCall] = []
        if self.tools is not None:
            content, calls = self.tools.parse(content)
        reason = _finish_reason(self.last.finish_reason, bool(calls))
        return fmt.choice(self.index, content, calls, reason, self.ids if self.return_token_ids else None,
                          self.logprobs if self.text is not None else None, self.notes.body())

    # -- streamed --------------------------------------------------------------------
    def chunks(self, fmt: ChatFormatter, delta: Delta) -> list[dict[str, Any]]:
        """The stream chunks for one delta (the role chunk before the first)."""
        out = [] if self.last is not None else [fmt.chunk({"role": "assistant", "content": ""}, index=self.index)]
        self.last = delta
        self.notes.add(delta)
        done = delta.finish_reason is not None
        if self.parser is None:
            events: list = [delta.text]
        else:
            events = self.parser.feed(delta.text) + (self.parser.flush() if done else [])
        ids = list(delta.token_ids) if self.return_token_ids else None
        lps = (chat_logprobs(self.text, delta.token_ids, delta.logprobs, delta.top_logprobs)
               if self.text is not None and delta.token_ids else None)
        for body in self._bodies(events):
            out.append(fmt.chunk(body, token_ids=ids, index=self.index, logprobs=lps))
            ids, lps = ([] if ids is not None else None), None
        if ids or lps:  # ids / logprobs whose text is still held back
            out.append(fmt.chunk({}, token_ids=ids, index=self.index, logprobs=lps))
        if done:
            reason = _finish_reason(delta.finish_reason, bool(self.num_calls))
            out.append(fmt.chunk({}, finish_reason=reason, index=self.index, weft=self.notes.body()))
        return out

    def _bodies(self, events: list) -> list[dict[str, Any]]:
        """Chunk deltas of the text (no tool parsing) or of the parser's events."""
        bodies = []
        for ev in events:
            if isinstance(ev, ToolCallStart):
                self.num_calls += 1
                bodies.append({"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                               "function": {"name": ev.name, "arguments": ""}}]})
            elif isinstance(ev, ToolCallArgsDelta):
                if ev.text:
                    bodies.append({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]})
            else:  # content: a plain string or a ContentDelta
                text = ev if isinstance(ev, str) else ev.text
                if text:
                    bodies.append({"content": text})
        return bodies


class CompletionChoice:
    def __init__(self, index: int, echo_text: str | None, prompt_ids: tuple[int, ...],
                 logprobs: CompletionLogprobs | None, score_only: bool, return_token_ids: bool,
                 session_id: str = "") -> None:
        self.index = index
        self.echo_text = echo_text  # None: no echo
        self.prompt_ids = prompt_ids
        self.logprobs = logprobs
        self.score_only = score_only
        self.return_token_ids = return_token_ids
        self.parts: list[str] = []
        self.ids: list[int] = []
        self.last: Delta | None = None
        self.notes = _Notes(session_id)

    def _take(self, delta: Delta) -> tuple[str, list[int], dict[str, list] | None]:
        """This delta's text, ids and logprobs part (echo first, on the first delta)."""
        first, self.last = self.last is None, delta
        self.notes.add(delta)
        text, ids, part = ("", [], None) if self.score_only else (delta.text, list(delta.token_ids), None)
        if self.logprobs is not None:
            part = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            if first and self.echo_text is not None:
                part = self.logprobs.add_prompt(self.prompt_ids, delta.prompt_logprobs, delta.prompt_top_logprobs)
            if not self.score_only:
                more = self.logprobs.add(delta.token_ids, delta.logprobs, delta.top_logprobs)
                part = {k: part[k] + more[k] for k in part}
        if first and self.echo_text is not None:
            text = self.echo_text + text
        return text, ids, part

    def add(self, delta: Delta) -> None:
        text, ids, _ = self._take(delta)
        self.parts.append(text)
        self.ids.extend(ids)

    def body(self) -> dict[str, Any]:
        return CompletionFormatter.choice(self.index, "".join(self.parts), self.last.finish_reason,
                                          self.ids if self.return_token_ids else None,
                                          self.logprobs.body if self.logprobs is not None else None,
                                          self.notes.body())

    def chunk_choice(self, delta: Delta) -> dict[str, Any] | None:
        """The choice of this delta's stream chunk, or None when it has nothing to send."""
        text, ids, part = self._take(delta)
        if not (text or delta.finish_reason or (self.return_token_ids and ids) or (part and part["tokens"])):
            return None
        return CompletionFormatter.choice(self.index, text, delta.finish_reason,
                                          ids if self.return_token_ids else None, part,
                                          self.notes.body() if delta.finish_reason else None)

    def usage(self) -> Usage:
        usage = self.last.usage
        return replace(usage, completion_tokens=0) if self.score_only else usage


class _Notes:
    """One choice's decisions: the first delta's notes, completed by later ones (the pause),
    the session its hop ran on ("": none) and, when it failed on its own, why."""

    def __init__(self, session_id: str = "") -> None:
        self.notes: ServingNotes | None = None
        self.session_id = session_id
        self.error: dict[str, Any] | None = None

    def add(self, delta: Delta) -> None:
        if delta.notes is not None:
            self.notes = delta.notes if self.notes is None else self.notes.merged(delta.notes)
        if delta.error is not None:
            self.error = choice_error_body(delta.error)

    def body(self) -> dict[str, Any]:
        return weft_body(self.notes, self.session_id, self.error)


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """"tool_calls" when the reply made calls, unless it was cut: a reply that hit
    max_tokens stays "length" (as OpenAI reports it), one cut by its KV quota "kv_quota",
    one that failed "error", even when the calls it completed before the cut are returned."""
    return "tool_calls" if called and reason not in ("length", "kv_quota", "error") else reason

