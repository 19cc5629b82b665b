"""Health and readiness of a real service (``kvoffload serve``): ``/healthz`` and ``/readyz``
beside ``/metrics`` on ``service.metrics_host``; a configured tier whose worker never comes up
(an object store nobody listens on) makes the service degraded: ``/readyz`` says 503 with the
reason, ``kvoffload status`` and the ``kvoffload_degraded`` metric say so."""

from __future__ import annotations

import urllib.error
import urllib.request

from kvoffload.cli import main
from kvoffload.testing.helpers import free_port, wait_until
from kvoffload.testing.metrics import sample_value, scrape_metrics
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
