"""The ``pythonic`` format (Llama 3.2 / Llama 4 pythonic tool calling): the whole reply is
a Python list of calls with keyword arguments, ``[get_weather(city="Paris"), f(x=1)]``,
on Llama 4 possibly inside ``<|python_start|>...<|python_end|>``.

Parsed with ``ast`` (never evaluated): every element must be a call of a plain name with
keyword arguments only, each a literal (``ast.literal_eval`` of the node) that JSON can
carry. Anything else is content, as the model wrote it.

Grammar: a JSON Schema does not describe Python syntax, so "required" and a named function
get a best-effort EBNF grammar: the list form, the tools' names, each tool's own parameter
names, and Python literals as values; value types and required parameters are not
enforced; tool names must then be Python identifiers (400 naming the tool's name). "auto"
is not constrained (None): the only trigger, ``[``, is ordinary text.
"""
from __future__ import annotations

import ast
import json
from collections.abc import Sequence
from typing import Any

import services.router.tool_parsers.structural as st
from services.router.errors import InvalidRequestError
from services.router.tool_parsers.base import (
    ToolCall, ToolCallFormat, ToolChoice, ToolStreamParser, openai_call_id,
)
from services.router.tool_parsers.trailing import TrailingCallParser

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


def parse_pythonic(text: str) -> list[ToolCall] | None:
    text = text.removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
    try:
        tree = ast.parse(text, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = [_call(node) for node in tree.elts]
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def _call(node: ast.expr) -> ToolCall | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    if any(kw.arg is None for kw in node.keywords):  # **kwargs
        return None
    args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    return ToolCall(id=openai_call_id(), name=node.func.id, arguments=json.dumps(args, ensure_ascii=False))


# Python literals, as the model writes argument values (EBNF in xgrammar's dialect).
_VALUE_RULES = r'''
value ::= string | number | "True" | "False" | "None" | list | dict
string ::= "\"" ([^"\\\r\n] | "\\" [^\r\n])* "\"" | "'" ([^'\\\r\n] | "\\" [^\r\n])* "'"
number ::= "-"? [0-9]+ ("." [0-9]+)? ([eE] [-+]? [0-9]+)?
list ::= "[" (value (sep value)*)? "]"
dict ::= "{" (string ":" " "? value (sep string ":" " "? value)*)? "}"
sep ::= "," " "?
'''


def _ebnf_string(text: str) -> str:
    return json.dumps(text)  # tool and parameter names are [A-Za-z0-9_-]: JSON quoting is EBNF quoting


def pythonic_ebnf(tools: Sequence[dict[str, Any]], parallel: bool) -> str:
    rules = []
    for i, tool in enumerate(tools):
        props = list((st.parameters_schema(tool).get("properties") or {}).keys())
        arg_name = " | ".join(_ebnf_string(p) for p in props) if props else "[A-Za-z_] [A-Za-z0-9_]*"
        rules.append(f"arg_{i} ::= ({arg_name}) \"=\" value")
        rules.append(f"call_{i} ::= {_ebnf_string(tool['function']['name'] + '(')} "
                     f"(arg_{i} (sep arg_{i})*)? \")\"")
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    more = " (sep call)*" if parallel else ""
    return "\n".join([f'root ::= "[" call{more} "]"', f"call ::= {calls}", *rules]) + _VALUE_RULES


class PythonicFormat(ToolCallFormat):
    name = "pythonic"

    def stream_parser(self) -> ToolStreamParser:
        return TrailingCallParser(parse_pythonic, leading=(PYTHON_START, "["))

    def grammar(self, tools: Sequence[dict[str, Any]], choice: ToolChoice, parallel: bool) -> str | None:
        if choice.mode in ("none", "auto") or not tools:
            return None
        for i, tool in enumerate(tools):
            if not tool["function"]["name"].isidentifier():  # "get-time(...)" would not parse back
                raise InvalidRequestError(f"tools[{i}].function.name", "the served model writes calls as Python: "
                                          "with tool_choice 'required' or a function, names must be identifiers")
        chosen = st.chosen_tools(tools, choice)
        ebnf = pythonic_ebnf(chosen, parallel and choice.mode != "function")
        return st.structural_tag({"type": "grammar", "grammar": ebnf})
