"""What ``tool_choice`` makes the engine enforce on a chat request: the served model's
tool-call format's structural tag (``tool_parsers``) as ``Sampling.grammar``.

    tool_choice "none"                 free text in which the format's call marker cannot
                                       appear (no parsing); no grammar for a format whose
                                       marker is ordinary text (pythonic's "[")
    "auto"                             the format's triggered tag (free text; a call, once
                                       opened, follows its tool's schema), if it has one
    "required" / a named function      only calls (of that function), schema-valid

``parallel_tool_calls: false`` and ``strict: true`` on a tool are promises only a grammar
keeps: where none applies (a format without an "auto" grammar, or ``response_format``
set beside ``tool_choice: "auto"``, which then wins) they are refused naming the field,
never silently broken. A forced call beside ``response_format`` (or any other grammar)
is refused naming ``tool_choice``: the output cannot be both. A tool's parameters the
grammar could not keep (NaN, a keyword xgrammar drops) are refused naming that tool.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from services.router.errors import InvalidRequestError
from services.router.schema import ChatRequest
from services.router.structured_output import check_tool_schemas
from services.router.tool_parsers import ToolCallFormat, ToolChoice

TOOL_GRAMMAR_FIELD = "tool_choice"  # named when the executor cannot compile the tools' grammar


def with_tool_grammar(req: ChatRequest, fmt: ToolCallFormat) -> ChatRequest:
    """``req`` with its tool grammar set (or unchanged), after the checks above."""
    grammar = tool_grammar(fmt, req.tools, req.tool_choice, req.parallel_tool_calls, req.sampling.grammar is not None,
                           req.grammar_field, "tools[{}].function.parameters")
    if grammar is None:
        return req
    return replace(req, sampling=replace(req.sampling, grammar=("structural_tag", grammar)),
                   grammar_field=TOOL_GRAMMAR_FIELD)


def tool_grammar(fmt: ToolCallFormat, tools: Sequence[dict[str, Any]] | None, choice: ToolChoice, parallel: bool,
                 has_grammar: bool, grammar_field: str, parameters_field: str) -> str | None:
    """The structural tag ``tool_choice`` needs, or None (the output stays as it is), after
    refusing what cannot be kept; the rules of both doors. ``has_grammar``: the request
    already constrains its output (named ``grammar_field``); ``parameters_field``: how a
    door names tool i's parameters, a format string."""
    if not tools:
        return None
    if choice.mode == "none":  # enforced too: text in which the format's call marker cannot appear
        return None if has_grammar else fmt.grammar(tools, choice, parallel)
    if choice.mode in ("required", "function") and has_grammar:
        raise InvalidRequestError("tool_choice", f"a forced tool call cannot be combined with {grammar_field} "
                                  "(the output cannot be both); send one of them")
    grammar = None if has_grammar else fmt.grammar(tools, choice, parallel)
    if grammar is None:
        why = (f"{grammar_field} constrains the output instead" if has_grammar
               else f"the {fmt.name} tool-call format has no grammar for tool_choice {choice.mode!r}")
        _refuse_unenforced(tools, parallel, why)
        return None
    check_tool_schemas(tools, parameters_field)
    return grammar


def _refuse_unenforced(tools: Sequence[dict[str, Any]], parallel: bool, why: str) -> None:
    if not parallel:
        raise InvalidRequestError("parallel_tool_calls", f"false cannot be enforced here ({why}); omit it")
    for i, tool in enumerate(tools):
        if tool["function"].get("strict") is True:
            raise InvalidRequestError(f"tools[{i}].function.strict", f"cannot be enforced here ({why}); "
                                      "omit it or send false")
