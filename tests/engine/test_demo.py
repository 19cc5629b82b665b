"""``kvoffload demo`` end to end on a small workload with a restart: it passes on a healthy
service, serves each phase from its tier, removes every segment it made, and fails when a loaded
block's bytes are changed."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from kvoffload.cli import build_parser
from kvoffload.config import load_config
from kvoffload.engine.demo import run_demo
from kvoffload.testing.helpers import skip_without_extra

skip_without_extra("engine")

from kvoffload.engine import Engine  # noqa: E402
from kvoffload.memory.kvcache import SharedKVCache  # noqa: E402
from kvoffload.memory.pool import HostPool  # noqa: E402

SMALL = [
    "--conversations",
    "2",
    "--turns",
    "2",
    "--blocks-per-turn",
    "2",
    "--new-tokens",
    "4",
    "--seed",
    "7",
]


@pytest.fixture(autouse=True)
def temp_dir_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo writes its service log into the temp dir: the test's own, not the machine's."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """run_demo configures logging for the process; put the previous configuration back."""
    saved = structlog.get_config()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    structlog.configure(**saved)
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def created_segments(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the shm segments (engine KV caches and host pools) made in this process."""
    names: list[str] = []
    kv_create, pool_create = SharedKVCache.create.__func__, HostPool.create.__func__

    def record_kv(cls, name, *a, **kw):
        cache = kv_create(cls, name, *a, **kw)
        names.append(cache.name)
        return cache

    def record_pool(cls, name, *a, **kw):
        names.append(name)
        return pool_create(cls, name, *a, **kw)

    monkeypatch.setattr(SharedKVCache, "create", classmethod(record_kv))
    monkeypatch.setattr(HostPool, "create", classmethod(record_pool))
    return names


def demo_config(tmp_path: Path):
    return load_config(
        None,
        {
            "KVOFFLOAD_SERVICE__RUNTIME_DIR": str(tmp_path / "run"),
            "KVOFFLOAD_DISK__ROOT": str(tmp_path / "disk"),
            "KVOFFLOAD_POOL__NUM_SLOTS": "128",
        },
    )


def test_demo_passes_and_serves_every_phase_from_its_tier(
    tmp_path: Path, capsys, restore_logging, created_segments: list[str]
) -> None:
    out = tmp_path / "demo.json"
    args = build_parser().parse_args(["demo", *SMALL, "--restart", "--json-out", str(out)])
    assert run_demo(demo_config(tmp_path), args) == 0
    printed = capsys.readouterr().out
    assert "PASS" in printed
    log_file = tmp_path / f"kvoffload-demo-{os.getpid()}.log"
    assert f"service logs in {log_file}" in printed and log_file.stat().st_size > 0
    report = json.loads(out.read_text())
    assert report["ok"] and report["seed"] == 7
    phases: dict[str, list[dict]] = {}
    for row in report["rows"]:
        assert row["ok"] and row["tokens_same"], row
        phases.setdefault(row["phase"], []).append(row)
    assert sorted(phases) == ["1 pool", "2 process", "3 reset", "4 restart"]
    assert all(r["served_by"].keys() == {"pool"} for r in phases["1 pool"] if r["turn"] > 0)
    assert all(r["engine"] == "second" and r["kv"] == "same" for r in phases["2 process"])
    assert all(
        r["served_by"].keys() == {"disk"} and r["kv"] == "same"
        for r in phases["3 reset"] + phases["4 restart"]
    )
    assert len(created_segments) == 4  # main engine and pool, twice (the restart)
    assert not [n for n in created_segments if os.path.exists(f"/dev/shm{n}")]


def test_demo_fails_when_loaded_kv_is_altered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, restore_logging
) -> None:
    real = Engine._reuse_prefix

    def reuse_then_flip_a_bit(self, req_id, keys, table, result):
        reused = real(self, req_id, keys, table, result)
        if reused[0]:
            self.cache.tensors[1][table[0]].view(-1)[0] += 1.0
        return reused

    monkeypatch.setattr(Engine, "_reuse_prefix", reuse_then_flip_a_bit)
    out = tmp_path / "demo.json"
    args = build_parser().parse_args(
        [
            "demo",
            "--conversations",
            "1",
            "--turns",
            "2",
            "--blocks-per-turn",
            "2",
            "--new-tokens",
            "2",
            "--seed",
            "3",
            "--json-out",
            str(out),
        ]
    )
    assert run_demo(demo_config(tmp_path), args) == 1
    assert "FAIL" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["ok"] and rows[0]["kv"] == "-"
    assert rows[1]["kv"] == "DIFF" and not rows[1]["ok"]
