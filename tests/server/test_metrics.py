"""The manager's Prometheus endpoint as an operator sees it: counters that survive worker
restarts, and the shipped Grafana dashboard querying only exported metrics."""

from __future__ import annotations

import json
import os
import re
import signal

from kvoffload.memory.kvcache import SharedKVCache
from kvoffload.testing.helpers import REPO_ROOT, free_port, keys_for
from kvoffload.testing.metrics import sample_value, scrape_metrics
from kvoffload.testing.peers import make_node
from kvoffload.testing.s3server import object_section
from kvoffload.testing.service import to_toml
from tests.server.test_service import BLOCK, store_and_wait

DASHBOARD = REPO_ROOT / "dashboards" / "kvoffload.json"
METRIC_NAME = re.compile(r"\b(?:kvoffload|process)_[a-z0-9_]+\b")
SAMPLE_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_count", "_sum"),
    "gauge": ("",),
}


def test_worker_counters_survive_a_worker_restart(start_service):
    port = free_port()
    service = start_service(service_options=f"metrics_port = {port}")
    stored = "kvoffload_worker_bytes_stored"
    cache = SharedKVCache.create(None, 4, [BLOCK // 2, BLOCK // 2])
    try:
        store_across_a_worker_restart(service, port, cache)
    finally:
        cache.close()
        cache.unlink()

    families = scrape_metrics(port, lambda f: sample_value(f, stored, worker="cpu") == 3 * BLOCK)
    assert sample_value(families, "kvoffload_worker_restarts") == 1
    assert sample_value(families, "kvoffload_worker_jobs_done", worker="cpu") == 2
    assert (
        sample_value(families, "kvoffload_jobs", worker="cpu", kind="device_store", outcome="ok")
        == 2
    )


def store_across_a_worker_restart(service, port: int, cache: SharedKVCache) -> None:
    """Two blocks stored, the cpu worker SIGKILLed and restarted, one more block stored."""
    stored = "kvoffload_worker_bytes_stored"
    with service.client("engine") as c:
        c.register_kv(cache.handle("kv"))
        c.new_request("r")
        assert store_and_wait(c, "r", keys_for("before", 2), [0, 1]).success
        scrape_metrics(port, lambda f: sample_value(f, stored, worker="cpu") == 2 * BLOCK)

        old_pid = service.status().workers["cpu"].pid
        os.kill(old_pid, signal.SIGKILL)
        service.wait_workers(["cpu"], exclude_pids=[old_pid])
        assert store_and_wait(c, "r", keys_for("after", 1), [2]).success


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    panels = list(dashboard["panels"])
    while panels:
        panel = panels.pop()
        panels.extend(panel.get("panels", []))
        queries.extend(target["expr"] for target in panel.get("targets", []))
    return queries


def exported_names(families: dict) -> set[str]:
    names = set()
    for family in families.values():
        names.update(family.name + suffix for suffix in SAMPLE_SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def test_grafana_dashboard_queries_only_exported_metrics(start_service, tmp_path):
    port = free_port()
    peer = make_node(tmp_path, "node").sections(follows=[])  # a peer tier serving, following none
    keys = "\n".join(f'{key} = "{value}"' for key, value in peer["service"].items())
    service = start_service(
        workers=("cpu", "disk"),
        service_options=f"metrics_port = {port}\n{keys}",
        extra_config=to_toml({"events": peer["events"], "peer": peer["peer"]}),
    )
    families = scrape_metrics(
        port,
        lambda f: (
            "kvoffload_worker_used_bytes" in f
            and "kvoffload_worker_bytes_stored" in f
            and "kvoffload_worker_keys_indexed" in f
        ),
    )
    queries = dashboard_queries()
    assert len(queries) > 20
    referenced: set[str] = set()
    for query in queries:
        names = set(METRIC_NAME.findall(query))
        assert names, f"query references no kvoffload metric: {query}"
        referenced |= names
    assert sorted(referenced - exported_names(families)) == []
    assert service.status().workers["disk"].alive


OPERATIONS = REPO_ROOT / "docs" / "operations.md"


def documented_families(text: str) -> list[re.Pattern[str]]:
    """The metric families the metrics table of operations.md names, as patterns: each code
    span of its first column (``_total`` dropped, ``<stat>`` and ``*`` standing for a name)."""
    section = text.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    patterns = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        for name in re.findall(r"`([^`]+)`", line.split("|")[1]):
            name = name.removesuffix("_total")
            regex = re.escape(name).replace(re.escape("<stat>"), r"\w+").replace(r"\*", r"\w*")
            patterns.append(re.compile(regex + r"(_total)?"))
    return patterns


def undocumented(families: set[str], text: str) -> list[str]:
    patterns = documented_families(text)
    return sorted(f for f in families if not any(p.fullmatch(f) for p in patterns))


def test_every_exported_metric_is_in_the_operations_guide(start_service, s3_server) -> None:
    port = free_port()
    s3_server.create_bucket("metrics-doc")
    service = start_service(
        workers=("cpu", "disk"),
        service_options=f"metrics_port = {port}",
        extra_config=to_toml(
            {
                "object": object_section(s3_server, "metrics-doc", "kv"),
                "tenants": {"alice": {"pool_slots_share": 4}},
            }
        ),
    )
    with service.client("engine") as client:
        client.new_request("r", tenant="alice")
        keys = keys_for("metrics-doc", 4)
        client.complete_store("r", client.prepare_store("r", keys).keys)
        client.lookup("r", keys)
        client.finish_request("r")
    families = scrape_metrics(
        port, lambda f: "kvoffload_tenant_blocks" in f and "kvoffload_worker_gets" in f
    )
    text = OPERATIONS.read_text()
    assert len(families) > 40
    missing = undocumented(set(families), text)
    assert missing == [], "\n".join(missing)
    assert undocumented({"kvoffload_planted_gauge", "kvoffload_tier_lookups"}, text) == [
        "kvoffload_planted_gauge"
    ]
