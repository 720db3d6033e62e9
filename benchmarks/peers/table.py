"""The peer report's arithmetic: per-round rates into one table per model, ratios over the
rounds' own ratios, and issue 16's targets marked met / not met. Pure: no engine, no files
(plot() writes the PNG it is given).

Rates are keyed ``(engine, workload, phase)``: workload "batch-1" or "concurrent", phase
"total" (output tokens over prefill + decode) or "decode" (the decode steps only); each
value is a list with one rate per round, in round order, so the i-th rates of two engines
were measured seconds apart and their ratio is that round's ratio.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

ENGINES = ("weft", "llama.cpp", "transformers")
WORKLOADS = ("batch-1", "concurrent")
PHASES = ("total", "decode")
Rates = dict[tuple[str, str, str], list[float]]


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    """"median (min–max)"; an em dash when nothing was measured."""
    if not values:
        return "—"
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def round_ratios(a: list[float], b: list[float]) -> list[float]:
    """Each round's a / b; rounds missing on either side are dropped."""
    return [x / y for x, y in zip(a, b)]


@dataclass(frozen=True)
class Target:
    """"weft's <workload> <phase> rate is at least <at_least> × <versus>" on some models.
    ``versus`` is an engine, or "bandwidth" (bytes read per decoded token × rate over the
    measured DRAM read bandwidth)."""

    models: tuple[str, ...]
    workload: str
    phase: str
    versus: str
    at_least: float

    def describe(self, num_prompts: int) -> str:
        what = "batch-1" if self.workload == "batch-1" else f"{num_prompts}-concurrent"
        what += " decode" if self.phase == "decode" else " (prefill + decode)"
        if self.versus == "bandwidth":
            return f"weft {what} bytes/s ≥ {self.at_least:.0%} of measured DRAM bandwidth"
        return f"weft {what} ≥ {self.at_least:g}× {self.versus}"


# Issue 16's CPU targets. Batch-1 targets are judged on decode-only rates (what they name);
# "16-concurrent stays ≥ 1.5×" on the issue's own figure, the whole 128-in / 64-out workload.
TARGETS = (
    Target(("smollm2", "bench"), "batch-1", "decode", "llama.cpp", 1.0),
    Target(("smollm2",), "batch-1", "decode", "transformers", 2.0),
    Target(("smollm2", "bench"), "concurrent", "total", "llama.cpp", 1.5),
    Target(("bench",), "batch-1", "decode", "bandwidth", 0.60),
)


def bandwidth_fractions(rates: list[float], bytes_per_token: float, bandwidths: list[float]) -> list[float]:
    """Each round's rate (tokens/s) × bytes per token as a fraction of that round's DRAM read
    bandwidth (bytes/s)."""
    return [r * bytes_per_token / b for r, b in zip(rates, bandwidths)]


def judge(target: Target, rates: Rates, fractions: list[float]) -> tuple[list[float], bool | None]:
    """(the per-round figures the target is about, met?) — met when their median reaches
    ``at_least``; None when there is nothing to judge (an engine was skipped)."""
    ours = rates.get(("weft", target.workload, target.phase), [])
    if target.versus == "bandwidth":
        values = fractions
    else:
        values = round_ratios(ours, rates.get((target.versus, target.workload, target.phase), []))
    if not values:
        return values, None
    return values, statistics.median(values) >= target.at_least


def row_label(workload: str, phase: str, num_prompts: int, input_len: int, output_len: int) -> str:
    shape = f"{input_len} in / {output_len} out"
    who = "batch-1" if workload == "batch-1" else f"{num_prompts} concurrent"
    return f"{who}, {'decode only' if phase == 'decode' else f'prefill + decode ({shape})'}"


def model_table(rates: Rates, *, num_prompts: int, input_len: int, output_len: int) -> tuple[list[str], list[list[str]]]:
    """(headers, rows) of one model: a row per workload × phase, tok/s of each engine and
    weft's ratio to each peer."""
    headers = ["workload", "weft tok/s", "llama.cpp tok/s", "weft / llama.cpp", "transformers tok/s",
               "weft / transformers"]
    rows = []
    for workload in WORKLOADS:
        for phase in PHASES:
            get = {e: rates.get((e, workload, phase), []) for e in ENGINES}
            rows.append([row_label(workload, phase, num_prompts, input_len, output_len),
                         spread(get["weft"]), spread(get["llama.cpp"]),
                         spread(round_ratios(get["weft"], get["llama.cpp"]), "{:.2f}×"),
                         spread(get["transformers"]),
                         spread(round_ratios(get["weft"], get["transformers"]), "{:.2f}×")])
    return headers, rows


def target_rows(model: str, rates: Rates, fractions: list[float], num_prompts: int) -> list[list[str]]:
    """[target, measured median (range), met / not met / not measured] for ``model``'s targets."""
    out = []
    for t in TARGETS:
        if model not in t.models:
            continue
        values, met = judge(t, rates, fractions)
        fmt = "{:.0%}" if t.versus == "bandwidth" else "{:.2f}×"
        verdict = "not measured" if met is None else ("**met**" if met else "**not met**")
        out.append([t.describe(num_prompts), spread(values, fmt), verdict])
    return out


def plot(path: Path, per_model: dict[str, Rates], num_prompts: int) -> None:
    """One panel per model: bars per engine over the four workload × phase rows (medians)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(w, p) for w in WORKLOADS for p in PHASES]
    labels = [("batch-1" if w == "batch-1" else f"{num_prompts} conc.")
              + ("\ndecode only" if p == "decode" else "\nprefill + decode") for w, p in groups]
    fig, axes = plt.subplots(1, len(per_model), figsize=(6.5 * len(per_model), 4.5), squeeze=False)
    width = 0.8 / len(ENGINES)
    for ax, (model, rates) in zip(axes[0], per_model.items()):
        for i, engine in enumerate(ENGINES):
            values = [statistics.median(rates[(engine, w, p)]) if rates.get((engine, w, p)) else float("nan")
                      for w, p in groups]
            bars = ax.bar([g + i * width for g in range(len(groups))], values, width, label=engine)
            ax.bar_label(bars, labels=["" if v != v else f"{v:.0f}" for v in values], fontsize=8)
        ax.set_xticks([g + width for g in range(len(groups))], labels)
        ax.set_title(f"{model}: output tokens/s, median of rounds")
        ax.set_ylabel("tokens/s (higher is better)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
