"""Request fields Weft does not honour yet, and the refusal that names them.

NOTE: no field that would change the output is parsed and dropped. A field listed here
is accepted only when absent, ``null`` or the value that means today's behaviour
(``typical_p: 1``, ``bad_words: []``); anything else is a 400 naming it, so a client
learns it did not get what it asked for instead of getting output that ignores it.
Structured output, tool_choice, logprobs, echo, n and the sampler's penalties are
honoured (``structured_output.py``, ``tool_grammar.py``, ``sampling_fields.py``).
``docs/openai.md`` tables every field; a test keeps that table and these in step.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NamedTuple

from services.router.errors import InvalidRequestError


# -- fields Weft does not honour yet ---------------------------------------------------
class FieldGap(NamedTuple):
    """A request field Weft cannot honour yet: absent, ``null`` or ``default`` (the value
    that means today's behaviour) is accepted, anything else refused with ``why``.
    ``default`` None: only absent / ``null`` is accepted."""

    default: Any
    why: str


_TEMPLATE = "the model's own chat template renders every conversation"
_BEAM = "decoding samples one sequence per prompt, no beam search"
_SHARED_GAPS = {
    "allowed_token_ids": FieldGap(None, "use logit_bias or a regex (structured output)"),
    "typical_p": FieldGap(1, "the sampler has no typical-p filter"),
    "bad_words": FieldGap([], "the sampler cannot ban words yet"),
    "logits_processors": FieldGap(None, "no custom logits processors are loaded"),
    "use_beam_search": FieldGap(False, _BEAM),
    "length_penalty": FieldGap(1, _BEAM),
    "include_stop_str_in_output": FieldGap(False, "a matched stop string is cut from the text"),
    "skip_special_tokens": FieldGap(True, "special tokens are left out of the text"),
    "spaces_between_special_tokens": FieldGap(True, "special tokens are left out of the text"),
    "truncate_prompt_tokens": FieldGap(None, "a prompt that does not fit is refused, never truncated"),
    "prompt_logprobs": FieldGap(None, "use echo with logprobs on /v1/completions"),
    "return_tokens_as_token_ids": FieldGap(False, "use return_token_ids"),
}
CHAT_FIELD_GAPS = {
    **_SHARED_GAPS,
    "functions": FieldGap(None, "the deprecated functions API is not served; use tools"),
    "function_call": FieldGap(None, "the deprecated functions API is not served; use tool_choice"),
    "audio": FieldGap(None, "output is text only"),
    "modalities": FieldGap(["text"], "output is text only"),
    "web_search_options": FieldGap(None, "there is no web search"),
    "reasoning_effort": FieldGap(None, "the served model has no reasoning-effort setting"),
    "verbosity": FieldGap(None, "the served model has no verbosity setting"),
    "echo": FieldGap(False, "the reply does not repeat the last message"),
    "add_generation_prompt": FieldGap(True, _TEMPLATE),
    "continue_final_message": FieldGap(False, _TEMPLATE),
    "chat_template": FieldGap(None, _TEMPLATE),
    "chat_template_kwargs": FieldGap({}, _TEMPLATE),
    "documents": FieldGap(None, _TEMPLATE),
    "add_special_tokens": FieldGap(False, "the chat template places the special tokens"),
}
COMPLETION_FIELD_GAPS = {
    **_SHARED_GAPS,
    "add_special_tokens": FieldGap(True, "a text prompt is encoded with the tokenizer's special tokens (BOS)"),
}
def refuse_field_gaps(body: Mapping[str, Any], gaps: Mapping[str, FieldGap]) -> None:
    """Refuse the first field of ``gaps`` whose value asks for what Weft does not do yet,
    naming it; does not modify ``body``. (``guided_*`` are ``structured_output.py``'s.)"""
    for name, gap in gaps.items():
        value = body.get(name)
        if not _means_default(value, gap.default):
            hint = "omit it" if gap.default is None else f"omit it or send {json.dumps(gap.default)}"
            raise InvalidRequestError(name, f"is not supported yet ({gap.why}); {hint}")


def _means_default(value: Any, default: Any) -> bool:
    """``value`` is absent / null or equals ``default`` with the same JSON type (``true`` is
    not ``1``; ``1.0`` is ``1``)."""
    if value is None:
        return True
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float)) and value == default
    return default is not None and value == default
