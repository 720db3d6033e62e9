"""Tool-call formats as plug-ins: each model family's way of writing calls, parsed out of
the generated text (streamed or whole) and enforced by a structural tag the engine compiles.

``select_format`` picks a format by recognising the chat template's text (the template is
what teaches the model its convention); ``--tool-call-parser`` (RouterConfig) overrides it
by name. The doors consume: ``ToolChoice``, ``ToolCall``, the stream events
(``ContentDelta`` / ``ToolCallStart`` / ``ToolCallArgsDelta``), ``ToolCallFormat``
(``stream_parser()``, ``parse(text)``, ``grammar(tools, choice, parallel)``), ``FORMATS``.
See docs/tools.md.
"""
from __future__ import annotations

from services.router.tool_parsers.base import (
    ContentDelta, StreamEvent, ToolCall, ToolCallArgsDelta, ToolCallFormat, ToolCallStart, ToolChoice,
    ToolStreamParser, collect,
)
from services.router.tool_parsers.pythonic import PythonicFormat
from services.router.tool_parsers.tagged import HermesFormat, SmolLM2Format
from services.router.tool_parsers.trailing import Llama3JsonFormat, MistralFormat

__all__ = [
    "FORMATS", "ContentDelta", "StreamEvent", "ToolCall", "ToolCallArgsDelta", "ToolCallFormat",
    "ToolCallStart", "ToolChoice", "ToolStreamParser", "collect", "select_format",
]

FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (
    HermesFormat(), SmolLM2Format(), Llama3JsonFormat(), MistralFormat(), PythonicFormat())}
DEFAULT_FORMAT = "hermes"

# What each family's template says, most specific first: (text in the template, format).
_TEMPLATE_SIGNS: tuple[tuple[str, str], ...] = (
    ("[TOOL_CALLS]", "mistral"),
    ("func_name1(", "pythonic"),  # Llama 3.2 / 4 pythonic templates show "[func_name1(params_name1=..."
    ("<tool_call>[", "smollm2"),
    ("<tool_call>", "hermes"),
    ("<|python_tag|>", "llama3_json"),
    ('"parameters": dictionary of argument name', "llama3_json"),
)


def select_format(chat_template: str | None, override: str = "auto") -> ToolCallFormat:
    """The format named by ``override``, or, with "auto", the one the template teaches
    (hermes when nothing is recognised: the most common convention, and Weft's default
    before formats were plug-ins)."""
    if override != "auto":
        if override not in FORMATS:
            raise ValueError(f"tool call parser must be 'auto' or one of {sorted(FORMATS)}, got {override!r}")
        return FORMATS[override]
    for sign, name in _TEMPLATE_SIGNS:
        if chat_template and sign in chat_template:
            return FORMATS[name]
    return FORMATS[DEFAULT_FORMAT]
