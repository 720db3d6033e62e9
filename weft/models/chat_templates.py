"""Tools-aware chat templates for models whose shipped template cannot render tools.

SmolLM2-Instruct's GGUF carries a bare ChatML template: it ignores ``tools``, drops an
assistant's ``tool_calls``, and fails on an assistant message without ``content``
("'dict object' has no attribute 'content'", which the router answers with a 400).
The model was nevertheless tuned for function calling (the APIGen data of its SFT mix),
with this convention:

- the tools are listed as a JSON array inside ``<tools></tools>`` in the system turn;
- the model answers with a JSON *array* of calls inside one tag,
  ``<tool_call>[{"name": "f", "arguments": {...}}, ...]</tool_call>``
  (the router's ``smollm2`` tool-call format, recognised from this template's
  ``<tool_call>[``, parses that form and makes the engine write it under
  ``tool_choice`` "required" or a named function: services/router/tool_parsers/);
- a tool's result comes back as a ChatML ``tool`` turn.

``SMOLLM2_TOOLS_TEMPLATE`` renders all three. Without tools it renders exactly what the
GGUF's template renders (the default SmolLM system prompt when the conversation has no
system message, every turn ``<|im_start|>role\\ncontent<|im_end|>``), so replacing the
template never changes a plain chat's prompt; ``tools_template_for`` checks that on probe
conversations before it hands the replacement out.

Written with ``{%-``/``-%}`` everywhere so the output does not depend on the
environment's ``trim_blocks``/``lstrip_blocks`` (transformers and
``services.shared.tokenizer`` set both).
"""
from __future__ import annotations

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# The instructions of the tools turn (our words; the format is the model's).
_TOOLS_INTRO = (
    "You can call functions to answer the user. Choose from the functions below the ones "
    "the request needs and fill in their arguments from it. If no function fits, say so; "
    "if the request lacks an argument a function requires, ask for it.\\n\\n"
    "Functions, as JSON:\\n"
)
_TOOLS_FORMAT = (
    "\\n\\nTo call functions, reply with only a JSON array of calls inside <tool_call></tool_call>, "
    "one object per call, arguments of the right types:\\n"
    '<tool_call>[{"name": "function_name", "arguments": {"argument": "value"}}]</tool_call>\\n'
    "When no function is needed, reply in plain text."
)

SMOLLM2_TOOLS_TEMPLATE = (
    r"""
{%- macro text(content) -%}
    {%- if content is string -%}{{- content -}}
    {%- elif content -%}{%- for part in content if part.type == 'text' -%}{{- part.text -}}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- macro call_json(call) -%}
    {%- set fn = call.function if call.function is defined else call -%}
    {%- set args = fn.arguments if fn.arguments is defined and fn.arguments is not none else {} -%}
    {{- '{"name": ' ~ (fn.name | tojson) ~ ', "arguments": ' ~ (args if args is string else args | tojson) ~ '}' -}}
{%- endmacro -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if has_system -%}{{- text(messages[0].content) ~ '\n\n' -}}{%- endif -%}
    {{- '"""
    + _TOOLS_INTRO
    + r"""<tools>[' -}}
    {%- for tool in tools -%}
        {%- if not loop.first -%}{{- ', ' -}}{%- endif -%}
        {{- (tool.function if tool.function is defined else tool) | tojson -}}
    {%- endfor -%}
    {{- ']</tools>"""
    + _TOOLS_FORMAT
    + r"""<|im_end|>\n' -}}
{%- endif -%}
{%- for message in (messages[1:] if tools and has_system else messages) -%}
    {%- if not tools and loop.first and message.role != 'system' -%}
        {{- '<|im_start|>system\n"""
    + SMOLLM2_DEFAULT_SYSTEM
    + r"""<|im_end|>\n' -}}
    {%- endif -%}
    {%- if message.role == 'assistant' and message.tool_calls -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if message.content -%}{{- text(message.content) ~ '\n' -}}{%- endif -%}
        {{- '<tool_call>[' -}}
        {%- for call in message.tool_calls -%}
            {%- if not loop.first -%}{{- ', ' -}}{%- endif -%}
            {{- call_json(call) -}}
        {%- endfor -%}
        {{- ']</tool_call><|im_end|>\n' -}}
    {%- else -%}
        {{- '<|im_start|>' ~ message.role ~ '\n' ~ text(message.content) ~ '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""
).strip()

# GGUF ``general.basename`` (lower case) -> the tools-aware template of that family.
_TEMPLATES_BY_BASENAME = {"smollm2": SMOLLM2_TOOLS_TEMPLATE}

# Plain conversations the replacement must render exactly as the GGUF's own template.
PROBE_CONVERSATIONS: tuple[tuple[dict[str, str], ...], ...] = (
    ({"role": "user", "content": "Hi"},),
    ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}),
    ({"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! How can I help?"},
     {"role": "user", "content": "Name a colour.\nJust one."}),
    ({"role": "user", "content": "a"}, {"role": "system", "content": "late system"},
     {"role": "assistant", "content": ""}),
)


def tools_template_for(basename: str, gguf_template: str | None) -> str | None:
    """The tools-aware replacement of ``gguf_template`` for the model family ``basename``
    (GGUF ``general.basename``, e.g. "smollm2"), or None when there is none.

    None too when ``gguf_template`` renders some probe conversation differently from the
    replacement (a fine-tune with its own template or system prompt): a replacement may
    add tools, never change what a plain chat renders to."""
    replacement = _TEMPLATES_BY_BASENAME.get(basename.strip().lower())
    if replacement is None:
        return None
    if gguf_template is None or renders_like(gguf_template, replacement):
        return replacement
    return None


def renders_like(template_a: str, template_b: str) -> bool:
    """Whether both templates render every probe conversation to the same text, with and
    without the generation prompt (False when either fails to compile or render)."""
    try:
        a, b = _compile(template_a), _compile(template_b)
        return all(a.render(messages=list(c), tools=None, add_generation_prompt=g)
                   == b.render(messages=list(c), tools=None, add_generation_prompt=g)
                   for c in PROBE_CONVERSATIONS for g in (True, False))
    except jinja2.TemplateError:
        return False


def _compile(source: str) -> jinja2.Template:
    """A template in an environment like the one chat templates run in (sandboxed, trim
    and lstrip blocks); enough for plain chats, which need no ``tojson``."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(source)
