"""The tokenizer files of Weft's tiny test checkpoints: a byte-level BPE trained on a
small built-in corpus, ChatML special tokens and a tool-calling chat template.

Training is deterministic (same corpus, same trainer settings -> same merges), so the
written files are byte-identical run to run. The pipeline mirrors modern byte-level
tokenizers (Llama 3, Qwen2): NFC, a regex split into words / numbers / punctuation /
whitespace, then byte-level mapping, so every string round-trips.
"""
from __future__ import annotations

import functools
import json
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2

# The pre-tokenizer split of Qwen2's tokenizer.json (GPT-4 style: contractions, words
# with one leading non-letter, single digits, punctuation runs, newlines, spaces).
# It must be exactly this: for model_type "qwen2" transformers ignores tokenizer.json's
# pipeline and rebuilds Qwen2's, keeping only the vocabulary and merges.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# A few KB of mixed prose, code and non-ASCII text, so BPE learns common English
# pieces, indentation and symbols, and multi-byte characters span several tokens.
CORPUS = """\
The engine reads a request, schedules it, and streams tokens back to the caller.
Each request carries a prompt, a sampling policy, and a budget of new tokens.
When the cache is full, the scheduler preempts the youngest sequence and retries.
A block pool hands out fixed-size pages of key and value memory; blocks are shared
between requests whose prompts begin with the same tokens, and freed when no one
holds them. Agents call tools, wait for results, and then continue the conversation.
Good tests state a behaviour in their name and check it; they never sleep to wait.
The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly.
She said: "It's fine, we'll see." He'd rather not, but they've already left.
Numbers appear too: 0, 1, 2, 3, 10, 42, 128, 2048, 4096, 65536, 3.14159, -7, 1e-6.
Dates like 2024-05-17 and times like 09:30 are common in logs and reports.

def schedule(requests: list[Request], budget: int) -> list[Request]:
    \"\"\"Pick the requests that fit in this step's token budget.\"\"\"
    chosen = []
    for request in sorted(requests, key=lambda r: r.arrival_time):
        cost = len(request.prompt_ids) + request.max_new_tokens
        if cost > budget:
            continue
        chosen.append(request)
        budget -= cost
    return chosen

class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        self.free = list(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    def allocate(self) -> int | None:
        if not self.free:
            return None
        block_id = self.free.pop()
        self.ref_counts[block_id] = 1
        return block_id

for (int i = 0; i < n; ++i) { sum += values[i] * weights[i]; }
SELECT id, name FROM users WHERE active = 1 ORDER BY name;
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
<tool_call>{"name": "search", "arguments": {"query": "weft inference"}}</tool_call>
$ weft model make-tiny /tmp/tiny --preset small --arch qwen2 && echo ok

Un café au lait, s'il vous plaît. Le naïve garçon a mangé une crème brûlée.
Über den Wolken muss die Freiheit wohl grenzenlos sein. Straße, Größe, Mädchen.
El niño pidió una piña en la montaña; ¿dónde está la estación?
日本語のテキストも少し含めます。東京は大きな都市です。こんにちは、世界。
中文也可以：你好，世界。机器学习模型需要数据。
Русский текст: привет, мир. Греческий: αβγ δέλτα.
Emoji appear in chat: 🙂 👍 🚀 🎉 ❤️ and symbols like → ≤ ≥ ∑ π °C €5 £3.
"""


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(max_vocab_size: int) -> str:
    """Train once per target size; the JSON string is cached, the object is not
    (tokenizers objects are mutable)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=max_vocab_size,
        # Merge even once-seen pairs: the corpus is small and the tiny preset's
        # 1024-id vocabulary should be fully used.
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, so any text (any UTF-8 byte) can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return tokenizer.to_str()


def build_tokenizer(max_vocab_size: int, add_bos: bool) -> Tokenizer:
    """A trained tokenizer with at most ``max_vocab_size`` ids. With ``add_bos`` the
    post-processor prepends ``<|endoftext|>`` as BOS (GPT-2 style), else it adds nothing."""
    tokenizer = Tokenizer.from_str(_trained_tokenizer_json(max_vocab_size))
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{ENDOFTEXT}:0 $A:0",
            pair=f"{ENDOFTEXT}:0 $A:0 {ENDOFTEXT}:1 $B:1",
            special_tokens=[(ENDOFTEXT, tokenizer.token_to_id(ENDOFTEXT))],
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


# ChatML with tools, in the style of Qwen2.5: tool schemas as JSON lines in the system
# turn, assistant tool calls as <tool_call>{json}</tool_call>, tool results as
# <tool_response> blocks in a user turn (consecutive results share one turn).
CHAT_TEMPLATE = r"""
{%- macro content_text(content) -%}
    {%- if content is string -%}{{- content -}}
    {%- elif content -%}
        {%- for part in content if part.type == 'text' -%}{{- part.text -}}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {{- content_text(messages[0].content) if has_system else 'You are a helpful assistant.' -}}
    {{- '\n\n# Tools\n\nYou can call these functions. Their JSON signatures are inside <tools></tools>:\n<tools>' -}}
    {%- for tool in tools -%}{{- '\n' ~ (tool | tojson) -}}{%- endfor -%}
    {{- '\n</tools>\n\nTo call one, reply with a JSON object naming the function and its arguments' -}}
    {{- ' inside <tool_call></tool_call> tags:\n<tool_call>\n' -}}
    {{- '{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\n' ~ content_text(messages[0].content) ~ '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages[1 if has_system else 0:] -%}
    {%- if message.role == 'user' -%}
        {{- '<|im_start|>user\n' ~ content_text(message.content) ~ '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\n' ~ content_text(message.content) -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if not loop.first or message.content -%}{{- '\n' -}}{%- endif -%}
            {%- set arguments = fn.arguments if fn.arguments is string else fn.arguments | tojson -%}
            {{- '<tool_call>\n{"name": ' ~ (fn.name | tojson) ~ ', "arguments": ' ~ arguments ~ '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' ~ content_text(message.content) ~ '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- else -%}
        {{- raise_exception('Unsupported chat role: ' ~ message.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""


def tokenizer_config(add_bos: bool, model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json contents (special tokens, chat template, flags)."""
    added = {
        str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i, tok in enumerate(SPECIAL_TOKENS)
    }
    return {
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": ENDOFTEXT if add_bos else None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def special_tokens_map(add_bos: bool) -> dict[str, Any]:
    """special_tokens_map.json contents (legacy file; agrees with tokenizer_config)."""
    result: dict[str, Any] = {"additional_special_tokens": [IM_START, IM_END]}
    if add_bos:
        result["bos_token"] = ENDOFTEXT
    result.update({"eos_token": IM_END, "pad_token": ENDOFTEXT})
    return result


def dumps(value: Any) -> str:
    """Stable JSON text for the checkpoint files (sorted keys, trailing newline)."""
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
