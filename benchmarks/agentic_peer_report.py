"""The peer comparison's numbers (pure: no processes, no clocks): one run's summary, median
and range over seeds, per-seed ratios and their geometric mean, issue 17's targets, and
the markdown section ``weft bench agentic --peer llama-server`` writes into
benchmarks/results/agentic.md.

A ratio is always ``other ÷ weft-config`` of a latency, so higher means the Weft
configuration is faster; it is taken within one seed (the same workload, run minutes
apart) and only then averaged across seeds, geometrically.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from benchmarks.report import write_markdown

PEER = "llama-server"
HINTS = "weft"
NO_HINTS = "weft-no-hints"
FCFS = "weft-fcfs"
CONFIGS = (PEER, HINTS, NO_HINTS, FCFS)
# `weft up` settings of each Weft configuration; configurations named weft-no-hints* send no hints
WEFT_SETTINGS = {HINTS: {}, NO_HINTS: {},
                 FCFS: {"policy": "fcfs", "preemption_policy": "fcfs", "demote": "false"},
                 # one-difference ablations of the default (run only when named in --configs)
                 "weft-no-demote": {"demote": "false"},
                 "weft-fcfs-order": {"preemption_policy": "fcfs"},
                 "weft-no-finish-demote": {"demote_on_finish": "never"},
                 "weft-finish-demote-always": {"demote_on_finish_min_held": "0"},  # the unconditional write
                 # a smaller step token budget: a CPU step of 2048 prefill tokens takes ~1-2 s
                 "weft-budget512": {"max_num_batched_tokens": "512"},
                 "weft-no-hints-budget512": {"max_num_batched_tokens": "512"},
                 "weft-fcfs-policy": {"policy": "fcfs"},
                 "weft-no-las": {"priority_weights": "las=0"},
                 # the old 256 MiB pool, where KV across tool pauses is short (hints matter most there)
                 "weft-kv256m": {"kv_cache_memory_bytes": str(256 << 20)},
                 "weft-no-hints-kv256m": {"kv_cache_memory_bytes": str(256 << 20)},
                 # the same room in tokens on any model: 360 blocks of 16 = 5,760 tokens (SmolLM2's 256 MiB)
                 "weft-kv360b": {"num_kv_blocks": "360"},
                 "weft-no-hints-kv360b": {"num_kv_blocks": "360"},
                 # moderate pressure: about the 8 running programs' contexts (~70 blocks each on
                 # average), so paused sessions compete with live hops for room without thrashing
                 "weft-kv480b": {"num_kv_blocks": "480"},
                 "weft-no-hints-kv480b": {"num_kv_blocks": "480"},
                 "weft-kv640b": {"num_kv_blocks": "640"},
                 "weft-no-hints-kv640b": {"num_kv_blocks": "640"},
                 "weft-kv960b": {"num_kv_blocks": "960"},
                 "weft-no-hints-kv960b": {"num_kv_blocks": "960"}}
ABLATIONS = tuple(c for c in WEFT_SETTINGS if c not in CONFIGS)


@dataclass(frozen=True)
class RunSummary:
    """One configuration's run of one seed's workload."""

    config: str
    seed: int
    jct_p50_s: float  # program completion time (first hop sent -> last hop's last token)
    jct_p99_s: float
    ttft_int_p50_ms: float  # interactive requests' time to first token
    ttft_int_p99_ms: float
    ttft_hop_p99_ms: float  # agent hops' time to first token
    num_programs: int
    num_chats: int
    num_errors: int
    wall_s: float
    num_censored: int = 0  # programs / chats cut off by the run's deadline (their times are lower bounds)


@dataclass(frozen=True)
class Ratio:
    """``numerator ÷ denominator`` of one latency, per seed and their geometric mean."""

    numerator: str
    denominator: str
    metric: str  # a RunSummary field
    per_seed: tuple[float, ...]

    @property
    def geomean(self) -> float:
        return geomean(self.per_seed)


@dataclass(frozen=True)
class Target:
    text: str
    ratio: Ratio
    at_least: float
    every_seed: bool = False  # "never below": the worst seed must meet it, not the mean

    @property
    def value(self) -> float:
        return min(self.ratio.per_seed) if self.every_seed else self.ratio.geomean

    @property
    def met(self) -> bool:
        return self.value >= self.at_least


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (p99 of 24 programs is the slowest one); nan when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def geomean(values) -> float:
    values = [v for v in values if v > 0 and v == v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def summarize(config: str, seed: int, jct_s: list[float], ttft_int_s: list[float], ttft_hop_s: list[float],
              num_errors: int, wall_s: float, num_censored: int = 0) -> RunSummary:
    return RunSummary(config, seed, pct(jct_s, 50), pct(jct_s, 99), pct(ttft_int_s, 50) * 1000,
                      pct(ttft_int_s, 99) * 1000, pct(ttft_hop_s, 99) * 1000, len(jct_s), len(ttft_int_s),
                      num_errors, wall_s, num_censored)


def ratio(runs: list[RunSummary], numerator: str, denominator: str, metric: str) -> Ratio:
    """Per seed (in seed order), ``numerator``'s metric over ``denominator``'s; seeds that
    lack either configuration are skipped."""
    by = {(r.config, r.seed): getattr(r, metric) for r in runs}
    seeds = sorted({r.seed for r in runs})
    return Ratio(numerator, denominator, metric, tuple(
        by[numerator, s] / by[denominator, s] for s in seeds if (numerator, s) in by and (denominator, s) in by))


def targets(runs: list[RunSummary]) -> list[Target]:
    """Issue 17's targets on one model's runs."""
    out = [Target("Weft with hints vs llama-server, program completion p99", ratio(runs, PEER, HINTS, "jct_p99_s"),
                  1.5),
           Target("Weft with hints vs llama-server, interactive TTFT p99", ratio(runs, PEER, HINTS, "ttft_int_p99_ms"),
                  2.0),
           Target("Weft with hints vs without, program completion p99", ratio(runs, NO_HINTS, HINTS, "jct_p99_s"),
                  1.2)]
    for metric, what in (("jct_p99_s", "program completion p99"), ("ttft_int_p99_ms", "interactive TTFT p99")):
        out.append(Target(f"Weft without hints vs llama-server, {what} (worst seed)",
                          ratio(runs, PEER, NO_HINTS, metric), 1.0, every_seed=True))
    return out


def median_range(values: list[float], fmt: str) -> str:
    """``median [min–max]``."""
    values = [v for v in values if v == v]
    if not values:
        return "-"
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}–{max(values):{fmt}}]"


FIGURES = (("jct_p50_s", "program p50 s", ".1f"), ("jct_p99_s", "program p99 s", ".1f"),
           ("ttft_int_p50_ms", "interactive TTFT p50 ms", ".0f"), ("ttft_int_p99_ms", "interactive TTFT p99 ms", ".0f"),
           ("ttft_hop_p99_ms", "hop TTFT p99 ms", ".0f"))


def model_section(model: str, runs: list[RunSummary], chart_files: list[str]) -> list[str]:
    configs = [c for c in CONFIGS if any(r.config == c for r in runs)]
    configs += [c for c in dict.fromkeys(r.config for r in runs) if c not in CONFIGS]  # ablations, as run
    rows = [[c] + [median_range([getattr(r, f) for r in runs if r.config == c], fmt) for f, _, fmt in FIGURES]
            + [str(sum(r.num_errors for r in runs if r.config == c)),
               str(sum(r.num_censored for r in runs if r.config == c))] for c in configs]
    out = [f"### {model}", "", "Median [range] over seeds:", "",
           write_markdown(["config"] + [h for _, h, _ in FIGURES] + ["errors", "cut off by the deadline"], rows), "",
           "A run is cut off at its deadline: unfinished programs and chats count with their time so far "
           "(lower bounds), so a cut-off engine's ratios understate how much slower it was.", ""]
    rows = []
    extra = tuple(pair for c in configs if c not in CONFIGS for pair in ((PEER, c), (c, HINTS)))  # ablations
    for num, den in ((PEER, HINTS), (PEER, NO_HINTS), (PEER, FCFS), (NO_HINTS, HINTS), (FCFS, HINTS)) + extra:
        for metric, what in (("jct_p99_s", "program p99"), ("ttft_int_p99_ms", "interactive TTFT p99")):
            r = ratio(runs, num, den, metric)
            if r.per_seed:
                rows.append([f"{num} ÷ {den}", what, ", ".join(f"{v:.2f}" for v in r.per_seed), f"{r.geomean:.2f}x"])
    out += ["Ratios of latencies (higher: the configuration after ÷ is faster), per seed and geometric mean:", "",
            write_markdown(["ratio", "figure", "per seed", "geomean"], rows), ""]
    out += ["Targets (issue 17):", ""]
    for t in targets(runs):
        if t.ratio.per_seed:
            what = "worst seed" if t.every_seed else "geomean"
            out.append(f"- {t.text}: {what} {t.value:.2f}x (target >= {t.at_least}x): "
                       f"**{'met' if t.met else 'missed'}**")
    rows = [[r.config, str(r.seed), f"{r.jct_p99_s:.1f}", f"{r.ttft_int_p99_ms:.0f}", str(r.num_chats),
             str(r.num_errors), str(r.num_censored), f"{r.wall_s:.0f}"] for r in runs]
    out += ["", "<details><summary>Every run, in the order run</summary>", "",
            write_markdown(["config", "seed", "program p99 s", "interactive TTFT p99 ms", "interactive requests",
                            "errors", "cut off", "wall s"], rows), "", "</details>", ""]
    out += [f"![{f}]({f})" for f in chart_files] + [""]
    return out


def charts(out_dir, config_order: list[str], model_name: str, runs: list[RunSummary]) -> list[str]:
    """One bar chart of the medians over seeds per configuration; returns its file name."""
    from benchmarks.report import write_bar_chart

    med = lambda c, f: statistics.median([getattr(r, f) for r in runs if r.config == c])  # noqa: E731
    configs = [c for c in config_order if any(r.config == c for r in runs)]
    path = out_dir / f"agentic_peer_{model_name}.png"
    write_bar_chart(path, f"{model_name}: median over seeds (program s x1000 / TTFT ms)",
                    ["program p50 (ms)", "program p99 (ms)", "interactive TTFT p50", "interactive TTFT p99"],
                    {c: [med(c, "jct_p50_s") * 1000, med(c, "jct_p99_s") * 1000, med(c, "ttft_int_p50_ms"),
                         med(c, "ttft_int_p99_ms")] for c in configs}, ylabel="ms")
    return [path.name]


def markers(key: str) -> tuple[str, str]:
    return f"<!-- {key}:begin -->", f"<!-- {key}:end -->"


def section_text(document: str, key: str = "peer") -> str | None:
    """The text between ``key``'s markers, None when they are absent."""
    begin, end = markers(key)
    if begin not in document or end not in document:
        return None
    return document.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def splice_section(document: str, section: str, key: str = "peer", at_end: bool = False) -> str:
    """``document`` with the text between ``key``'s markers replaced by ``section``; when the
    markers are absent the block goes after the first line (the title), or at the end with
    ``at_end``. Everything else is kept."""
    begin, end = markers(key)
    block = f"{begin}\n{section.strip()}\n{end}"
    if section_text(document, key) is not None:
        head, rest = document.split(begin, 1)
        return head + block + rest.split(end, 1)[1]
    if at_end:
        return f"{document.rstrip()}\n\n{block}\n"
    first, _, rest = document.partition("\n")
    return f"{first}\n\n{block}\n{rest}" if document else block + "\n"


HEADER = """## Against llama-server (issue 17's agent workload)

`weft bench agentic --peer llama-server` (benchmarks/agentic_peer.py): agent programs of 3–16
hops (Pareto-tailed), a closed loop of 8 at once, the whole context sent as token ids every hop,
log-normal tool pauses, and interactive requests arriving at ~1/s while the programs run;
against `llama-server -np 6` on the same f32 weights (GGUF from benchmarks/peers), a default
`weft up` mesh with the agent hints (`weft`), the same without any (`weft-no-hints`), and the
FCFS ablation with hints (`weft-fcfs`). Each engine is started once and warmed up; each seed's
workload then runs once per engine, engines rotated per seed. Ratios are taken per seed and
averaged geometrically. One subsection per model, each from its own command."""
