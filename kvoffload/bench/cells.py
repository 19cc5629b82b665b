"""One comparable figure per suite, operation and size, read from a suite's JSON output.

A ``Cell`` holds a measured value, the reference measured in the same run (memcpy, dd, bare
ZeroMQ, plain obstore, recompute, LMCache) and ``ratio_to_reference``: how many times the
reference's performance it reaches (> 1: faster than the reference), whatever the unit. Where
the suite measured the machine's own limit for the same work (``kvoffload.bench.limits``), the
cell also holds ``limit`` (what it is), ``limit_value`` and ``ratio_to_limit``: the share of
the limit's performance it reaches (at most about 1). Cells of several rounds of one suite are
merged into their medians; a recorded baseline is matched by ``Cell.key``.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Iterable
from typing import Any, Literal

SizeUnit = Literal["bytes", "tokens", "keys"]


@dataclasses.dataclass
class Cell:
    """One figure of a suite; ``size`` in ``size_unit`` (block bytes, prefix tokens, keys)."""

    suite: str
    metric: str
    size: int | None
    size_unit: SizeUnit
    value: float
    unit: str
    higher_is_better: bool = True
    reference: str | None = None
    reference_value: float | None = None
    others: dict[str, float] = dataclasses.field(default_factory=dict)
    chart: bool = False
    ratio_to_reference: float | None = None
    limit: str | None = None
    limit_value: float | None = None
    ratio_to_limit: float | None = None
    baseline_value: float | None = None
    vs_baseline: float | None = None
    vs_baseline_normalized: float | None = None

    def __post_init__(self) -> None:
        if self.ratio_to_reference is None and self.reference_value:
            self.ratio_to_reference = self.performance_ratio(self.value, self.reference_value)
        if self.ratio_to_limit is None and self.limit_value:
            self.ratio_to_limit = self.performance_ratio(self.value, self.limit_value)

    @property
    def key(self) -> tuple[str, str, int | None]:
        return (self.suite, self.metric, self.size)

    def performance_ratio(self, value: float, other: float) -> float | None:
        """How many times ``other``'s performance ``value`` reaches (> 1: better)."""
        if not value or not other:
            return None
        return value / other if self.higher_is_better else other / value

    def compare(self, baseline: Cell) -> None:
        """Fill the comparison with the same cell of a recorded baseline (> 1: better now)."""
        self.baseline_value = baseline.value
        self.vs_baseline = self.performance_ratio(self.value, baseline.value)
        if self.ratio_to_reference and baseline.ratio_to_reference:
            self.vs_baseline_normalized = self.ratio_to_reference / baseline.ratio_to_reference

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Cell:
        return cls(**data)


def merge_rounds(rounds: list[list[Cell]]) -> list[Cell]:
    """Per cell key, the median value and reference value over the rounds that measured it."""
    groups: dict[tuple[str, str, int | None], list[Cell]] = {}
    for cells in rounds:
        for cell in cells:
            groups.setdefault(cell.key, []).append(cell)
    merged = []
    for group in groups.values():
        first = group[0]
        references = [c.reference_value for c in group if c.reference_value is not None]
        ratios = [c.ratio_to_reference for c in group if c.ratio_to_reference is not None]
        limits = [c.limit_value for c in group if c.limit_value is not None]
        of_limit = [c.ratio_to_limit for c in group if c.ratio_to_limit is not None]
        others = {
            name: statistics.median(c.others[name] for c in group if name in c.others)
            for name in first.others
        }
        merged.append(
            dataclasses.replace(
                first,
                value=statistics.median(c.value for c in group),
                reference_value=statistics.median(references) if references else None,
                others=others,
                ratio_to_reference=statistics.median(ratios) if ratios else None,
                limit_value=statistics.median(limits) if limits else None,
                ratio_to_limit=statistics.median(of_limit) if of_limit else None,
            )
        )
    return merged


def size_label(cell: Cell) -> str:
    if cell.size is None:
        return "-"
    if cell.size_unit != "bytes":
        return f"{cell.size} {cell.size_unit}"
    return f"{cell.size >> 20} MiB" if cell.size >= 1 << 20 else f"{cell.size >> 10} KiB"


def ratio_text(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


def ratio_table(cells: list[Cell]) -> list[str]:
    """A Markdown table of the cells' ratios, one row per operation and one column per size:
    the ratio to the reference, then (where measured) the ratio to the machine's limit."""
    by_size = {c.size: size_label(c) for c in sorted(cells, key=lambda c: c.size or 0)}
    table = {(c.metric, c.size): c for c in cells}
    references = list(dict.fromkeys(c.reference for c in cells if c.reference))
    reference = references[0] if len(references) == 1 else "each row's reference"
    if not references:
        reference = "the reference"

    def entry(cell: Cell | None) -> str:
        if cell is None:
            return "-"
        text = ratio_text(cell.ratio_to_reference)
        return text if cell.ratio_to_limit is None else f"{text} ({cell.ratio_to_limit:.2f})"

    lines = [
        f"performance / {reference} in the same run (in brackets: / the machine's limit):",
        f"| op | {' | '.join(by_size.values())} |",
        f"|---|{'---|' * len(by_size)}",
    ]
    for metric in dict.fromkeys(c.metric for c in cells):
        row = " | ".join(entry(table.get((metric, size))) for size in by_size)
        lines.append(f"| {metric} | {row} |")
    return lines


def _median(summary: Any) -> float:
    """A suite figure that is either a number or a {min, median, max} summary."""
    return float(summary["median"] if isinstance(summary, dict) else summary)


def tiering_cells(outputs: dict[str, Any]) -> list[Cell]:
    data = outputs["tiering"]
    floor = data["floor_dict_membership_keys_per_s"]
    keys = data["prefix_keys"]
    fresh = data["fresh_keys_decoded_per_call"]
    cell = dict(suite="tiering", size=keys, size_unit="keys", unit="keys/s")
    return [
        Cell(
            metric="all-HIT lookup",
            value=data["all_hit_lookup_keys_per_s"],
            reference="dict membership",
            reference_value=floor,
            **cell,
        ),
        Cell(
            metric="lookup of keys decoded per call",
            value=fresh["lookup_keys_per_s"],
            reference="decode + dict membership",
            reference_value=fresh["floor_keys_per_s"],
            **cell,
        ),
        Cell(
            metric="first lookup, half in a secondary tier",
            value=data["half_in_secondary"]["first_lookup_keys_per_s"],
            **cell,
        ),
        Cell(
            metric="store bookkeeping",
            value=data["store"]["keys_per_s"],
            **{**cell, "size": data["store"]["batch"]},
        ),
    ]


def cpu_cells(outputs: dict[str, Any]) -> list[Cell]:
    cells = []
    data = outputs["cpu_worker"]
    for result in data["results"]:
        memcpy = _median(result["memcpy_1thread_gbps"])
        for name, summary in result.items():
            if not (name.startswith("device_") and name.endswith("_gbps")):
                continue
            metric = name.removesuffix("_gbps")
            cells.append(
                Cell(
                    suite="cpu",
                    metric=metric,
                    size=result["block_bytes"],
                    size_unit="bytes",
                    value=_median(summary),
                    unit="GB/s",
                    reference="memcpy 1 thread",
                    reference_value=memcpy,
                    chart=metric.endswith(("_process", "_1thread")),
                )
            )
    return cells


def service_cells(outputs: dict[str, Any]) -> list[Cell]:
    data = outputs["service"]
    cells = []
    for name, entry in data.get("control_plane", {}).items():
        keys = int(name.split("_")[0])
        cells.append(
            Cell(
                suite="service",
                metric="lookup round trip p50",
                size=keys,
                size_unit="keys",
                value=entry["manager"]["p50_us"],
                unit="us",
                higher_is_better=False,
                reference="bare ZeroMQ round trip",
                reference_value=entry["bare_zmq_same_frame"]["p50_us"],
                others={"tiering library in-process": entry["library_in_process"]["p50_us"]},
            )
        )
    for section, tiers in (("latency", "with the disk tier"), ("latency_host_only", "pool only")):
        cells += one_block_cells(data.get(section), tiers)
    for block, entry in data.get("data_plane", {}).items():
        for op in ("store", "load"):
            cells.append(
                Cell(
                    suite="service",
                    metric=f"device {op} through the service",
                    size=int(block),
                    size_unit="bytes",
                    value=entry[f"{op}_gb_s"],
                    unit="GB/s",
                    reference="memcpy",
                    reference_value=entry["memcpy_gb_s"],
                    chart=True,
                )
            )
    return cells


def one_block_cells(latency: dict[str, Any] | None, tiers: str) -> list[Cell]:
    """One-block engine-side store and load against two interleaved bare ZeroMQ round trips
    plus one block copy (their budget), and the cold one-block load from disk when measured."""
    if not latency:
        return []
    rtt = latency["bare_zmq_rtt_interleaved"]["p50_us"]
    budget = 2 * rtt + latency["copy"]["p50_us"]
    cells = [
        Cell(
            suite="service",
            metric=f"one-block engine-side {op} p50, {tiers}",
            size=latency["block_bytes"],
            size_unit="bytes",
            value=latency[f"engine_{op}"]["p50_us"],
            unit="us",
            higher_is_better=False,
            reference="two bare ZeroMQ round trips + one block copy",
            reference_value=budget,
            others={"awaited completion": latency[f"engine_{op}_awaited"]["p50_us"]},
        )
        for op in ("store", "load")
    ]
    if "cold_1_held" in latency:
        cells.append(
            Cell(
                suite="service",
                metric="cold one-block disk load p50, held lookup",
                size=latency["block_bytes"],
                size_unit="bytes",
                value=latency["cold_1_held"]["p50_us"],
                unit="us",
                higher_is_better=False,
                others={"polled lookups": latency["cold_1_polled"]["p50_us"]},
            )
        )
    return cells


def disk_cells(outputs: dict[str, Any]) -> list[Cell]:
    data = outputs["disk"]
    runs = [data["baseline"][when] for when in ("before", "after") if when in data["baseline"]]
    dd_write = statistics.median(r["dd_direct_write_gbps"] for r in runs)
    dd_read = statistics.median(r["dd_direct_read_gbps"] for r in runs)
    most_threads = max(c["threads"] for c in data["cells"]) if data["cells"] else 0
    cells = []
    for entry in data["cells"]:
        for name, figure in entry.items():
            if not name.endswith("_gbps"):
                continue
            op = name.removesuffix("_gbps")
            is_store = op.startswith("store")
            cells.append(
                Cell(
                    suite="disk",
                    metric=f"{op} {entry['mode']} {entry['threads']}t",
                    size=entry["block_kib"] << 10,
                    size_unit="bytes",
                    value=figure,
                    unit="GB/s",
                    reference="dd direct write" if is_store else "dd direct read",
                    reference_value=dd_write if is_store else dd_read,
                    chart=entry["threads"] == most_threads
                    and entry["mode"] == "direct"
                    and op in ("store", "load_cold"),
                )
            )
    worker_ops = (
        ("disk worker cascade jobs", "store", "dd_write"),
        ("disk worker cascade jobs, evicting", "store_evicting", "dd_write"),
        ("disk worker promotion jobs, cold", "load_cold", "dd_read"),
    )
    for entry in data.get("worker", []):
        median = entry["median"]
        for metric, op, dd in worker_ops:
            if f"{op}_gbps" not in median:
                continue
            ratio = median.get(f"{op.removesuffix('_cold')}_ratio")
            cells.append(
                Cell(
                    suite="disk",
                    metric=metric,
                    size=entry["block_kib"] << 10,
                    size_unit="bytes",
                    value=median[f"{op}_gbps"],
                    unit="GB/s",
                    reference=f"dd direct {'write' if dd == 'dd_write' else 'read'}, same block size",
                    reference_value=median[f"{dd}_gbps"],
                    ratio_to_reference=ratio,
                    chart=op != "store_evicting",
                )
            )
    startup = outputs.get("disk_startup")
    if startup:
        cells.append(
            Cell(
                suite="disk",
                metric="restart scan",
                size=startup["block_bytes"],
                size_unit="bytes",
                value=startup["scan_blocks_per_s"],
                unit="blocks/s",
            )
        )
    return cells


def object_cells(outputs: dict[str, Any]) -> list[Cell]:
    data = outputs["object"]
    sizes = {"256KiB": 256 << 10, "1MiB": 1 << 20, "4MiB": 4 << 20}
    table = {(c["client"], c["block"], c["threads"]): c for c in data["cells"]}
    # Median of the per-round ratios, where the suite interleaved its clients in rounds.
    per_round = {
        (r["block"], r["threads"]): r
        for r in data.get("ratios", [])
        if r["client"] == "s3blockstore" and r["reference"] == "obstore"
    }
    cells = []
    for (client, block, threads), entry in table.items():
        if client != "s3blockstore":
            continue
        obstore = table.get(("obstore", block, threads))
        boto3 = table.get(("boto3", block, threads))
        ratios = per_round.get((block, threads))
        for op in ("put", "get"):
            cells.append(
                Cell(
                    suite="object",
                    metric=f"{op.upper()} {threads}t",
                    size=sizes[block],
                    size_unit="bytes",
                    value=entry[f"{op}_mb_s"] / 1e3,
                    unit="GB/s",
                    reference="plain obstore" if obstore else None,
                    reference_value=obstore[f"{op}_mb_s"] / 1e3 if obstore else None,
                    others={"plain boto3": boto3[f"{op}_mb_s"] / 1e3} if boto3 else {},
                    chart=True,
                    ratio_to_reference=ratios[op] if ratios else None,
                )
            )
    return cells


def _ttft_cells(
    suite: str, results: Iterable[dict[str, Any]], series: dict[str, str]
) -> list[Cell]:
    cells = []
    for result in results:
        for metric, field in series.items():
            if result.get(field) is None:
                continue
            cells.append(
                Cell(
                    suite=suite,
                    metric=metric,
                    size=result["prefix_tokens"],
                    size_unit="tokens",
                    value=result[field],
                    unit="s",
                    higher_is_better=False,
                    reference="recompute",
                    reference_value=result["recompute_ttft_s"],
                    chart=True,
                )
            )
    return cells


def ttft_cells(outputs: dict[str, Any]) -> list[Cell]:
    series = {"miss (cold cache)": "miss_ttft_s", "host pool": "pool_ttft_s", "disk": "disk_ttft_s"}
    return _ttft_cells("ttft", outputs["ttft"]["results"], series)


def vllm_cells(outputs: dict[str, Any]) -> list[Cell]:
    series = {
        "vLLM resident prefix cache": "resident_ttft_s",
        "kvoffload host pool": "kvoffload_pool_ttft_s",
        "kvoffload disk": "kvoffload_disk_ttft_s",
    }
    return _ttft_cells("vllm", outputs["vllm"]["results"], series)


def gpu_cells(outputs: dict[str, Any]) -> list[Cell]:
    """GB/s of each kvoffload copy path against the pinned torch copy of the same bytes."""
    cells = []
    for row in outputs["gpu"]["results"]:
        ref = row["torch"]
        for path in ("vllm_worker", "cpu_worker"):
            if path not in row:
                continue
            for direction, name in (("h2d", "load"), ("d2h", "store")):
                cells.append(
                    Cell(
                        suite="gpu",
                        metric=f"{path}_{name}",
                        size=row["block_bytes"],
                        size_unit="bytes",
                        value=row[path][f"{direction}_gbps"],
                        unit="GB/s",
                        reference=f"torch pinned copy {direction}",
                        reference_value=ref[f"{direction}_gbps"],
                        chart=True,
                    )
                )
    return cells


def peer_cells(outputs: dict[str, Any]) -> list[Cell]:
    """The peer suite writes its cells itself (kvoffload measured against LMCache)."""
    return [Cell.from_json(c) for c in outputs["peer"]["cells"]]


def peer_tier_cells(outputs: dict[str, Any]) -> list[Cell]:
    """The peer-tier suite writes its cells itself."""
    return [Cell.from_json(c) for c in outputs["peer_tier"]["cells"]]


EXTRACTORS: dict[str, Callable[[dict[str, Any]], list[Cell]]] = {
    "tiering": tiering_cells,
    "cpu": cpu_cells,
    "service": service_cells,
    "disk": disk_cells,
    "object": object_cells,
    "ttft": ttft_cells,
    "vllm": vllm_cells,
    "peer": peer_cells,
    "peer-tier": peer_tier_cells,
    "gpu": gpu_cells,
}
