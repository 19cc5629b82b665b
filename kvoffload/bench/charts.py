"""PNG charts of ``kvoffload bench`` cells (matplotlib, Agg): GB/s per block size against the
same-run references, and time to first token per prefix length against recompute."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from kvoffload.bench.cells import Cell
from kvoffload.extras import require_extra

THROUGHPUT_TITLES = {
    "cpu": "cpu worker copies",
    "service": "device store/load through the service",
    "disk": "disk tier (DiskStore)",
    "object": "object tier (S3BlockStore)",
    "peer": "kvoffload vs LMCache",
    "gpu": "host <-> GPU copies",
}
TTFT_TITLES = {"ttft": "reference engine", "vllm": "vLLM"}


def _size_label(size: int, unit: str) -> str:
    if unit != "bytes":
        return f"{size // 1024}k" if size >= 1024 and size % 1024 == 0 else str(size)
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def plot_cells(cells: list[Cell], directory: Path) -> list[Path]:
    """One PNG per suite with charted cells; the paths written (MissingExtra without
    matplotlib)."""
    require_extra("bench --plot", "bench")
    import matplotlib

    matplotlib.use("Agg")
    written = []
    for suite, title in {**THROUGHPUT_TITLES, **TTFT_TITLES}.items():
        charted = [c for c in cells if c.suite == suite and c.chart and c.size is not None]
        if not charted:
            continue
        path = directory / f"bench_{suite}.png"
        _plot(charted, title, suite in TTFT_TITLES, path)
        written.append(path)
    return written


def _plot(cells: list[Cell], title: str, ttft: bool, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 5.5), dpi=110)
    sizes = sorted({c.size for c in cells if c.size is not None})
    metrics = list(dict.fromkeys(c.metric for c in cells))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    references: dict[tuple[str, tuple[float | None, ...]], list[str]] = {}
    for index, metric in enumerate(metrics):
        row = {c.size: c for c in cells if c.metric == metric}
        xs = [s for s in sizes if s in row]
        color = colors[index % len(colors)]
        ax.plot(xs, [row[s].value for s in xs], "o-", color=color, label=metric)
        named = [(name, {s: row[s].reference_value for s in xs}) for name in [row[xs[0]].reference]]
        named += [(name, {s: row[s].others.get(name) for s in xs}) for name in row[xs[0]].others]
        for name, values in named:
            if name is None:
                continue
            key = (name, tuple(values.get(s) for s in sizes))
            references.setdefault(key, []).append(metric)
    lines_per_name = Counter(name for name, _ in references)
    for style, ((name, line), users) in zip(
        ["--", ":", "-."] * 8, references.items(), strict=False
    ):
        shared = len(users) > 1 or len(metrics) == 1
        points = [(s, v) for s, v in zip(sizes, line, strict=True) if v is not None]
        color = "black" if shared else colors[metrics.index(users[0]) % len(colors)]
        if shared and lines_per_name[name] == 1:
            label = f"{name} (reference)"
        else:
            label = f"{name} (reference for {'; '.join(users)})"
        ax.plot(*zip(*points, strict=True), style, marker="x", color=color, alpha=0.8, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [_size_label(s, cells[0].size_unit) for s in sizes])
    ax.minorticks_off()
    if ttft:
        ax.set_yscale("log")
        ax.set_xlabel("prefix length (tokens)")
        ax.set_ylabel("time to first token (s, log scale)")
        ax.set_title(f"{title}: time to first token per prefix length (lower is better)")
    else:
        ax.set_xlabel("block size")
        ax.set_ylabel(f"throughput ({cells[0].unit}, 10^9 bytes/s)")
        ax.set_title(f"{title}: {cells[0].unit} per block size (higher is better)")
        ax.set_ylim(bottom=0)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
