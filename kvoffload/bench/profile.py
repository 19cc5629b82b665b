"""Where the time of one data-path operation goes, process by process.

Runs the kvoffload side of one ``bench peer`` operation (``OPS``) over and over in one service
for ``--seconds``, fresh keys each time, and reports per operation:

- its wall time and GB/s;
- per process of the run (this client, the manager, each worker): CPU milliseconds (user and
  system) and voluntary / involuntary context switches, from psutil;
- with ``--perf`` (Linux perf on PATH; the least intrusive): where each process's CPU time
  went, by the symbol on CPU (the kernel's included), sorted into ``PERF_ACTIVITIES``: block
  copies (memcpy, the kernel's copies to and from files), checksums (xxh3), the interpreter,
  ZeroMQ, scheduling and wake-ups (futex, context switches, a GIL hand-off among them), page
  faults, file systems and block I/O, the rest of the kernel; plus its busiest symbols;
- with ``--py-spy`` (py-spy on PATH or in this virtualenv): the share of each process's
  samples per activity (``ACTIVITIES``) and its busiest Python functions, sampled without
  pausing the processes (``--native`` adds C frames, but pauses them at every sample, which
  slows I/O-bound operations several times over);
- with ``--strace`` (strace on PATH): the syscalls of each service process, by count and time
  (``strace -c``; it slows the traced processes, so its timings are only for the shares).

Writes JSON (``--out``) and prints the breakdown. ``scripts/profile_data_path.py`` is the same
module. It measures this checkout; give ``--source`` to ``kvoffload bench`` to compare commits.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from kvoffload.bench import peer
from kvoffload.client import KVOffloadClient
from kvoffload.logs import configure_logging
from kvoffload.memory.kvcache import SharedKVCache, unique_kv_name
from kvoffload.memory.pool import HostPool
from kvoffload.testing.helpers import keys_for

ACTIVITIES = (
    ("waiting", ("Condition.wait", "Poller.poll", "pthread_cond", "_worker (concurrent", "sleep")),
    ("copy and checksum", ("_copy_hash_blocks",)),
    ("copy", ("copyto", "_contig_to_contig", "memmove", "memcpy", "copy_", "raw_array_assign")),
    ("checksum", ("XXH", "xxh3", "xxhash", "_xxhash", "payload_checksum", "_hash_buffers")),
    (
        "disk syscalls",
        ("os_pwrite", "os_pread", "pwritev", "preadv", "pwrite_all", "fdatasync", "fsync"),
    ),
    ("zeromq", ("zmq",)),
    ("message codec", ("msgspec", "protocol.py")),
    ("logging", ("structlog", "logs.py")),
)
"""Activity of a sample: the first of these whose markers appear in the sampled stack, read
from the innermost frame outwards; any other sample is "python" (interpreter and logic).
"waiting" is a thread py-spy sampled as running while it was about to block or wake (a
poll, a condition, an idle pool thread)."""

PERF_ACTIVITIES = (
    ("copy", ("memmove", "memcpy", "copy_user", "rep_movs", "copy_to_user", "copy_from_user")),
    ("copy", ("copy_folio", "copy_page_to_iter", "copy_page_from_iter")),
    ("copy", ("_copy_to_iter", "_copy_from_iter", "copy_page", "contig_to_contig")),
    ("checksum", ("XXH", "xxh")),
    ("page faults", ("clear_page", "handle_mm_fault", "do_anonymous_page", "filemap_fault")),
    ("page faults", ("shmem_fault", "__handle_mm_fault", "do_fault", "alloc_pages")),
    ("scheduling and wake-ups", ("finish_task_switch", "try_to_wake_up", "futex", "schedule")),
    ("scheduling and wake-ups", ("_raw_spin_unlock_irq", "pthread_cond", "pthread_mutex", "sem_")),
    ("file system and block I/O", ("ext4", "iomap", "blk_", "jbd2", "filemap", "folio", "bio_")),
    ("file system and block I/O", ("submit_bio", "nvme", "virtblk", "dio_", "__iomap")),
    ("zeromq", ("libzmq", "_zmq")),
    ("interpreter", ("libpython", "_PyEval", "PyObject", "msgspec", "_multiarray_umath")),
)
"""Activity of a perf sample by its symbol (and the library it is in): the first entry with a
marker in either; other kernel symbols are "kernel, other", other user code "other"."""


@dataclass
class Context:
    """What an operation needs: the client, the attached pool, the engine rows and keys."""

    client: KVOffloadClient
    pool: HostPool | None
    rows: np.ndarray
    n: int
    block: int
    prefix: int
    directory: Path
    round_no: int = 0
    state: dict[str, Any] = field(default_factory=dict)

    def fresh_keys(self, what: str) -> list[bytes]:
        self.round_no += 1
        return keys_for(f"{what}-{self.round_no}", self.n)


def _host_store(ctx: Context) -> None:
    peer.device_jobs(ctx.client, "p", ctx.fresh_keys("hs"), range(ctx.n), True, ctx.prefix)


def _reset(ctx: Context) -> None:
    ctx.client.reset_cache()


def _host_load(ctx: Context) -> None:
    keys = ctx.state.get("keys")
    if keys is None:
        keys = ctx.state["keys"] = ctx.fresh_keys("hl")
        peer.device_jobs(ctx.client, "p", keys, range(ctx.n), True, ctx.prefix)
    peer.device_jobs(ctx.client, "p", keys, range(ctx.n, 2 * ctx.n), False, ctx.prefix)


def _host_store_engine(ctx: Context) -> None:
    assert ctx.pool is not None
    keys = ctx.fresh_keys("hse")
    peer.engine_copies(ctx.client, ctx.pool, keys, ctx.rows[: ctx.n], ctx.prefix, store=True)


def _host_load_engine(ctx: Context) -> None:
    assert ctx.pool is not None
    keys = ctx.state.get("keys")
    if keys is None:
        keys = ctx.state["keys"] = ctx.fresh_keys("hle")
        peer.engine_copies(ctx.client, ctx.pool, keys, ctx.rows[: ctx.n], ctx.prefix, store=True)
    peer.engine_copies(ctx.client, ctx.pool, keys, ctx.rows[ctx.n :], ctx.prefix, store=False)


def _disk_store(ctx: Context, sync: bool) -> None:
    keys = ctx.fresh_keys("ds")
    before = ctx.client.status().tiering.per_tier["disk"].cascaded_keys_ok
    peer.device_jobs(ctx.client, "p", keys, range(ctx.n), True, ctx.prefix)
    peer.wait_on_disk(ctx.client, before + ctx.n)
    if sync:
        os.sync()


def _to_disk_only(ctx: Context) -> None:
    """Untimed: the keys of ``ctx.state`` on disk only (stored once and cascaded, then dropped
    from the pool before each run)."""
    if "keys" not in ctx.state:
        keys = ctx.state["keys"] = ctx.fresh_keys("cold")
        before = ctx.client.status().tiering.per_tier["disk"].cascaded_keys_ok
        peer.device_jobs(ctx.client, "p", keys, range(ctx.n), True, ctx.prefix)
        peer.wait_on_disk(ctx.client, before + ctx.n)
    ctx.client.reset_cache()


def _cold_load(ctx: Context) -> None:
    assert ctx.pool is not None
    keys = ctx.state["keys"]
    peer.cold_load(ctx.client, ctx.pool, "p", keys, ctx.rows[ctx.n :], ctx.prefix)


def _cold_load_one(ctx: Context) -> None:
    assert ctx.pool is not None
    keys = ctx.state["keys"][: peer.LATENCY_LOADS]
    ctx.state["us"] = peer.cold_load_one_us(ctx.client, ctx.pool, "p", keys, ctx.rows[ctx.n :])


def _nothing(ctx: Context) -> None:
    return None


@dataclass(frozen=True)
class Op:
    """``run`` is timed; ``before`` runs untimed ahead of each run."""

    run: Callable[[Context], None]
    before: Callable[[Context], None] = _nothing
    disk: bool = False
    io: str = "auto"
    engine_side: bool = False
    blocks: Callable[[int], int] = lambda n: n
    """Blocks one run moves (for GB/s), from the blocks of a round."""


OPS: dict[str, Op] = {
    "host_store": Op(_host_store, _reset),
    "host_load": Op(_host_load),
    "host_store_engine": Op(_host_store_engine, _reset, engine_side=True),
    "host_load_engine": Op(_host_load_engine, engine_side=True),
    "disk_store": Op(lambda ctx: _disk_store(ctx, False), _reset, disk=True, io="buffered"),
    "disk_store_sync": Op(lambda ctx: _disk_store(ctx, True), _reset, disk=True),
    "cold_load": Op(_cold_load, _to_disk_only, disk=True, engine_side=True),
    "cold_load_one": Op(
        _cold_load_one,
        _to_disk_only,
        disk=True,
        engine_side=True,
        blocks=lambda n: min(n, peer.LATENCY_LOADS),
    ),
}
"""The operations, named as ``bench peer``'s kvoffload figures (``cold_load_one`` is
``cold_load_one_us``: its runs are ``LATENCY_LOADS`` one-block loads one after the other)."""


def process_role(proc: psutil.Process, me: int) -> str:
    if proc.pid == me:
        return "client"
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return f"pid {proc.pid}"
    if "kvoffload.server" in cmd:
        return "manager"
    if match := re.search(r"workers\.(\w+)", cmd):
        return f"worker {match.group(1)}"
    return f"pid {proc.pid}"


def service_processes() -> dict[str, psutil.Process]:
    """This process and every process it started (the supervisor's children), by role."""
    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    return {process_role(p, me.pid): p for p in procs}


def cpu_snapshot(procs: dict[str, psutil.Process]) -> dict[str, tuple[float, ...]]:
    out: dict[str, tuple[float, ...]] = {}
    for role, proc in procs.items():
        with contextlib.suppress(psutil.Error):
            times, switches = proc.cpu_times(), proc.num_ctx_switches()
            out[role] = (times.user, times.system, switches.voluntary, switches.involuntary)
    return out


@contextlib.contextmanager
def sampled(kind: str | None, seconds: float, rate: int, out: Path) -> Iterator[None]:
    """Run py-spy (``kind`` "py-spy") over this process tree, or strace -c over each service
    process (``kind`` "strace"), while the block runs."""
    if kind is None:
        yield
        return
    procs: list[subprocess.Popen[bytes]] = []
    if kind in ("py-spy", "py-spy-native"):
        exe = _tool("py-spy")
        argv = [exe, "record", "--pid", str(os.getpid()), "--subprocesses"]
        argv += ["--native"] if kind == "py-spy-native" else ["--nonblocking"]
        argv += ["--rate", str(rate), "--duration", str(int(seconds) + 2), "--format", "raw"]
        procs.append(
            subprocess.Popen(
                [*argv, "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        )
    elif kind == "perf":
        exe = _tool("perf")
        pids = ",".join(str(p.pid) for p in service_processes().values())
        argv = [exe, "record", "-q", "-e", "cpu-clock", "-F", str(rate), "-p", pids]
        procs.append(
            subprocess.Popen(
                [*argv, "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        )
    else:
        exe = _tool("strace")
        for role, proc in service_processes().items():
            if role == "client":
                continue
            target = out.with_name(f"{out.name}.{role.replace(' ', '_')}.strace")
            argv = [exe, "-c", "-f", "-o", str(target), "-p", str(proc.pid)]
            procs.append(subprocess.Popen(argv, stderr=subprocess.DEVNULL))
    time.sleep(1.0)  # the profilers attach
    try:
        yield
    finally:
        for proc in procs:
            if kind in ("strace", "perf"):
                proc.send_signal(2)
            proc.wait(timeout=60)


def _tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        raise SystemExit(f"{name} is not installed (py-spy: pip install py-spy; strace: apt)")
    return found


def activity(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, markers in ACTIVITIES:
            if any(marker in frame for marker in markers):
                return name
    return "python"


def python_leaf(frames: list[str]) -> str:
    """The innermost frame that is Python code (``name (file.py:line)``), line dropped."""
    for frame in reversed(frames):
        if ".py:" in frame:
            return re.sub(r":\d+\)$", ")", frame)
    return frames[-1] if frames else "?"


def read_py_spy(files: list[tuple[Path, dict[int, str]]], top: int) -> dict[str, Any]:
    """Per role: samples, share per activity, busiest Python functions (innermost frame), over
    py-spy's raw files (each with the roles of its pids)."""
    samples: collections.Counter[str] = collections.Counter()
    activities: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    leaves: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    lines = [
        (line, roles)
        for path, roles in files
        if path.is_file()
        for line in path.read_text(errors="replace").splitlines()
    ]
    for line, roles in lines:
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        owners = [i for i, f in enumerate(frames) if f.startswith("process ")]
        if not owners or not count.isdigit():
            continue
        pid = int(frames[owners[-1]].split()[1].rstrip(":").split(":")[0])
        role = roles.get(pid, f"pid {pid}")
        body = frames[owners[-1] + 1 :]
        n = int(count)
        samples[role] += n
        activities[role][activity(body)] += n
        leaves[role][python_leaf(body)] += n
    return {
        role: {
            "samples": total,
            "activities": {k: v / total for k, v in activities[role].most_common()},
            "top_functions": {k: v / total for k, v in leaves[role].most_common(top)},
        }
        for role, total in samples.most_common()
    }


def read_strace(targets: list[Path]) -> dict[str, list[dict[str, Any]]]:
    """Per role: its syscalls from the ``strace -c`` tables of ``targets``, summed (calls,
    seconds, errors), most time first."""
    sums: dict[str, dict[str, list[float]]] = collections.defaultdict(dict)
    for out in targets:
        for path in sorted(out.parent.glob(f"{out.name}.*.strace")):
            role = path.name.removeprefix(f"{out.name}.").removesuffix(".strace")
            for line in path.read_text().splitlines():
                parts = line.split()
                if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
                    row = sums[role.replace("_", " ")].setdefault(parts[-1], [0.0, 0.0, 0.0])
                    row[0] += float(parts[1])
                    row[1] += int(parts[3])
                    row[2] += int(parts[4]) if len(parts) == 6 else 0
    return {
        role: [
            {"syscall": name, "seconds": r[0], "calls": int(r[1]), "errors": int(r[2])}
            for name, r in sorted(rows.items(), key=lambda item: -item[1][0])
        ]
        for role, rows in sums.items()
    }


def thread_roles(procs: dict[str, psutil.Process]) -> dict[int, str]:
    """Every thread id of the service's processes, to its process's role."""
    roles = {}
    for role, proc in procs.items():
        with contextlib.suppress(psutil.Error):
            for thread in proc.threads():
                roles[thread.id] = role
    return roles


def perf_activity(dso: str, symbol: str) -> str:
    for name, markers in PERF_ACTIVITIES:
        if any(marker in symbol or marker in dso for marker in markers):
            return name
    return "kernel, other" if "kernel" in dso else "other"


def read_perf(files: list[tuple[Path, dict[int, str]]], top: int) -> dict[str, Any]:
    """Per role: samples, share per activity (``PERF_ACTIVITIES``), busiest symbols."""
    exe = _tool("perf")
    samples: collections.Counter[str] = collections.Counter()
    activities: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    symbols: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for path, roles in files:
        if not path.is_file():
            continue
        argv = [exe, "report", "-i", str(path), "--stdio", "--no-children", "-g", "none"]
        argv += ["--sort", "pid,dso,sym", "-F", "sample,pid,dso,sym", "--field-separator", ";"]
        done = subprocess.run(argv, capture_output=True, text=True)
        for line in done.stdout.splitlines():
            parts = [part.strip() for part in line.split(";")]
            if line.startswith("#") or len(parts) < 4 or not parts[0].isdigit():
                continue
            count, task, dso, symbol = int(parts[0]), parts[1], parts[2], parts[3]
            tid = int(task.split(":")[0]) if task.split(":")[0].isdigit() else -1
            role = roles.get(tid, "other")
            symbol = symbol.removeprefix("[k] ").removeprefix("[.] ")
            samples[role] += count
            activities[role][perf_activity(dso, symbol)] += count
            symbols[role][f"{symbol} ({Path(dso).name})"] += count
    return {
        role: {
            "samples": total,
            "activities": {k: v / total for k, v in activities[role].most_common()},
            "top_symbols": {k: v / total for k, v in symbols[role].most_common(top)},
        }
        for role, total in samples.most_common()
    }


def profile(args: argparse.Namespace) -> dict[str, Any]:
    """Run the operation in one service (or, ``--fresh``, each run in a new service, as ``bench
    peer`` measures it) and return the report."""
    op = OPS[args.op]
    block, prefix = args.size, args.prefix_blocks
    n = max(prefix, (args.mib << 20) // block)
    report: dict[str, Any] = {"op": args.op, "block_bytes": block, "blocks": n, "mib": args.mib}
    report["fresh_service_per_run"] = args.fresh
    directory = Path(tempfile.mkdtemp(prefix="kvo-profile-", dir=args.dir))
    kv = SharedKVCache.create(unique_kv_name(), 2 * n, [block])
    rows = kv.tensors[0]
    rows[:n] = np.random.default_rng(block).integers(0, 256, size=(n, block), dtype=np.uint8)
    rows[n:] = 0
    tally = Tally()
    try:
        deadline = time.monotonic() + args.seconds
        while True:
            with _service(op, kv, rows, n, block, prefix, directory, args) as ctx:
                if not args.fresh:
                    op.before(ctx)
                    op.run(ctx)  # warm: mappings, threads, first-use paths
                tally.measure(op, ctx, args, deadline)
            if not args.fresh or time.monotonic() >= deadline:
                break
    finally:
        kv.close()
        kv.unlink()
        shutil.rmtree(directory, ignore_errors=True)
    report.update(tally.report(op, n, block, args))
    return report


@contextlib.contextmanager
def _service(
    op: Op,
    kv: SharedKVCache,
    rows: np.ndarray,
    n: int,
    block: int,
    prefix: int,
    directory: Path,
    args: argparse.Namespace,
) -> Iterator[Context]:
    disk_bytes = (args.rounds_on_disk + 2) * n * (block + 8192)
    io = args.io or op.io
    with peer.peer_service(block, n + 64, op.disk, disk_bytes, io=io) as client:
        peer.register_engine(client, kv, n, op.disk)
        for req in ("p", "host"):
            client.new_request(req)
        info = client.info
        pool = HostPool.attach(info.pool_name, info.num_slots, info.block_bytes)
        try:
            yield Context(client, pool, rows, n, block, prefix, directory)
        finally:
            pool.close()


@dataclass
class Tally:
    """Runs, wall time and per-process CPU and switches summed over the measured runs."""

    runs: int = 0
    wall: float = 0.0
    cpu: dict[str, list[float]] = field(default_factory=dict)
    py_spy: list[tuple[Path, dict[int, str]]] = field(default_factory=list)
    perf: list[tuple[Path, dict[int, str]]] = field(default_factory=list)
    strace: list[Path] = field(default_factory=list)
    p50_us: list[float] = field(default_factory=list)

    def measure(self, op: Op, ctx: Context, args: argparse.Namespace, deadline: float) -> None:
        """Run ``op`` until ``deadline`` (once, with ``--fresh``), sampled as asked."""
        procs = service_processes()
        out = Path(args.out)
        sampler = (
            "perf"
            if args.perf
            else ("py-spy-native" if args.native else "py-spy")
            if args.py_spy
            else "strace"
            if args.strace
            else None
        )
        taken = len(self.py_spy) + len(self.perf) + len(self.strace)
        target = out.with_name(f"{out.stem}.{taken}")
        seconds = 1.0 if args.fresh else max(0.0, deadline - time.monotonic())
        with sampled(sampler, seconds, args.rate, target):
            while True:
                op.before(ctx)
                before = cpu_snapshot(procs)
                start = time.perf_counter()
                op.run(ctx)
                self.wall += time.perf_counter() - start
                after = cpu_snapshot(procs)
                for role in before.keys() & after.keys():
                    sums = self.cpu.setdefault(role, [0.0] * 4)
                    for i in range(4):
                        sums[i] += after[role][i] - before[role][i]
                self.runs += 1
                if "us" in ctx.state:
                    self.p50_us.append(ctx.state["us"])
                if args.fresh or time.monotonic() >= deadline:
                    break
        if sampler in ("py-spy", "py-spy-native"):
            self.py_spy.append((target, {p.pid: role for role, p in procs.items()}))
        elif sampler == "perf":
            self.perf.append((target, thread_roles(procs)))
        elif sampler == "strace":
            self.strace.append(target)

    def report(self, op: Op, n: int, block: int, args: argparse.Namespace) -> dict[str, Any]:
        runs = max(1, self.runs)
        result: dict[str, Any] = {
            "runs": self.runs,
            "wall_ms_per_run": self.wall / runs * 1e3,
            "gbps": op.blocks(n) * block * runs / self.wall / 1e9 if self.wall else 0.0,
            "processes": {
                role: {
                    "user_ms_per_run": sums[0] / runs * 1e3,
                    "system_ms_per_run": sums[1] / runs * 1e3,
                    "voluntary_switches_per_run": sums[2] / runs,
                    "involuntary_switches_per_run": sums[3] / runs,
                }
                for role, sums in sorted(self.cpu.items())
            },
        }
        if self.p50_us:
            result["p50_us"] = statistics.median(self.p50_us)
        if self.py_spy:
            result["py_spy"] = read_py_spy(self.py_spy, args.top)
        if self.perf:
            result["perf"] = read_perf(self.perf, args.top)
        if self.strace:
            result["strace"] = read_strace(self.strace)
        return result


def print_report(report: dict[str, Any]) -> None:
    size = report["block_bytes"]
    label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
    fresh = ", a new service each" if report["fresh_service_per_run"] else ""
    line = f"{report['op']} at {label} blocks, {report['blocks']} blocks a run, {report['runs']} runs{fresh}"
    line += f": {report['wall_ms_per_run']:.2f} ms a run, {report['gbps']:.2f} GB/s"
    if "p50_us" in report:
        line += f", one-block p50 {report['p50_us']:.0f} us"
    print(line)
    print(f"  {'process':<14}{'user ms':>9}{'sys ms':>9}{'vol cs':>9}{'invol cs':>9}  (per run)")
    for role, p in report["processes"].items():
        print(
            f"  {role:<14}{p['user_ms_per_run']:>9.2f}{p['system_ms_per_run']:>9.2f}"
            f"{p['voluntary_switches_per_run']:>9.1f}{p['involuntary_switches_per_run']:>9.1f}"
        )
    for role, entry in report.get("perf", {}).items():
        shares = ", ".join(f"{k} {v:.0%}" for k, v in entry["activities"].items())
        print(f"  perf {role} ({entry['samples']} samples): {shares}")
        for name, share in entry["top_symbols"].items():
            print(f"      {share:6.1%}  {name}")
    for role, entry in report.get("py_spy", {}).items():
        shares = ", ".join(f"{k} {v:.0%}" for k, v in entry["activities"].items())
        print(f"  py-spy {role} ({entry['samples']} samples): {shares}")
        for name, share in entry["top_functions"].items():
            print(f"      {share:6.1%}  {name}")
    for role, rows in report.get("strace", {}).items():
        calls = ", ".join(f"{r['syscall']} {r['calls']}" for r in rows[:8])
        print(f"  strace {role}: {calls}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("op", choices=sorted(OPS))
    parser.add_argument("--size", type=int, default=256 << 10, help="block bytes")
    parser.add_argument("--mib", type=int, default=128, help="bytes a run moves, MiB")
    parser.add_argument("--prefix-blocks", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--perf", action="store_true", help="sample every process with perf")
    parser.add_argument("--py-spy", action="store_true", help="sample every process with py-spy")
    parser.add_argument(
        "--native", action="store_true", help="py-spy with C frames (pauses the processes)"
    )
    parser.add_argument("--strace", action="store_true", help="count syscalls with strace -c")
    parser.add_argument("--rate", type=int, default=250, help="samples per second (py-spy, perf)")
    parser.add_argument("--top", type=int, default=8, help="Python functions listed per process")
    parser.add_argument(
        "--fresh", action="store_true", help="each run in a new service, as bench peer measures"
    )
    parser.add_argument(
        "--io", choices=("auto", "direct", "buffered"), help="disk.io (default: the op's)"
    )
    parser.add_argument("--rounds-on-disk", type=int, default=2, help="disk tier capacity, runs")
    parser.add_argument("--dir", help="directory for temporary files (default: the temp dir)")
    parser.add_argument("--out", default="results/profile.json")
    args = parser.parse_args(argv)
    configure_logging("bench", "warning")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    report = profile(args)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
