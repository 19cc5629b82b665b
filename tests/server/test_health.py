"""Health and readiness of a real service (``kvoffload serve``): ``/healthz`` and ``/readyz``
beside ``/metrics`` on ``service.metrics_host``; a configured tier whose worker never comes up
(an object store nobody listens on) makes the service degraded: ``/readyz`` says 503 with the
reason, ``kvoffload status`` and the ``kvoffload_degraded`` metric say so; an S3 server that
comes up 20 s after the service (its bucket made after that) is joined without a restart."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

from kvoffload.cli import main
from kvoffload.testing.helpers import free_port, keys_for, skip_without_extra, wait_until
from kvoffload.testing.metrics import sample_value, scrape_metrics
from kvoffload.testing.s3server import S3Server, object_section
from kvoffload.testing.service import serve_harness, to_toml


def probe(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_serving_service_is_healthy_and_ready(start_service):
    port = free_port()
    start_service(
        workers=("cpu", "disk"), service_options=f'metrics_port = {port}\nmetrics_host = "0.0.0.0"'
    )
    assert wait_until(lambda: probe(port, "/readyz") == (200, "ok\n"), what="ready")
    assert probe(port, "/healthz") == (200, "ok\n")
    families = scrape_metrics(port, lambda f: "kvoffload_degraded" in f)
    assert sample_value(families, "kvoffload_degraded") == 0


def test_a_tier_that_never_comes_up_makes_the_service_degraded_and_not_ready(tmp_path, capsys):
    port, dead = free_port(), free_port()
    service = serve_harness(
        tmp_path / "service",
        service_options=f"metrics_port = {port}",
        extra_config=to_toml(
            {
                "object": {
                    "enabled": True,
                    "endpoint": f"http://127.0.0.1:{dead}",
                    "access_key_id": "nobody",
                    "secret_access_key": "nothing",
                    "request_timeout_s": 1.0,
                    "max_retries": 0,
                }
            }
        ),
    )
    try:
        service.start(wait_for=("cpu",))
        code, body = wait_until(
            lambda: (r := probe(port, "/readyz"))[0] == 503 and "degraded" in r[1] and r,
            what="readyz to say the object tier is down",
        )
        assert "tier object: down" in body.splitlines()
        assert probe(port, "/healthz") == (200, "ok\n")  # the service itself answers
        assert service.status().tiers_down == ["object"]
        families = scrape_metrics(port, lambda f: sample_value(f, "kvoffload_degraded") == 1)
        assert sample_value(families, "kvoffload_degraded") == 1
        assert main(["status", "--endpoint", service.endpoint]) == 0
        assert "DEGRADED: object down" in capsys.readouterr().out
    finally:
        leftovers = service.stop()
    assert leftovers.clean, leftovers


def test_an_object_tier_whose_s3_comes_up_late_joins_without_a_restart(tmp_path):
    skip_without_extra("object")
    s3 = S3Server(tmp_path / "s3")  # not started yet
    port = free_port()
    service = serve_harness(
        tmp_path / "service",
        service_options=f"metrics_port = {port}",
        extra_config=(
            "restart_backoff_initial_s = 0.2\nrestart_backoff_max_s = 1.0\n"
            + to_toml({"object": object_section(s3, "late", "kv")})
        ),
    )
    started = time.monotonic()
    try:
        service.start(wait_for=("cpu",))
        wait_until(
            lambda: "tier object: down" in probe(port, "/readyz")[1], what="the tier to be down"
        )
        time.sleep(max(0.0, 20.0 - (time.monotonic() - started)))
        s3.start()  # reachable now, but the bucket is still missing
        s3.create_bucket("late")
        assert wait_until(lambda: probe(port, "/readyz") == (200, "ok\n"), timeout_s=60)
        manager = service.status().pid
        keys = keys_for("late", 4)
        with service.client("engine") as client:
            client.new_request("late")
            client.complete_store("late", client.prepare_store("late", keys).keys)
            client.finish_request("late")
            wait_until(
                lambda: client.status().tiering.per_tier["object"].cascaded_keys_ok == 4,
                what="the blocks' cascade to the bucket",
            )
        assert service.status().pid == manager  # joined with no restart of the service
    finally:
        leftovers = service.stop()
        s3.stop()
    assert leftovers.clean, leftovers
    tries = [e for e in service.log_events() if e.get("event") == "object_store_unavailable"]
    assert len(tries) == 1 and "cannot reach" in tries[0]["error"]  # at most once a minute
    ready = [e for e in service.log_events() if e.get("event") == "object_store_ready"]
    assert len(ready) == 1 and ready[0]["attempts"] > 2
