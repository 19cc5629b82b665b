"""The pieces of the vLLM integration that need no vLLM: key fingerprints, endpoint discovery
and the bounded, self-healing link to a real service."""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kvoffload.config import load_config
from kvoffload.integrations.vllm.keys import KVIdentity, hashing_is_seed_dependent, model_digest
from kvoffload.integrations.vllm.link import ServiceDown, ServiceLink
from kvoffload.integrations.vllm.settings import ConnectorSettings
from kvoffload.runtime.discovery import ENDPOINT_ENV, NoServiceFound, find_endpoint
from kvoffload.testing.helpers import wait_until

IDENTITY = KVIdentity(
    model="/models/llama",
    model_digest="abc",
    revision="",
    kv_dtype="bfloat16",
    tokens_per_block=(32,),
    blocks_per_chunk=1,
    layout="kvoffload-vllm-1/NHD",
    tp_size=1,
    pp_size=1,
    pcp_size=1,
    dcp_size=1,
    per_rank_bytes=65536,
)


def test_fingerprint_separates_everything_that_changes_kv_bytes():
    same = replace(IDENTITY)
    assert same.fingerprint() == IDENTITY.fingerprint()
    variants = [
        replace(IDENTITY, model="/models/other"),
        replace(IDENTITY, model_digest="abd"),
        replace(IDENTITY, revision="v2"),
        replace(IDENTITY, kv_dtype="float16"),
        replace(IDENTITY, tokens_per_block=(16,)),
        replace(IDENTITY, blocks_per_chunk=2),
        replace(IDENTITY, layout="kvoffload-vllm-1/HND"),
        replace(IDENTITY, tp_size=2),
        replace(IDENTITY, pp_size=2),
        replace(IDENTITY, namespace="tenant-a"),
        replace(IDENTITY, groups=((0, 32, ("l0", "l2")), (1, 32, ("l1", "l3")))),
        replace(IDENTITY, groups=((0, 32, ("l0",)), (1, 32, ("l1", "l2", "l3")))),
    ]
    prints = {v.fingerprint() for v in variants}
    assert len(prints) == len(variants) and IDENTITY.fingerprint() not in prints


def test_a_model_with_one_kv_cache_group_keeps_its_fingerprint():
    """Blocks stored before groups were part of the identity stay reachable."""
    assert replace(IDENTITY, groups=((0, 32, ("l0", "l1")),)).fingerprint() == (
        IDENTITY.fingerprint()
    )


def test_model_digest_sees_other_weights_with_the_same_config(tmp_path: Path):
    for name, weights in (("a", b"\x01" * 5000), ("b", b"\x02" * 5000)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"layers": 2}')
        (tmp_path / name / "model.safetensors").write_bytes(weights)
    assert model_digest(str(tmp_path / "a")) != model_digest(str(tmp_path / "b"))
    assert model_digest(str(tmp_path / "a")) == model_digest(str(tmp_path / "a"))
    assert model_digest("org/hub-name") == ""


def test_seed_dependent_hashing_is_detected(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert hashing_is_seed_dependent("xxhash")
    assert not hashing_is_seed_dependent("sha256")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert not hashing_is_seed_dependent("xxhash_cbor")


def test_settings_are_checked_and_named():
    settings = ConnectorSettings.from_extra_config(
        {"endpoint": "ipc:///x", "call_timeout_s": 0.1, "faults": {"fail_fraction": 0.5}}
    )
    assert settings.call_timeout_s == 0.1 and settings.faults.fail_fraction == 0.5
    with pytest.raises(ValueError, match="call_timeout_s"):
        ConnectorSettings.from_extra_config({"call_timeout_s": -1})
    with pytest.raises(ValueError, match="faults"):
        ConnectorSettings.from_extra_config({"faults": {"fail_fraction": "many"}})
    with pytest.raises(ValueError, match="sync_load_budget_bytes"):
        ConnectorSettings.from_extra_config({"sync_load_budget_bytes": "256M"})
    assert ConnectorSettings.from_extra_config({}).layered_load_cpus is None
    cpus = ConnectorSettings.from_extra_config({"layered_load_cpus": [3, 1]}).layered_load_cpus
    assert cpus == {1, 3}
    with pytest.raises(ValueError, match="layered_load_cpus"):
        ConnectorSettings.from_extra_config({"layered_load_cpus": "1-3"})
    assert ConnectorSettings.from_extra_config({}).idle_landing_wait_ms == 5
    assert (
        ConnectorSettings.from_extra_config({"idle_landing_wait_ms": 0}).idle_landing_wait_ms == 0
    )
    with pytest.raises(ValueError, match="idle_landing_wait_ms"):
        ConnectorSettings.from_extra_config({"idle_landing_wait_ms": 2.5})


def test_endpoint_discovery_order(tmp_path: Path, monkeypatch, start_service):
    monkeypatch.setenv(ENDPOINT_ENV, "ipc:///from-env")
    assert find_endpoint("ipc:///explicit") == "ipc:///explicit"
    assert find_endpoint() == "ipc:///from-env"
    monkeypatch.delenv(ENDPOINT_ENV)
    empty = load_config(None, env={"KVOFFLOAD_SERVICE__RUNTIME_DIR": str(tmp_path / "none")})
    with pytest.raises(NoServiceFound, match="kvoffload serve"):
        find_endpoint(cfg=empty)
    svc = start_service()
    cfg = load_config(None, env={"KVOFFLOAD_SERVICE__RUNTIME_DIR": str(svc.runtime_dir)})
    assert find_endpoint(cfg=cfg) == svc.endpoint


def test_link_is_bounded_while_hung_and_heals_by_itself(start_service):
    svc = start_service()
    link = ServiceLink(
        lambda: svc.endpoint, name="t", call_timeout_s=0.2, connect_timeout_s=0.3, max_backoff_s=0.2
    )
    try:
        assert link.connect_now() and link.generation == 1
        assert link.call(lambda c: c.status()).pid > 0
        status = svc.status()
        manager, sessions = status.pid, status.clients
        os.kill(manager, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(ServiceDown):
                link.call(lambda c: c.status())
            assert time.monotonic() - start < 1.0
            start = time.monotonic()
            for _ in range(100):
                with pytest.raises(ServiceDown):
                    link.call(lambda c: c.status())
            assert time.monotonic() - start < 0.5  # answered locally while down
        finally:
            os.kill(manager, signal.SIGCONT)
        wait_until(link.ready, what="the link")
        assert link.generation == 2
        assert link.call(lambda c: c.status()).pid == manager
        # the hung session was told to leave
        wait_until(lambda: svc.status().clients == sessions, what="the hung session to leave")
    finally:
        link.close()


def test_an_error_to_a_call_sent_without_waiting_is_logged_by_the_next_call(start_service, caplog):
    svc = start_service()
    link = ServiceLink(
        lambda: svc.endpoint, name="t", call_timeout_s=5, connect_timeout_s=5, max_backoff_s=0.2
    )
    try:
        assert link.connect_now()
        link.call(lambda c: c.finish_request("never-started", wait=False))
        with caplog.at_level(logging.WARNING, logger="vllm.kvoffload"):
            assert link.call(lambda c: c.status()).pid > 0
        failed = [r.getMessage() for r in caplog.records if "unawaited_call_failed" in r.msg]
        assert len(failed) == 1 and "unknown_request" in failed[0], failed
        assert link.ready()  # the session stays
    finally:
        link.close()


def test_link_started_before_the_service_connects_when_it_appears(start_service, tmp_path):
    endpoint: list[str] = []

    def resolve() -> str:
        if not endpoint:
            raise NoServiceFound("not yet")
        return endpoint[0]

    link = ServiceLink(
        resolve, name="t", call_timeout_s=0.5, connect_timeout_s=0.5, max_backoff_s=0.1
    )
    try:
        assert not link.connect_now()
        with pytest.raises(ServiceDown):
            link.call(lambda c: c.status())
        endpoint.append(start_service().endpoint)
        wait_until(link.ready, what="the link")
        assert link.call(lambda c: c.status()).pid > 0
    finally:
        link.close()
