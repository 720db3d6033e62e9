"""Intent shift on embeddings (the cachestore's Embed) with the bigram score as fallback.

The fake-embedder tests need no model; the labelled-set test runs the real MiniLM
checkpoint through ``EmbeddingDistance`` on ``tests/data/intent_shift_pairs.json``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.scheduler.policy.intent_shift import (
    DEFAULT_EMBEDDING_THRESHOLD,
    DEFAULT_THRESHOLD,
    EmbeddingDistance,
    HashedBowDistance,
    IntentShiftDetector,
    IntentSignalUnavailable,
    make_intent_detector,
)

PAIRS = Path(__file__).resolve().parents[2] / "data" / "intent_shift_pairs.json"
TURN = list(range(100, 120))  # 20 tokens: long enough to be judged
CONTEXT = list(range(1, 60))


def detok(ids):
    return " ".join(f"t{i}" for i in ids)


def fixed_embed(a, b):
    """An embedder that answers the two vectors ``a`` (context) and ``b`` (turn)."""
    return lambda texts: [a, b]


def down(texts):
    raise ConnectionError("cachestore unreachable")


def test_embedding_distance_is_one_minus_cosine_clamped():
    assert EmbeddingDistance(fixed_embed([1, 0], [1, 0]), detok).distance(CONTEXT, TURN) == pytest.approx(0.0)
    assert EmbeddingDistance(fixed_embed([1, 0], [0, 3]), detok).distance(CONTEXT, TURN) == pytest.approx(1.0)
    assert EmbeddingDistance(fixed_embed([1, 0], [-1, 0]), detok).distance(CONTEXT, TURN) == 1.0  # clamped


def test_embedding_distance_reads_the_context_tail_and_the_turn_head():
    seen = []
    metric = EmbeddingDistance(lambda texts: seen.extend(texts) or [[1, 0], [1, 0]], detok, context_window=3)
    metric.distance([1, 2, 3, 4, 5], [7, 8, 9, 10])
    assert seen == ["t3 t4 t5", "t7 t8 t9"]


def test_an_unreachable_embedder_raises_signal_unavailable():
    with pytest.raises(IntentSignalUnavailable):
        EmbeddingDistance(down, detok).distance(CONTEXT, TURN)


def test_a_far_turn_shifts_on_the_embedding_signal():
    detector = make_intent_detector(fixed_embed([1, 0], [0, 1]), detok)
    decision = detector.decide(CONTEXT, TURN)
    assert decision.shifted and decision.signal == "embedding"
    assert decision.threshold == DEFAULT_EMBEDDING_THRESHOLD


def test_a_near_turn_does_not_shift_even_if_its_bigrams_differ():
    # Disjoint token ids: the bigram distance is 1.0, the embeddings say "same topic".
    assert HashedBowDistance().distance(CONTEXT, TURN) == pytest.approx(1.0)
    assert not make_intent_detector(fixed_embed([1, 0], [0.99, 0.1]), detok).shifted(CONTEXT, TURN)


def test_the_bigram_fallback_decides_when_the_cachestore_is_down():
    decision = make_intent_detector(down, detok).decide(CONTEXT, TURN)
    assert decision.signal == "bigram" and decision.threshold == DEFAULT_THRESHOLD
    assert decision.shifted  # disjoint ids: bigram distance 1.0 >= 0.9
    assert not make_intent_detector(down, detok).shifted(CONTEXT, CONTEXT[-20:])  # same ids: 0.0


def test_without_a_fallback_an_unavailable_signal_keeps_the_kv():
    decision = IntentShiftDetector(EmbeddingDistance(down, detok), 0.8).decide(CONTEXT, TURN)
    assert not decision.shifted and decision.signal == "none"


def test_short_turns_and_empty_contexts_are_not_judged():
    calls = []
    detector = make_intent_detector(lambda texts: calls.append(texts) or [[1, 0], [0, 1]], detok)
    assert detector.decide(CONTEXT, TURN[:7]).signal == "none"
    assert detector.decide([], TURN).signal == "none"
    assert calls == []  # no RPC for a turn that cannot shift


def test_without_an_embedder_the_detector_is_bigram_only():
    detector = make_intent_detector()
    assert isinstance(detector.metric, HashedBowDistance) and detector.fallback is None


def test_thresholds_out_of_range_are_refused():
    with pytest.raises(ValueError):
        IntentShiftDetector(HashedBowDistance(), threshold=0.0)
    with pytest.raises(ValueError):
        IntentShiftDetector(HashedBowDistance(), fallback=HashedBowDistance(), fallback_threshold=1.5)


def test_minilm_at_the_shipped_threshold_separates_the_labelled_set():
    """The issue's symptom: a real topic change must be flagged. Token ids from MiniLM's
    own tokenizer, detokenised as the scheduler would, embedded by the real model."""
    from services.cachestore.embedder import MiniLmEmbedder

    embedder = MiniLmEmbedder(num_threads=1)
    embedder.load()
    tok = embedder._tokenizer
    detector = make_intent_detector(lambda texts: embedder.embed(texts).tolist(),
                                    lambda ids: tok.decode(ids, skip_special_tokens=True))
    pairs = json.loads(PAIRS.read_text())["pairs"]
    assert len(pairs) >= 40
    decisions = [detector.decide(tok.encode(p["context"], add_special_tokens=False),
                                 tok.encode(p["turn"], add_special_tokens=False)) for p in pairs]
    assert all(d.signal in ("embedding", "none") for d in decisions)
    flagged = [d.shifted for d in decisions]
    labels = [p["shift"] for p in pairs]
    tp = sum(f and y for f, y in zip(flagged, labels))
    precision, recall = tp / max(1, sum(flagged)), tp / sum(labels)
    assert precision >= 0.85 and recall >= 0.75, (precision, recall)
