"""The object benchmark: same-run ratios to the reference client, against a real SeaweedFS."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from kvoffload.testing.helpers import skip_without_extra

skip_without_extra("object")

from kvoffload.bench import object as bench_object  # noqa: E402
from kvoffload.bench.cells import object_cells  # noqa: E402
from kvoffload.testing.s3server import S3Server  # noqa: E402


def test_ratios_are_medians_of_per_round_ratios() -> None:
    cells = [
        {
            "client": "obstore",
            "block": "1MiB",
            "threads": 8,
            "rounds_mb_s": [{"put": 100.0, "get": 100.0}, {"put": 50.0, "get": 200.0}],
        },
        {
            "client": "s3blockstore",
            "block": "1MiB",
            "threads": 8,
            "rounds_mb_s": [{"put": 90.0, "get": 120.0}, {"put": 50.0, "get": 100.0}],
        },
    ]
    (row,) = bench_object.ratios(cells, "obstore")
    assert row["client"] == "s3blockstore" and row["reference"] == "obstore"
    assert row["put_rounds"] == [0.9, 1.0] and row["put"] == 0.95
    assert row["get_rounds"] == [1.2, 0.5] and row["get"] == 0.85


def test_interleaved_run_writes_cells_and_per_round_ratios(
    s3_server: S3Server, tmp_path: Path
) -> None:
    bucket = s3_server.create_bucket(f"kvo-bench-{uuid.uuid4().hex[:12]}")
    out = tmp_path / "bench_object.json"
    clients = ["obstore", "obstore-unsigned", "s3blockstore"]
    argv = [
        f"--endpoint={s3_server.endpoint}",
        f"--bucket={bucket}",
        f"--access-key={s3_server.access_key}",
        f"--secret-key={s3_server.secret_key}",
        f"--region={s3_server.region}",
        "--sizes=256KiB",
        "--threads=2",
        f"--clients={','.join(clients)}",
        "--count=4",
        "--batch=2",
        "--rounds=2",
        f"--out={out}",
    ]
    assert bench_object.main(argv) == 0
    result = json.loads(out.read_text())
    assert [c["client"] for c in result["cells"]] == clients
    for cell in result["cells"]:
        assert len(cell["rounds_mb_s"]) == 2
        assert cell["put_mb_s"] > 0 and cell["get_mb_s"] > 0
        assert cell["put_client_cpu_us"] > 0 and cell["get_client_cpu_us"] > 0
    assert [r["client"] for r in result["ratios"]] == clients[1:]
    for row in result["ratios"]:
        assert row["reference"] == "obstore" and len(row["get_rounds"]) == 2


def test_bench_summary_cells_take_the_per_round_ratio() -> None:
    def cell(client: str, mb_s: float) -> dict:
        return {"client": client, "block": "1MiB", "threads": 8, "put_mb_s": mb_s, "get_mb_s": mb_s}

    outputs = {
        "object": {
            "cells": [cell("obstore", 100.0), cell("s3blockstore", 90.0)],
            "ratios": [
                {
                    "client": "s3blockstore",
                    "reference": "obstore",
                    "block": "1MiB",
                    "threads": 8,
                    "put": 1.2,
                    "get": 0.97,
                }
            ],
        }
    }
    by_metric = {c.metric: c for c in object_cells(outputs)}
    assert by_metric["PUT 8t"].value == 0.09 and by_metric["PUT 8t"].reference_value == 0.1
    assert by_metric["PUT 8t"].ratio_to_reference == 1.2
    assert by_metric["GET 8t"].ratio_to_reference == 0.97
