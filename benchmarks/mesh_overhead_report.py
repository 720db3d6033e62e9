"""The mesh-overhead benchmark's samples and report (``benchmarks/mesh_overhead.py`` runs
the paths): per-path TTFT / ITL samples, the table with each path's p50 / p99 and its
difference from the in-process engine, the per-hop breakdown, the split of the added TTFT
into the transport floor and Weft's own work, and the plot."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.report import write_markdown

PATHS = ("in-process", "executor gRPC", "scheduler gRPC", "mesh gRPC", "mesh HTTP")
FLOOR = "gRPC floor"


@dataclass
class Timings:
    """Per-path samples in seconds."""

    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    def add(self, start: float, arrivals: list[tuple[float, int]]) -> None:
        """``arrivals``: (time, number of tokens) of every chunk that carried tokens."""
        self.ttft.append(arrivals[0][0] - start)
        prev = arrivals[0][0]
        for t, n in arrivals[1:]:
            self.itl.extend([(t - prev) / n] * n)
            prev = t


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


# results[round][prompt tokens][path]
Results = list[dict[int, dict[str, Timings]]]


def p50(results: Results, n: int, name: str, metric: str, minus: str | None = None) -> list[float]:
    """One p50 (ms) per round of ``metric`` on path ``name``, less path ``minus``'s p50 when given."""
    out = []
    for rnd in results:
        value = percentile(getattr(rnd[n][name], metric), 50)
        if minus is not None:
            value -= percentile(getattr(rnd[n][minus], metric), 50)
        out.append(value * 1000)
    return out


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def cell(values: list[float], signed: bool = False) -> str:
    """Median of the rounds with their range: ``3.10 (2.90–3.40)``; one round: the value."""
    f = "{:+.2f}" if signed else "{:.2f}"
    if len(values) == 1:
        return f.format(values[0])
    return f"{f.format(median(values))} ({f.format(min(values))}–{f.format(max(values))})"


def pooled_p99(results: Results, n: int, name: str, metric: str) -> str:
    return f"{percentile([v for rnd in results for v in getattr(rnd[n][name], metric)], 99) * 1000:.2f}"


def report(args, model_dir: Path, results: Results) -> str:
    headers = ["prompt tokens", "path", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
               "+TTFT p50 ms vs in-process", "+ITL p50 ms vs in-process"]
    rows = []
    first = results[0]
    for n, paths in first.items():
        for name in paths:
            base = name in ("in-process", FLOOR)  # the floor runs no engine: its TTFT is all added time
            rows.append([n, name, cell(p50(results, n, name, "ttft")), pooled_p99(results, n, name, "ttft"),
                         cell(p50(results, n, name, "itl")), pooled_p99(results, n, name, "itl"),
                         "—" if base else cell(p50(results, n, name, "ttft", "in-process"), signed=True),
                         "—" if base else cell(p50(results, n, name, "itl", "in-process"), signed=True)])
    table = write_markdown(headers, rows)
    if all(name in paths for name in PATHS for paths in first.values()):
        table += "\n\n### Where the mesh's time goes (p50 differences, ms)\n\n" + breakdown(results)
    if all(FLOOR in paths for paths in first.values()):
        table += "\n\n### Against the transport floor (p50 TTFT, ms)\n\n" + against_floor(results)
    return table


def against_floor(results: Results) -> str:
    """What the mesh adds to TTFT, split into the floor (three empty gRPC hops: the gRPC
    floor path's own TTFT) and the rest, Weft's own work (medians of the rounds' values)."""
    headers = ["prompt tokens", "path", "added TTFT", "floor: 3 empty hops", "Weft's own work (added − floor)"]
    rows = []
    for n in results[0]:
        floor = p50(results, n, FLOOR, "ttft")
        for name in ("mesh gRPC", "mesh HTTP"):
            if name not in results[0][n]:
                continue
            added = p50(results, n, name, "ttft", "in-process")
            own = [a - f for a, f in zip(added, floor)]
            rows.append([n, name, cell(added, signed=True), cell(floor), cell(own, signed=True)])
    return write_markdown(headers, rows)


def breakdown(results: Results) -> str:
    """Per-hop share of the mesh's p50 TTFT / ITL: each path minus the one inside it
    (median of the rounds' differences)."""
    hops = [("executor gRPC hop (vs in-process AsyncEngine)", "executor gRPC", "in-process"),
            ("scheduler hop (placement + relay)", "scheduler gRPC", "executor gRPC"),
            ("router hop, gRPC API (auth, validation, detokenize, relay)", "mesh gRPC", "scheduler gRPC"),
            ("HTTP/SSE instead of gRPC at the router", "mesh HTTP", "mesh gRPC")]
    headers = ["hop"] + [f"{n} tok: TTFT / ITL" for n in results[0]]
    rows = []
    for label, outer, inner in hops:
        cells = [f"{median(p50(results, n, outer, 'ttft', inner)):+.2f} / "
                 f"{median(p50(results, n, outer, 'itl', inner)):+.2f}" for n in results[0]]
        rows.append([label, *cells])
    return write_markdown(headers, rows)


def plot(path: Path, results: Results) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    lens = list(results[0])
    names = list(results[0][lens[0]])
    width = 0.8 / len(names)
    for ax, metric, title in ((axes[0], "ttft", "TTFT p50 (ms)"), (axes[1], "itl", "inter-token latency p50 (ms)")):
        for i, name in enumerate(names):
            values = [median(p50(results, n, name, metric)) for n in lens]
            bars = ax.bar([g + i * width for g in range(len(lens))], values, width, label=name)
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
        ax.set_xticks([g + width * (len(names) - 1) / 2 for g in range(len(lens))], [f"{n} prompt tokens" for n in lens])
        ax.set_title(title + (f", median of {len(results)} rounds" if len(results) > 1 else ""))
        ax.margins(y=0.3)  # headroom for the legend
        ax.legend(fontsize=7, ncol=3, loc="upper left")
    fig.suptitle("Weft mesh overhead vs in-process engine (batch 1, loopback)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
