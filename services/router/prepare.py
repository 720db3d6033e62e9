"""Request preparation: one validated prompt and its settings become the ``TokenRequest``
the router sends downstream. Every door takes this one async step (HTTP chat, HTTP
completions, gRPC ``Generate`` with a text, chat or token-id prompt), so a prompt is
rendered, tokenized, fitted to the context and refused the same way, naming the same
field, whichever door it came through:

    prompt form ──render (chat template)──▶ text ──encode──▶ ids ──fit the context──▶ TokenRequest
      TextPrompt        ChatPrompt only                      ids in [0, vocab), room left for output
      ChatPrompt                                             + sampling (max_tokens resolved)
      TokenIdsPrompt    (already ids)                        + session (intent pre-screen: class, contract)
                                                             + tenant, request id scoped by tenant, deadline

NOTE: preparation never blocks the event loop for long. A text with more characters than
any prompt that fits can have is refused before tokenizing (``prompt_budget.py``); a long
text is encoded in a worker thread with the GIL released, at most
``MAX_CONCURRENT_OFFLOADS`` at once, and an over-long result is only counted; a large
conversation is rendered in a worker thread too (jinja is pure Python). Small prompts stay
on the loop: for them the thread hop costs more than the work.

A stateful chat hop (``session_stateful``: the scheduler prepends the session's context)
renders only the continuation of its new messages (``render_continuation``), not the whole
template again: no default system prompt, no tools block, no BOS a second time.

Mutates nothing shared: a ``RequestPreparer`` holds only the tokenizer, the deployment's
limits, the offload semaphore and which continuation fallbacks it has logged.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import jinja2
import structlog

from services.router.errors import InvalidRequestError
from services.router.intent import prescreen
from services.router.request_ids import mesh_request_id
from services.router.schema import Sampling, Session, TokenRequest
from services.router.validation import Limits, resolve_max_tokens
from services.shared.tokenizer import Tokenizer

# Texts longer than this are encoded in a worker thread with the GIL released
# (``Tokenizer.encode_bounded``), so one huge prompt does not stall every other stream on
# the router's event loop; shorter ones cost less than the thread hop.
OFFLOAD_TOKENIZE_CHARS = 16_384
# Conversations with more messages than this are rendered in a worker thread too: the
# template's cost grows with the number of messages, not only with their text.
OFFLOAD_RENDER_MESSAGES = 64
# Huge prompts tokenized at once: each takes a core for as long as it runs.
MAX_CONCURRENT_OFFLOADS = 2
# The field a chat template's refusal names, whichever door the conversation came through.
CHAT_TEMPLATE_FIELD = "messages"
# A conversation that stands for the session's context when a stateful hop is rendered:
# what the template writes after its assistant reply is the continuation (plain words, so
# a template that trims or escapes content leaves them alone).
SENTINEL_TURNS = ({"role": "user", "content": "weftsentinelquestion"},
                  {"role": "assistant", "content": "weftsentinelreply"})

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class TextPrompt:
    """A prompt text, tokenized with the tokenizer's special tokens (BOS)."""

    text: str
    field: str = "prompt"  # named by every refusal of this prompt


@dataclass(frozen=True)
class TokenIdsPrompt:
    """A prompt already tokenized by the client."""

    token_ids: tuple[int, ...]
    field: str = "prompt"


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation (plain message dicts, validated by ``chat_messages.parse_message``)
    rendered by the model's chat template, whose output already carries BOS and friends."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None = None
    add_generation_prompt: bool = True
    field: str = "messages"

    @property
    def is_small(self) -> bool:
        """Cheap enough to render on the loop (tool calls and tools render with json.dumps)."""
        size = sum(len(m.get("content") or "") for m in self.messages)
        return (size <= OFFLOAD_TOKENIZE_CHARS and len(self.messages) <= OFFLOAD_RENDER_MESSAGES
                and not self.tools and not any(m.get("tool_calls") for m in self.messages))


Prompt = TextPrompt | TokenIdsPrompt | ChatPrompt


def completion_prompt(prompt: str | Sequence[int], field: str) -> TextPrompt | TokenIdsPrompt:
    """One entry of ``/v1/completions``' ``prompt``: a text or token ids."""
    if isinstance(prompt, str):
        return TextPrompt(prompt, field)
    return TokenIdsPrompt(tuple(prompt), field)


def reshapes_output(s: Sampling) -> bool:
    """The request changes what greedy decoding of its prompt writes (a grammar, a bias, a
    penalty, a min-p floor) or asks for what a cached answer does not hold (prompt
    logprobs): the semantic response cache, keyed by prompt and length limits only, must
    neither answer it nor store its output. (The opt-in is a permission, so it is dropped.)"""
    return (s.grammar is not None or bool(s.logit_bias) or s.min_p > 0 or s.repetition_penalty != 1.0
            or s.presence_penalty != 0 or s.frequency_penalty != 0 or s.prompt_logprobs is not None)


class RequestPreparer:
    """Prompt form + sampling + tenant + session + client id -> ``TokenRequest``."""

    def __init__(self, tokenizer: Tokenizer, limits: Limits, request_timeout_s: float = 600.0) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.request_timeout_s = request_timeout_s
        self._offload_slots = asyncio.Semaphore(MAX_CONCURRENT_OFFLOADS)
        self._continuation_fallbacks: set[str] = set()  # reasons logged (once each)

    async def prepare(self, prompt: Prompt, sampling: Sampling, tenant: str, session: Session,
                      client_request_id: str) -> TokenRequest:
        """The token request of one prompt; raises ``InvalidRequestError`` naming
        ``prompt.field`` (or ``max_tokens``) when it cannot run."""
        ids = await self.prompt_ids(prompt, continuation=session.stateful)
        has_tools = isinstance(prompt, ChatPrompt) and bool(prompt.tools)
        return self.token_request(ids, sampling, tenant, session, prompt.field,
                                  mesh_request_id(tenant, client_request_id), has_tools)

    async def prompt_ids(self, prompt: Prompt, continuation: bool = False) -> list[int]:
        """The prompt's token ids (not yet checked against the vocabulary or context);
        ``continuation``: a chat prompt continues a session's context (stateful hop)."""
        if isinstance(prompt, TokenIdsPrompt):
            return list(prompt.token_ids)
        if isinstance(prompt, TextPrompt):
            return await self.encode_async(prompt.text, prompt.field)
        from services.router.chat_tokens import chat_tokens_for  # (one hunk: move to the imports)

        # Control-token text inside the conversation's strings stays text (chat_tokens.py).
        chat_tokens = chat_tokens_for(self.tokenizer)
        shielded = chat_tokens.shield(prompt.messages, prompt.tools)
        prompt = replace(prompt, messages=shielded.messages, tools=shielded.tools)
        render = self.render_continuation if continuation else self._render_chat
        if prompt.is_small:
            text = render(prompt)
        else:
            text = await asyncio.to_thread(render, prompt)
        if not shielded.originals:
            return await self.encode_async(text, prompt.field, add_special_tokens=False)
        self.check_prompt_chars(text, prompt.field)
        async with self._offload_slots:  # rare (typed control tokens): always off the loop
            return await asyncio.to_thread(chat_tokens.encode, text, shielded.originals)

    def render_continuation(self, prompt: ChatPrompt) -> str:
        """The text a stateful hop's new messages add to the session's context.

        NOTE: the context ends with the previous hop's reply, whose last token is the
        end-of-turn the model generated. Rendering ``SENTINEL_TURNS + messages`` and
        cutting right after the sentinel reply's end-of-turn leaves what the template
        writes after a reply: the turn separator, the new messages, the generation prompt::

            [system + tools] <|im_start|>user …<|im_start|>assistant\nweftsentinelreply<|im_end|>│\n<|im_start|>tool …
            └─ as render(SENTINEL_TURNS): the session's context stands here ─────────────────┘ └─ sent ─

        A template whose rendering of the sentinel turns is not a prefix of the whole (it
        rewrites earlier turns) falls back to the full rendering, logged once per reason."""
        full = self._render_chat(ChatPrompt((*SENTINEL_TURNS, *prompt.messages), prompt.tools,
                                            prompt.add_generation_prompt, prompt.field))
        base = self._render_chat(ChatPrompt(SENTINEL_TURNS, prompt.tools, False, prompt.field))
        reply = SENTINEL_TURNS[1]["content"]
        at = base.find(reply)
        why = ""
        if at < 0 or base.count(reply) != 1:
            why = "the template does not render the reply verbatim"
        else:
            cut = at + len(reply)
            eos = self.tokenizer.special_tokens.get("eos_token", "")
            if eos and base.startswith(eos, cut):  # the context's last token is this end-of-turn
                cut += len(eos)
            if full[:cut] != base[:cut]:
                why = "the template renders earlier turns differently when more follow"
        if why:
            if why not in self._continuation_fallbacks:
                self._continuation_fallbacks.add(why)
                log.warning("stateful_chat_full_render", reason=why)
            return self._render_chat(prompt)
        return full[cut:]

    def token_request(self, prompt_ids: Sequence[int], sampling: Sampling, tenant: str, session: Session,
                      prompt_field: str, request_id: str, has_tools: bool = False) -> TokenRequest:
        """Check the ids against the vocabulary and the context, resolve max_tokens, and
        decide the request's class and contract (``intent.prescreen``)."""
        if len(prompt_ids) >= self.limits.max_model_len:  # cannot fit: refuse before walking the ids
            resolve_max_tokens(sampling, len(prompt_ids), self.limits.max_model_len, prompt_field)
        for i, t in enumerate(prompt_ids):
            if not 0 <= t < self.limits.vocab_size:
                raise InvalidRequestError(f"{prompt_field}[{i}]",
                                          f"token id {t} is outside [0, {self.limits.vocab_size})")
        max_tokens = resolve_max_tokens(sampling, len(prompt_ids), self.limits.max_model_len, prompt_field)
        return TokenRequest(
            request_id=request_id,
            model="",  # one model per deployment: any executor serves it
            prompt_token_ids=tuple(prompt_ids),
            sampling=replace(sampling, max_tokens=max_tokens, min_tokens=min(sampling.min_tokens, max_tokens),
                             stop_token_ids=tuple(sampling.stop_token_ids),
                             semantic_cache=sampling.semantic_cache and not reshapes_output(sampling)),
            tenant=tenant,
            session=prescreen(session, has_tools, len(prompt_ids), max_tokens),
            deadline_unix_ms=int((time.time() + self.request_timeout_s) * 1000),
        )

    async def encode_async(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt text that can fit the context; raises
        ``InvalidRequestError`` naming ``field`` when it cannot (see the module's NOTE)."""
        self.check_prompt_chars(text, field)
        if len(text) <= OFFLOAD_TOKENIZE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        async with self._offload_slots:
            num_tokens, ids = await asyncio.to_thread(self.tokenizer.encode_bounded, text,
                                                      self.limits.max_model_len, add_special_tokens)
        if ids is None:
            raise InvalidRequestError(
                field, f"{num_tokens} tokens exceed the model's context length of {self.limits.max_model_len}")
        return ids

    def check_prompt_chars(self, text: str, field: str) -> None:
        """Refuse a text that has more characters than any fitting prompt can have."""
        max_chars = self.tokenizer.char_budget.max_chars(self.limits.max_model_len, text.isascii())
        if max_chars is not None and len(text) > max_chars:
            raise InvalidRequestError(
                field, f"{len(text)} characters can never fit the model's context length of "
                f"{self.limits.max_model_len} tokens (at most {max_chars} characters with this tokenizer)")

    def _render_chat(self, prompt: ChatPrompt) -> str:
        try:
            return self.tokenizer.apply_chat_template(list(prompt.messages), tools=prompt.tools,
                                                      add_generation_prompt=prompt.add_generation_prompt)
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(CHAT_TEMPLATE_FIELD, f"rejected by the model's chat template: {exc}") from None
        except ValueError as exc:
            raise InvalidRequestError(CHAT_TEMPLATE_FIELD, str(exc)) from None
        except RecursionError:  # tool-call arguments or tool schemas too deep for ``tojson``
            raise InvalidRequestError(CHAT_TEMPLATE_FIELD, "too deeply nested for the model's chat template") from None
