"""Text <-> token ids and chat rendering for a Hugging Face checkpoint directory.

A thin wrapper over ``tokenizers.Tokenizer`` (``tokenizer.json``) plus the pieces of
``tokenizer_config.json`` that change results: special tokens and the chat template.
It reproduces what ``transformers.AutoTokenizer`` (v5) returns for the same directory:

- ``encode`` runs tokenizer.json's pipeline, post-processor included. transformers v5
  drops ``add_bos_token`` / ``add_eos_token`` from tokenizer_config.json whenever a
  tokenizer.json exists, so the post-processor alone decides whether a BOS is added.
  Only when tokenizer.json has no post-processor do we honour ``add_bos_token``.
- ``decode`` never applies ``clean_up_tokenization_spaces``: transformers v5 ignores
  it for BPE models, and every family we serve (Llama 3, Qwen2, Mistral) is BPE.
- ``apply_chat_template`` renders in a jinja2 environment configured like
  transformers' (sandboxed, trim/lstrip blocks, JSON ``tojson``, ``raise_exception``).
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from services.mesh.file_access import unreadable_reason
from services.shared.prompt_budget import CharBudget, char_budget

# transformers' named special tokens; the chat template sees each one that is set.
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
# Names a message's reasoning may arrive under; the first is what templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class Tokenizer:
    """Encode, decode and chat-render for one checkpoint. Immutable after construction;
    safe to share between threads (the tokenizers backend is thread-safe)."""

    def __init__(
        self,
        backend: HFTokenizer,
        special_tokens: Mapping[str, str],
        chat_template: str | None,
        generation_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._backend = backend
        self._special_tokens = dict(special_tokens)
        self._chat_template_source = chat_template
        self._chat_template = _compile_chat_template(chat_template) if chat_template else None
        # Every id the backend can turn into text; larger (padded) model ids decode to "".
        self._num_ids = backend.get_vocab_size(with_added_tokens=True)
        eos_ids = [self.token_to_id(self._special_tokens["eos_token"])] if "eos_token" in self._special_tokens else []
        self._eos_token_ids = tuple(dict.fromkeys(i for i in [*eos_ids, *generation_eos_token_ids] if i is not None))
        bos = self._special_tokens.get("bos_token")
        self._bos_token_id = self.token_to_id(bos) if bos is not None else None
        self._char_budget = char_budget(json.loads(backend.to_str()), backend.get_vocab(with_added_tokens=True))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` + ``tokenizer_config.json`` (+ ``special_tokens_map.json``,
        ``chat_template.jinja`` and ``generation_config.json`` when present).
        Raises FileNotFoundError / PermissionError / ValueError naming the file."""
        model_dir = Path(path)
        _require_readable(model_dir)  # else every file in it would look missing
        tokenizer_path = model_dir / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise FileNotFoundError(f"tokenizer.json not found in {model_dir}")
        # The Rust loader reports an unreadable file as one it "cannot parse".
        _require_readable(tokenizer_path)
        try:
            backend = HFTokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise ValueError(f"tokenizer.json in {model_dir} cannot be parsed: {exc}") from exc
        config = _read_json_object(model_dir / "tokenizer_config.json") or {}
        special_map = _read_json_object(model_dir / "special_tokens_map.json") or {}

        special_tokens: dict[str, str] = {}
        for key in _SPECIAL_TOKEN_KEYS:
            from_config = _token_content(config.get(key))
            from_map = _token_content(special_map.get(key))
            # Like transformers: special_tokens_map.json wins only for legacy configs
            # without added_tokens_decoder; otherwise it merely fills gaps.
            legacy = "added_tokens_decoder" not in config
            value = (from_map or from_config) if legacy else (from_config or from_map)
            if value is not None:
                special_tokens[key] = value

        if backend.post_processor is None and config.get("add_bos_token") and "bos_token" in special_tokens:
            bos = special_tokens["bos_token"]
            bos_id = backend.token_to_id(bos)
            if bos_id is not None:
                backend.post_processor = processors.TemplateProcessing(
                    single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
                )

        generation = _read_json_object(model_dir / "generation_config.json") or {}
        gen_eos = generation.get("eos_token_id")
        gen_eos_ids = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        return cls(backend, special_tokens, _chat_template(model_dir, config), gen_eos_ids)

    # ----------------------------------------------------------------- properties
    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included (``len(AutoTokenizer)``;
        transformers' ``.vocab_size`` excludes added tokens). May be below the model's."""
        return self._num_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: the tokenizer's eos_token, then generation_config.json's."""
        return self._eos_token_ids

    @property
    def special_tokens(self) -> dict[str, str]:
        """Named special tokens (``bos_token``, ``eos_token``, ...) that are set; a copy."""
        return dict(self._special_tokens)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template_source

    @property
    def char_budget(self) -> CharBudget:
        """How many characters can possibly fit a context (``prompt_budget.py``)."""
        return self._char_budget

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    # ------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the post-processor
        (e.g. a BOS), exactly as ``AutoTokenizer.encode`` does."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_bounded(self, text: str, max_tokens: int, add_special_tokens: bool = True) -> tuple[int, list[int] | None]:
        """(number of tokens, ids or None when there are more than ``max_tokens``).

        Runs with the GIL released: ``tokenizers``' ``encode`` holds it for the whole
        call (a 1 MB text: seconds with every other thread, the event loop included,
        frozen), ``encode_batch`` releases it. Call it from a worker thread. An
        over-long result is only counted, never turned into a Python list."""
        (encoding,) = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
        num_tokens = len(encoding)
        return num_tokens, (encoding.ids if num_tokens <= max_tokens else None)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Ids outside the tokenizer's vocabulary (a model vocab padded
        beyond it, as Qwen ships) decode to nothing instead of raising."""
        known = [i for i in ids if 0 <= i < self._num_ids]
        return self._backend.decode(known, skip_special_tokens=skip_special_tokens)

    # ---------------------------------------------------------------- chat render
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt text the model was trained on.

        Equals ``AutoTokenizer.apply_chat_template(messages, tools=tools,
        add_generation_prompt=..., tokenize=False)``. Extra keyword arguments reach the
        template as variables (e.g. ``enable_thinking``). Raises ValueError when the
        checkpoint has no chat template, jinja2.TemplateError when the template rejects
        the conversation (``raise_exception``)."""
        if self._chat_template is None:
            raise ValueError("this checkpoint's tokenizer has no chat_template")
        # transformers drops None-valued keys (OpenAI clients send content=None with tool_calls).
        normalized = [_alias_reasoning({k: v for k, v in dict(m).items() if v is not None}) for m in messages]
        variables = {**self._special_tokens, **template_kwargs}
        return self._chat_template.render(
            messages=normalized,
            tools=[dict(t) for t in tools] if tools is not None else None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )


def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile with the environment chat templates are written against (transformers')."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        # jinja's own tojson HTML-escapes '<' '>' '&'; templates expect plain JSON.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """transformers exposes a message's reasoning under both ``reasoning_content`` (the
    name templates read) and ``thinking`` (gpt-oss templates), whichever one was sent."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _chat_template(model_dir: Path, config: Mapping[str, Any]) -> str | None:
    # transformers >= 4.47 writes chat_template.jinja; it overrides tokenizer_config's.
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        _require_readable(jinja_file)
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        # Named templates: [{"name": "default", "template": "..."}, ...].
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_content(value: Any) -> str | None:
    """A special token is a string or an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json_object(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    _require_readable(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path.name} in {path.parent} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{path.name} in {path.parent} must hold a JSON object")
    return value


def _require_readable(path: Path) -> None:
    """Raise PermissionError saying "permission denied" (mode, owner, our uid) when this
    process may not read ``path`` (services/mesh/file_access.py says why this is checked)."""
    reason = unreadable_reason(path)
    if reason is not None:
        raise PermissionError(reason)
