"""Markdown tables and PNG charts for benchmark results."""
from __future__ import annotations

from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo ("?" where there is none), for a result's header."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")


def write_markdown(headers: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def write_bar_chart(path: Path, title: str, groups: list[str], series: dict[str, list[float]], ylabel: str = "tokens/s") -> None:
    """Grouped bar chart: one group per workload, one bar per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + i * width for g in range(len(groups))]
        bars = ax.bar(xs, values, width, label=name)
        # a value not measured (NaN) gets neither a bar nor a label
        ax.bar_label(bars, labels=["" if v != v else f"{v:.0f}" for v in values], fontsize=8)
    ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))], groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
