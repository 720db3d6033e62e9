"""The grammars the tool-call formats hand the engine, compiled for real with xgrammar over
SmolLM2's tokenizer and walked token by token: a correct call is accepted (then EOS), a
call of the wrong function, with a wrong-typed argument, or text where only a call may
stand is rejected. What a grammar accepts must parse back into the same calls."""
from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from services.router.errors import InvalidRequestError
from services.router.tool_parsers import FORMATS, ToolChoice
from weft.models.sources import resolve_model

TOOLS = (
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "now"}},  # no parameters: any object
)
AUTO, REQUIRED, NOW = ToolChoice("auto"), ToolChoice("required"), ToolChoice("function", "now")


@pytest.fixture(scope="module")
def walk():
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m-instruct")))
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer))

    def accepts(grammar: str, output: str) -> bool:
        """Whether the engine could write ``output`` and then stop under ``grammar``."""
        matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(grammar))
        for token in tokenizer.encode(output, add_special_tokens=False):
            if not matcher.accept_token(token):
                return False
        return matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()
    return accepts


# Per format: (a call of get_weather(city="Paris", days=3), of now(), get_weather's
# days as a string, a call of an unknown function). Each writes one call.
CALLS = {
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
               '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}}\n</tool_call>',
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
    "smollm2": ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]</tool_call>',
                '<tool_call>[{"name": "now", "arguments": {}}]</tool_call>',
                '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}}]</tool_call>',
                '<tool_call>[{"name": "get_time", "arguments": {}}]</tool_call>'),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
                    '{"name": "now", "parameters": {}}',
                    '{"name": "get_weather", "parameters": {"city": "Paris", "days": "3"}}',
                    '{"name": "get_time", "parameters": {}}'),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
                '[TOOL_CALLS][{"name": "now", "arguments": {}}]',
                '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}}]',
                '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]'),
}
# Two calls in the format's parallel form.
TWO_CALLS = {
    "hermes": CALLS["hermes"][0] + "\n" + CALLS["hermes"][1],
    "smollm2": '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
               '{"name": "now", "arguments": {}}]</tool_call>',
    "llama3_json": CALLS["llama3_json"][0] + "; " + CALLS["llama3_json"][1],
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
               '{"name": "now", "arguments": {}}]',
    "pythonic": '[get_weather(city="Paris"), now()]',
}


def _names(fmt: str, text: str) -> list[str]:
    return [c.name for c in FORMATS[fmt].parse(text)[1]]


@pytest.mark.parametrize("fmt", sorted(CALLS))
def test_required_accepts_only_a_valid_call_of_a_tool(walk, fmt):
    good, now, wrong_type, unknown = CALLS[fmt]
    grammar = FORMATS[fmt].grammar(TOOLS, REQUIRED, parallel=False)
    assert walk(grammar, good) and walk(grammar, now)
    assert _names(fmt, good) == ["get_weather"] and json.loads(FORMATS[fmt].parse(good)[1][0].arguments) == {
        "city": "Paris", "days": 3}
    assert not walk(grammar, wrong_type)
    assert not walk(grammar, unknown)
    assert not walk(grammar, "The weather is fine.")  # the output is only the call
    assert not walk(grammar, good + "\nDone.")
    assert not walk(grammar, TWO_CALLS[fmt])  # parallel_tool_calls: false means exactly one
    missing_city = good.replace('"city": "Paris", ', "")
    assert not walk(grammar, missing_city)  # a required parameter


@pytest.mark.parametrize("fmt", sorted(TWO_CALLS))
def test_required_with_parallel_calls_accepts_several(walk, fmt):
    grammar = FORMATS[fmt].grammar(TOOLS, REQUIRED, parallel=True)
    assert walk(grammar, TWO_CALLS[fmt])
    assert _names(fmt, TWO_CALLS[fmt]) == ["get_weather", "now"]


@pytest.mark.parametrize("fmt", sorted(CALLS))
def test_a_named_function_accepts_only_that_function(walk, fmt):
    good, now, _, _ = CALLS[fmt]
    grammar = FORMATS[fmt].grammar(TOOLS, NOW, parallel=True)
    assert walk(grammar, now)
    assert not walk(grammar, good)
    assert not walk(grammar, TWO_CALLS[fmt])


@pytest.mark.parametrize("fmt", sorted(CALLS))
def test_auto_lets_text_through_but_constrains_a_call_once_opened(walk, fmt):
    good, _, wrong_type, unknown = CALLS[fmt]
    grammar = FORMATS[fmt].grammar(TOOLS, AUTO, parallel=True)
    assert walk(grammar, "It is sunny in Paris today.")
    assert walk(grammar, good)
    assert not walk(grammar, wrong_type)
    assert not walk(grammar, unknown)


def test_tagged_formats_let_text_stand_before_a_call_under_auto(walk):
    for fmt in ("hermes", "smollm2"):
        text = "Let me check. " + CALLS[fmt][0]
        assert walk(FORMATS[fmt].grammar(TOOLS, AUTO, parallel=True), text)
        assert FORMATS[fmt].parse(text)[0] == "Let me check. "


def test_pythonic_required_is_best_effort_names_and_parameter_names(walk):
    grammar = FORMATS["pythonic"].grammar(TOOLS, REQUIRED, parallel=False)
    assert walk(grammar, '[get_weather(city="Paris", days=3)]')
    assert walk(grammar, "[now()]")
    assert not walk(grammar, '[get_time(city="Paris")]')  # unknown function
    assert not walk(grammar, '[get_weather(town="Paris")]')  # not one of its parameters
    assert not walk(grammar, "Sunny.")
    assert not walk(grammar, TWO_CALLS["pythonic"])
    assert walk(FORMATS["pythonic"].grammar(TOOLS, REQUIRED, parallel=True), TWO_CALLS["pythonic"])
    assert not walk(FORMATS["pythonic"].grammar(TOOLS, NOW, parallel=True), '[get_weather(city="Paris")]')


def test_the_served_smollm2_checkpoint_gets_the_smollm2_format():
    from services.router.tool_parsers import select_format
    from services.shared.tokenizer import Tokenizer

    template = Tokenizer.from_dir(resolve_model("smollm2-135m-instruct")).chat_template
    assert select_format(template).name == "smollm2"


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_no_tools_mean_no_constraint(fmt):
    assert FORMATS[fmt].grammar((), AUTO, parallel=True) is None
    assert FORMATS[fmt].grammar((), ToolChoice("none"), parallel=True) is None


@pytest.mark.parametrize("fmt", sorted(CALLS))
def test_none_forbids_the_call_marker_and_lets_text_through(walk, fmt):
    """SmolLM2 wrote ``<tool_call>[...]`` as text under "none" when nothing constrained it."""
    grammar = FORMATS[fmt].grammar(TOOLS, ToolChoice("none"), parallel=True)
    assert walk(grammar, "It is sunny in Paris, 18 degrees. {\"city\": [1, 2]} <tool> [TOOL]")
    for call in CALLS[fmt][:2]:
        assert not walk(grammar, "Sure. " + call)


def test_pythonic_none_is_not_constrained():
    """Its only marker, "[", is ordinary text."""
    assert FORMATS["pythonic"].grammar(TOOLS, ToolChoice("none"), parallel=True) is None


def test_pythonic_auto_is_not_constrained():
    """Its only trigger would be "[", which ordinary text writes (docs/tools.md)."""
    assert FORMATS["pythonic"].grammar(TOOLS, AUTO, parallel=True) is None


def test_the_real_smollm2_writes_a_valid_call_when_the_grammar_requires_one():
    """SmolLM2-135M answers this in prose when free (docs/tools.md); under the smollm2
    format's "required" grammar, greedy decoding with xgrammar's mask gives a call that
    parses back and fits the schema."""
    import torch
    from transformers import AutoModelForCausalLM

    from weft.models.chat_templates import SMOLLM2_TOOLS_TEMPLATE

    path = str(resolve_model("smollm2-135m-instruct"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size)
    grammar = FORMATS["smollm2"].grammar(TOOLS, REQUIRED, parallel=False)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_structural_tag(grammar))
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What's the weather in Paris?"}],
                                           tools=list(TOOLS), chat_template=SMOLLM2_TOOLS_TEMPLATE,
                                           add_generation_prompt=True, tokenize=False)
    ids, cache, out = tokenizer(prompt, return_tensors="pt").input_ids, None, []
    with torch.no_grad():
        for _ in range(48):
            result = model(ids, past_key_values=cache, use_cache=True)
            cache, logits = result.past_key_values, result.logits[:, -1, :]
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax(-1))
            assert matcher.accept_token(token)
            if matcher.is_terminated():
                break
            out.append(token)
            ids = torch.tensor([[token]])
    assert matcher.is_terminated()  # the call closed and only EOS could follow
    content, calls = FORMATS["smollm2"].parse(tokenizer.decode(out))
    assert content is None and [c.name for c in calls] in (["get_weather"], ["now"])
    args = json.loads(calls[0].arguments)
    assert calls[0].name == "now" or isinstance(args["city"], str)


def test_grammars_refuse_what_they_cannot_express_naming_the_field():
    with pytest.raises(InvalidRequestError) as err:
        FORMATS["hermes"].grammar(TOOLS, ToolChoice("function", "get_time"), parallel=True)
    assert err.value.field == "tool_choice"
    dashed = TOOLS + ({"type": "function", "function": {"name": "get-time"}},)
    with pytest.raises(InvalidRequestError) as err:
        FORMATS["pythonic"].grammar(dashed, REQUIRED, parallel=True)
    assert err.value.field == "tools[2].function.name"
    assert FORMATS["hermes"].grammar(dashed, REQUIRED, parallel=True)  # JSON formats spell any name


def test_calls_are_written_compact(walk):
    """Whitespace inside a call is at most one character in a row, and only inside its
    arguments: a model cannot spend its budget on pretty-printing (issue 15: SmolLM2 at
    temperature 1 pretty-printed parallel calls until max_tokens cut the array)."""
    for fmt in ("hermes", "smollm2", "mistral", "llama3_json"):
        grammar = FORMATS[fmt].grammar(TOOLS, REQUIRED, parallel=True)
        assert walk(grammar, TWO_CALLS[fmt])
    hermes = FORMATS["hermes"].grammar(TOOLS, REQUIRED, parallel=False)
    assert walk(hermes, '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris",\n"days": 3}}\n</tool_call>')
    assert not walk(hermes, '<tool_call>\n{\n  "name": "now",\n  "arguments": {}\n}\n</tool_call>')
    assert not walk(hermes, '<tool_call>\n{"name": "get_weather", "arguments": {\n  "city": "Paris"}}\n</tool_call>')
    smollm2 = FORMATS["smollm2"].grammar(TOOLS, REQUIRED, parallel=True)
    assert not walk(smollm2, '<tool_call>[{"name": "now", "arguments": {}},\n {"name": "now", "arguments": {}}]</tool_call>')
