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

from dataclasses import replace

from services.router.errors import InvalidRequestError
from services.router.schema import ChatRequest
from services.router.structured_output import check_tool_schemas
from services.router.tool_parsers import ToolCallFormat

TOOL_GRAMMAR_FIELD = "tool_choice"  # named when the executor cannot compile the tools' grammar


def with_tool_grammar(req: ChatRequest, fmt: ToolCallFormat) -> ChatRequest:
    """``req`` with its tool grammar set (or unchanged), after the checks above."""
    choice = req.tool_choice
    if choice.mode == "none" and req.tools and req.sampling.grammar is None:
        # "none" is enforced too: free text in which the format's call marker cannot appear
        grammar = fmt.grammar(req.tools, choice, req.parallel_tool_calls)
        if grammar is not None:
            return replace(req, sampling=replace(req.sampling, grammar=("structural_tag", grammar)),
                           grammar_field=TOOL_GRAMMAR_FIELD)
    if not req.parse_tool_calls:
        return req
    forced = choice.mode in ("required", "function")
    if forced and req.sampling.grammar is not None:
        raise InvalidRequestError("tool_choice", f"a forced tool call cannot be combined with {req.grammar_field} "
                                  "(the output cannot be both); send one of them")
    grammar = None if req.sampling.grammar is not None else fmt.grammar(req.tools, choice, req.parallel_tool_calls)
    if grammar is None:
        _refuse_unenforced(req, fmt)
        return req
    check_tool_schemas(req.tools, "tools[{}].function.parameters")
    return replace(req, sampling=replace(req.sampling, grammar=("structural_tag", grammar)),
                   grammar_field=TOOL_GRAMMAR_FIELD)


def _refuse_unenforced(req: ChatRequest, fmt: ToolCallFormat) -> None:
    why = (f"{req.grammar_field} constrains the output instead" if req.sampling.grammar is not None
           else f"the {fmt.name} tool-call format has no grammar for tool_choice {req.tool_choice.mode!r}")
    if not req.parallel_tool_calls:
        raise InvalidRequestError("parallel_tool_calls", f"false cannot be enforced here ({why}); omit it")
    for i, tool in enumerate(req.tools or ()):
        if tool["function"].get("strict") is True:
            raise InvalidRequestError(f"tools[{i}].function.strict", f"cannot be enforced here ({why}); "
                                      "omit it or send false")
