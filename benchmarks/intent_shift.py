"""Intent shift on a labelled set: the hashed-bigram score vs MiniLM cosine distance.

    python -m benchmarks.intent_shift [--pairs tests/data/intent_shift_pairs.json]

Each pair is two consecutive user turns of one session, labelled by hand ``shift`` (the
second turn starts a new topic) or not. For each pair we compute

  * the scheduler's current signal, ``HashedBowDistance`` over the serving model's token
    ids (SmolLM2's tokenizer; the plain text of each turn, no chat template), and
  * the cachestore's embedding distance, ``1 - cos(MiniLM(context), MiniLM(turn))``
    (``MiniLmEmbedder``, the model behind ``CacheStore.Embed``),

then precision / recall / F1 of "distance >= threshold" at the shipped threshold and at
the threshold that maximises F1 on the set (ties: the higher threshold, since a false
shift throws away KV the next hop needed). To show how much of that is fitted to the
set, a two-fold check picks the threshold on even pairs and scores odd pairs, and vice
versa. Writes ``benchmarks/results/intent_shift.md`` and ``.json``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import NamedTuple

from tqdm import tqdm

from services.cachestore.embedder import MiniLmEmbedder
from services.scheduler.policy.intent_shift import (
    DEFAULT_EMBEDDING_THRESHOLD,
    DEFAULT_THRESHOLD,
    EmbeddingDistance,
    HashedBowDistance,
)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PAIRS = ROOT / "tests" / "data" / "intent_shift_pairs.json"
RESULTS = ROOT / "benchmarks" / "results"
SWEEP = (0.70, 0.75, 0.80, 0.85, 0.90)  # thresholds tabulated for every signal


class Scores(NamedTuple):
    precision: float
    recall: float
    f1: float
    num_flagged: int


def score(distances: list[float], labels: list[bool], threshold: float) -> Scores:
    flagged = [d >= threshold for d in distances]
    tp = sum(f and y for f, y in zip(flagged, labels))
    precision = tp / sum(flagged) if any(flagged) else 1.0  # nothing flagged: no false shift
    recall = tp / sum(labels) if any(labels) else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return Scores(precision, recall, f1, sum(flagged))


def best_threshold(distances: list[float], labels: list[bool]) -> float:
    """The candidate (a midpoint between sorted distances) with the highest F1; ties → higher."""
    ds = sorted(set(distances))
    candidates = [(a + b) / 2 for a, b in zip(ds, ds[1:])] or ds
    return max(candidates, key=lambda t: (score(distances, labels, t).f1, t))


def two_fold(distances: list[float], labels: list[bool]) -> Scores:
    """Threshold fitted on one half (even / odd pairs), scored on the other; both folds pooled."""
    flagged_true = flagged = tp = 0
    for fit, held in ((0, 1), (1, 0)):
        t = best_threshold(distances[fit::2], labels[fit::2])
        d, y = distances[held::2], labels[held::2]
        f = [x >= t for x in d]
        tp += sum(a and b for a, b in zip(f, y))
        flagged += sum(f)
        flagged_true += sum(y)
    precision = tp / flagged if flagged else 1.0
    recall = tp / flagged_true if flagged_true else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return Scores(precision, recall, f1, flagged)


def load_tokenizer(spec: str):
    from transformers import AutoTokenizer

    from weft.models.sources import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(spec)))


def chatml_turn(text: str) -> str:
    """The tokens a new user message adds to a ChatML session (what the scheduler's
    ``new_turn`` holds): the user block and the assistant header."""
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def measure(pairs: list[dict], tokenizer_spec: str) -> dict:
    """Four signals per pair: {bigram, minilm} x {plain text, as the scheduler sees it}.
    "chat" = the context chat-templated (system prompt included) and the turn as the
    ChatML block it adds; MiniLM then reads ``EmbeddingDistance``'s detokenised text."""
    tok = load_tokenizer(tokenizer_spec)
    embedder = MiniLmEmbedder()
    bow = HashedBowDistance()
    emb = EmbeddingDistance(lambda texts: embedder.embed(texts).tolist(),
                            lambda ids: tok.decode(ids, skip_special_tokens=True))

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    rows = []
    for p in tqdm(pairs, desc="pairs", unit="pair"):
        plain = ids(p["context"]), ids(p["turn"])
        chat_ctx = tok.apply_chat_template([{"role": "user", "content": p["context"]}], tokenize=False,
                                           add_generation_prompt=True)
        chat = ids(chat_ctx), ids(chatml_turn(p["turn"]))
        rows.append({"shift": p["shift"], "bigram": bow.distance(*plain), "bigram_chat": bow.distance(*chat),
                     "minilm": emb.distance(*plain), "minilm_chat": emb.distance(*chat),
                     "num_turn_tokens": len(plain[1])})
    labels = [r["shift"] for r in rows]
    report = {"num_pairs": len(rows), "num_shifts": sum(labels), "tokenizer": tokenizer_spec, "rows": rows,
              "metrics": {}}
    shipped_of = {"bigram": DEFAULT_THRESHOLD, "bigram_chat": DEFAULT_THRESHOLD,
                  "minilm": DEFAULT_EMBEDDING_THRESHOLD, "minilm_chat": DEFAULT_EMBEDDING_THRESHOLD}
    for name, shipped in shipped_of.items():
        d = [r[name] for r in rows]
        same = [x for x, y in zip(d, labels) if not y]
        changed = [x for x, y in zip(d, labels) if y]
        fitted = best_threshold(d, labels)
        report["metrics"][name] = {
            "shipped_threshold": shipped, "at_shipped": score(d, labels, shipped)._asdict(),
            "fitted_threshold": fitted, "at_fitted": score(d, labels, fitted)._asdict(),
            "two_fold": two_fold(d, labels)._asdict(),
            "sweep": {f"{t:.2f}": score(d, labels, t)._asdict() for t in SWEEP},
            "same_topic_range": [min(same), max(same)], "topic_change_range": [min(changed), max(changed)],
        }
    return report


def markdown(report: dict, command: str) -> str:
    lines = [
        "# Intent shift: hashed bigrams vs MiniLM embeddings",
        "",
        f"`{command}` — {report['num_pairs']} hand-labelled pairs of consecutive user turns "
        f"({report['num_shifts']} topic changes), `tests/data/intent_shift_pairs.json`. Bigram distance over "
        f"`{report['tokenizer']}` token ids; MiniLM distance = 1 − cosine of all-MiniLM-L6-v2 embeddings "
        "(the cachestore's `Embed`). `_chat` rows: the context chat-templated (system prompt "
        "included) and the turn as the ChatML block it adds — what the scheduler's detector sees; MiniLM "
        "reads `EmbeddingDistance`'s detokenised text. Deterministic: no timing involved.",
        "",
        "| signal | threshold | precision | recall | F1 | flagged |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in report["metrics"].items():
        for label, t, s in (("shipped", m["shipped_threshold"], m["at_shipped"]),
                            ("fitted on the set", m["fitted_threshold"], m["at_fitted"]),
                            ("two-fold (fit half, score other half)", None, m["two_fold"])):
            ts = f"{t:.3f} ({label})" if t is not None else label
            lines.append(f"| {name} | {ts} | {s['precision']:.2f} | {s['recall']:.2f} | {s['f1']:.2f} "
                         f"| {s['num_flagged']} |")
    lines += ["", "Precision / recall per threshold:", "",
              "| signal | " + " | ".join(f"{t:.2f}" for t in SWEEP) + " |",
              "|---|" + "---|" * len(SWEEP)]
    for name, m in report["metrics"].items():
        cells = [f"{v['precision']:.2f} / {v['recall']:.2f}" for v in m["sweep"].values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Distance ranges (min – max):", ""]
    for name, m in report["metrics"].items():
        (a, b), (c, d) = m["same_topic_range"], m["topic_change_range"]
        lines.append(f"- {name}: same topic {a:.3f} – {b:.3f}; topic change {c:.3f} – {d:.3f}")
    lines += ["", "The embedding threshold (`DEFAULT_EMBEDDING_THRESHOLD` in "
              "`services/scheduler/policy/intent_shift.py`) is the rounded F1 optimum on the plain-text rows; a "
              "false shift throws away KV the next hop needed, so on the chat rows it errs to precision. The "
              "bigram rows are no better than the 50 % base rate at any threshold: it stays only as the "
              "fallback, where at 0.9 on chat-templated ids it almost never fires (keeps the KV).", ""]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=Path, default=DEFAULT_PAIRS,
                    help="labelled pairs (JSON: {pairs: [{context, turn, shift}]}); default: %(default)s")
    ap.add_argument("--tokenizer", default="smollm2-135m-instruct",
                    help="model whose tokenizer gives the bigram signal its token ids (a name weft.models "
                         "resolves, or a checkpoint directory); default: %(default)s")
    ap.add_argument("--out", type=Path, default=RESULTS / "intent_shift",
                    help="output path without suffix (.md and .json are written); default: %(default)s")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    pairs = json.loads(args.pairs.read_text())["pairs"]
    report = measure(pairs, args.tokenizer)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report, "python -m benchmarks.intent_shift"))
    print(markdown(report, "python -m benchmarks.intent_shift"))


if __name__ == "__main__":
    main()
