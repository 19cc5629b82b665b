"""Configuration: defaults, TOML file, environment overrides, error messages."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import msgspec
import pytest

from kvoffload.config import (
    Config,
    ConfigError,
    EngineConfig,
    load_config,
    resolve_runtime_dir,
)
from kvoffload.testing.helpers import REPO_ROOT

EXAMPLE = REPO_ROOT / "kvoffload.example.toml"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvoffload.toml"
    path.write_text(text)
    return path


def test_defaults_without_file() -> None:
    cfg = load_config(env={})
    assert cfg == Config()
    assert cfg.pool.num_slots == 1024
    assert cfg.pool.block_bytes == 262144
    assert cfg.pool.eviction_policy == "lru"
    assert cfg.service.heartbeat_interval_s == 0.5
    assert cfg.service.max_message_bytes == 16 * 1024 * 1024
    assert cfg.disk.enabled and cfg.disk.capacity_bytes == 8 << 30
    assert cfg.disk.root == "kvoffload-data/disk"
    assert not cfg.object.enabled and cfg.object.endpoint == ""
    assert cfg.engines == ()
    assert cfg.faults.fail_fraction == 0.0
    assert cfg.cpu.cpu_affinity == ()


def test_environ_is_the_default_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVOFFLOAD_POOL__NUM_SLOTS", "7")
    assert load_config().pool.num_slots == 7


def test_example_file_lists_every_key_with_its_default() -> None:
    example = tomllib.loads(EXAMPLE.read_text())
    defaults = Config().to_toml_dict()
    del defaults["engines"]
    assert example == defaults
    assert load_config(EXAMPLE, env={}) == Config()
    planted = EXAMPLE.read_text().replace("metrics_host = ", "# metrics_host = ", 1)
    assert tomllib.loads(planted) != defaults  # the check sees a key the reference leaves out


def test_file_overrides(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
        [pool]
        num_slots = 64
        eviction_policy = "arc"
        [disk]
        durability = "fsync"
        cpu_affinity = [0, 1]
        [[engines]]
        command = ["python", "-m", "engine"]
        env = { A = "1" }
        """.replace("        ", ""),
    )
    cfg = load_config(path, env={})
    assert cfg.pool.num_slots == 64
    assert cfg.pool.eviction_policy == "arc"
    assert cfg.pool.block_bytes == 262144
    assert cfg.disk.durability == "fsync"
    assert cfg.disk.cpu_affinity == (0, 1)
    assert cfg.engines == (EngineConfig(command=("python", "-m", "engine"), env={"A": "1"}),)


def test_env_overrides_file_with_type_parsing(tmp_path: Path) -> None:
    path = _write(tmp_path, "[pool]\nnum_slots = 64\n")
    env = {
        "KVOFFLOAD_POOL__NUM_SLOTS": "128",
        "KVOFFLOAD_DISK__ENABLED": "false",
        "KVOFFLOAD_SERVICE__HEARTBEAT_TIMEOUT_S": "7",
        "KVOFFLOAD_OBJECT__CPU_AFFINITY": "[2, 3]",
        "KVOFFLOAD_SERVICE__LOG_LEVEL": "debug",
        "KVOFFLOAD_SERVICE__RUNTIME_DIR": "/run/kv",
        "KVOFFLOAD_POOL__LAYOUT_ID": "1234",
        "kvoffload_object__prefix": '"quoted"',
        "KVOFFLOAD_ENDPOINT": "left to the client",
    }
    cfg = load_config(path, env=env)
    assert cfg.pool.num_slots == 128
    assert cfg.disk.enabled is False
    assert cfg.service.heartbeat_timeout_s == 7.0
    assert cfg.object.cpu_affinity == (2, 3)
    assert cfg.service.log_level == "debug"
    assert cfg.service.runtime_dir == "/run/kv"
    assert cfg.pool.layout_id == "1234"
    assert cfg.object.prefix == "quoted"


def test_unknown_key_in_file_is_named(tmp_path: Path) -> None:
    path = _write(tmp_path, "[pool]\nnum_slotz = 3\n")
    with pytest.raises(ConfigError, match="pool.num_slotz") as err:
        load_config(path, env={})
    assert err.value.key == "pool.num_slotz"
    assert err.value.source == str(path)


def test_unknown_section_in_file_is_named(tmp_path: Path) -> None:
    path = _write(tmp_path, "[poool]\nnum_slots = 3\n")
    with pytest.raises(ConfigError, match="poool") as err:
        load_config(path, env={})
    assert err.value.source == str(path)


def test_unknown_key_in_engines_is_named(tmp_path: Path) -> None:
    path = _write(tmp_path, '[[engines]]\ncommand = ["x"]\ncwd = "/"\n')
    with pytest.raises(ConfigError, match="cwd") as err:
        load_config(path, env={})
    assert err.value.key == "engines[0].cwd"
    assert err.value.source == str(path)


def test_unknown_env_key_is_named() -> None:
    with pytest.raises(ConfigError, match="KVOFFLOAD_DISK__ROOTS") as err:
        load_config(env={"KVOFFLOAD_DISK__ROOTS": "/x"})
    assert err.value.key == "disk.roots"
    with pytest.raises(ConfigError, match="KVOFFLOAD_NOPE__X"):
        load_config(env={"KVOFFLOAD_NOPE__X": "1"})
    with pytest.raises(ConfigError, match="engines"):
        load_config(env={"KVOFFLOAD_ENGINES__COMMAND": "[]"})


def test_wrong_type_in_file_names_key_and_file(tmp_path: Path) -> None:
    path = _write(tmp_path, '[pool]\nnum_slots = "many"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    message = str(err.value)
    assert "pool.num_slots" in message and str(path) in message and "Expected `int`" in message
    assert (err.value.key, err.value.source) == ("pool.num_slots", str(path))


def test_wrong_type_in_env_names_key_and_variable(tmp_path: Path) -> None:
    path = _write(tmp_path, "[pool]\nnum_slots = 64\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, env={"KVOFFLOAD_POOL__NUM_SLOTS": "lots"})
    assert (err.value.key, err.value.source) == ("pool.num_slots", "KVOFFLOAD_POOL__NUM_SLOTS")
    assert "KVOFFLOAD_POOL__NUM_SLOTS" in str(err.value)


def test_wrong_type_in_engines(tmp_path: Path) -> None:
    path = _write(tmp_path, "[[engines]]\ncommand = [1]\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert (err.value.key, err.value.source) == ("engines[0].command", str(path))


def test_invalid_toml_and_missing_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[pool\n")
    with pytest.raises(ConfigError, match="invalid TOML") as err:
        load_config(path, env={})
    assert err.value.source == str(path)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.toml", env={})


@pytest.mark.parametrize(
    ("env", "key"),
    [
        ({"KVOFFLOAD_POOL__BLOCK_BYTES": "5000"}, "pool.block_bytes"),
        ({"KVOFFLOAD_POOL__BLOCK_BYTES": "0"}, "pool.block_bytes"),
        ({"KVOFFLOAD_POOL__NUM_SLOTS": "0"}, "pool.num_slots"),
        ({"KVOFFLOAD_POOL__EVICTION_POLICY": "fifo"}, "pool.eviction_policy"),
        ({"KVOFFLOAD_POOL__UNREAD_PROMOTION_CAP": "1.5"}, "pool.unread_promotion_cap"),
        ({"KVOFFLOAD_POOL__KEY_BYTES_MAX": "65"}, "pool.key_bytes_max"),
        ({"KVOFFLOAD_POOL__KEY_BYTES_MIN": "80"}, "pool.key_bytes_min"),
        ({"KVOFFLOAD_DISK__DURABILITY": "sometimes"}, "disk.durability"),
        ({"KVOFFLOAD_DISK__CAPACITY_BYTES": "4096"}, "disk.capacity_bytes"),
        ({"KVOFFLOAD_DISK__READ_THREADS": "0"}, "disk.read_threads"),
        ({"KVOFFLOAD_OBJECT__ENABLED": "true"}, "object.endpoint"),
        ({"KVOFFLOAD_OBJECT__REQUEST_TIMEOUT_S": "0"}, "object.request_timeout_s"),
        ({"KVOFFLOAD_OBJECT__MAX_RETRIES": "-1"}, "object.max_retries"),
        ({"KVOFFLOAD_OBJECT__BREAKER_FAILURE_THRESHOLD": "0"}, "object.breaker_failure_threshold"),
        ({"KVOFFLOAD_OBJECT__BREAKER_COOLDOWN_S": "0"}, "object.breaker_cooldown_s"),
        ({"KVOFFLOAD_OBJECT__BREAKER_MAX_COOLDOWN_S": "0.5"}, "object.breaker_max_cooldown_s"),
        ({"KVOFFLOAD_SUPERVISOR__STOP_GRACE_S": "0"}, "supervisor.stop_grace_s"),
        ({"KVOFFLOAD_SERVICE__HEARTBEAT_INTERVAL_S": "-0.5"}, "service.heartbeat_interval_s"),
        ({"KVOFFLOAD_SERVICE__HEARTBEAT_TIMEOUT_S": "0.4"}, "service.heartbeat_timeout_s"),
        ({"KVOFFLOAD_SERVICE__REQUEST_LEASE_S": "0"}, "service.request_lease_s"),
        ({"KVOFFLOAD_SERVICE__LOG_LEVEL": "loud"}, "service.log_level"),
        ({"KVOFFLOAD_SERVICE__METRICS_PORT": "70000"}, "service.metrics_port"),
        ({"KVOFFLOAD_SERVICE__CLIENT_ENDPOINT": "udp://x"}, "service.client_endpoint"),
        (
            {"KVOFFLOAD_SERVICE__CLIENT_ENDPOINT": "tcp://0.0.0.0:5555"},
            "service.curve_server_secret_file",
        ),
        (
            {"KVOFFLOAD_SUPERVISOR__RESTART_BACKOFF_MAX_S": "0.1"},
            "supervisor.restart_backoff_max_s",
        ),
        ({"KVOFFLOAD_CPU__THREADS": "-1"}, "cpu.threads"),
        ({"KVOFFLOAD_CPU__CPU_AFFINITY": "[-1]"}, "cpu.cpu_affinity"),
        ({"KVOFFLOAD_FAULTS__FAIL_FRACTION": "2"}, "faults.fail_fraction"),
        ({"KVOFFLOAD_FAULTS__DELAY_S": "-1"}, "faults.delay_s"),
    ],
)
def test_semantic_checks_name_key_and_source(env: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(env=env)
    assert err.value.key == key
    assert f"`{key}`" in str(err.value)
    var = next(iter(env))
    key_of_var = var[len("KVOFFLOAD_") :].lower().replace("__", ".")
    assert err.value.source == (var if key == key_of_var else "defaults")


def test_object_breaker_thresholds_and_stop_grace_are_settable(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "[object]\nbreaker_failure_threshold = 2\nbreaker_cooldown_s = 0.5\n"
        "[supervisor]\nstop_grace_s = 1.5\n",
    )
    cfg = load_config(path, env={"KVOFFLOAD_OBJECT__BREAKER_MAX_COOLDOWN_S": "4"})
    obj = cfg.object
    assert (obj.breaker_failure_threshold, obj.breaker_cooldown_s, obj.breaker_max_cooldown_s) == (
        2,
        0.5,
        4.0,
    )
    assert cfg.supervisor.stop_grace_s == 1.5


def test_semantic_check_from_file_names_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[pool]\nblock_bytes = 1000\n")
    with pytest.raises(ConfigError, match="multiple of 4096") as err:
        load_config(path, env={})
    assert (err.value.key, err.value.source) == ("pool.block_bytes", str(path))


def test_empty_engine_command(tmp_path: Path) -> None:
    path = _write(tmp_path, "[[engines]]\ncommand = []\n")
    with pytest.raises(ConfigError, match="engines\\[0\\].command"):
        load_config(path, env={})


def test_tcp_endpoint_with_curve_files(tmp_path: Path) -> None:
    secret = tmp_path / "server.key_secret"
    secret.write_text("x")
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    env = {
        "KVOFFLOAD_SERVICE__CLIENT_ENDPOINT": "tcp://127.0.0.1:5555",
        "KVOFFLOAD_SERVICE__CURVE_SERVER_SECRET_FILE": str(secret),
    }
    with pytest.raises(ConfigError, match="curve_authorized_dir"):
        load_config(env=env)
    env["KVOFFLOAD_SERVICE__CURVE_AUTHORIZED_DIR"] = str(authorized)
    assert load_config(env=env).service.client_endpoint == "tcp://127.0.0.1:5555"


def test_object_credentials_from_aws_env() -> None:
    env = {
        "KVOFFLOAD_OBJECT__ENABLED": "true",
        "KVOFFLOAD_OBJECT__ENDPOINT": "http://127.0.0.1:9000",
        "AWS_ACCESS_KEY_ID": "AKID",
        "AWS_SECRET_ACCESS_KEY": "SECRET",
    }
    cfg = load_config(env=env)
    assert (cfg.object.access_key_id, cfg.object.secret_access_key) == ("AKID", "SECRET")
    assert cfg.to_toml_dict()["object"]["secret_access_key"] == "***"
    assert cfg.to_toml_dict(redact_secrets=False)["object"]["secret_access_key"] == "SECRET"
    env["KVOFFLOAD_OBJECT__ACCESS_KEY_ID"] = "EXPLICIT"
    assert load_config(env=env).object.access_key_id == "EXPLICIT"


def test_config_is_frozen() -> None:
    cfg = load_config(env={})
    with pytest.raises(AttributeError):
        cfg.pool.num_slots = 3  # type: ignore[misc]


def test_to_toml_dict_round_trips() -> None:
    cfg = load_config(env={"KVOFFLOAD_CPU__CPU_AFFINITY": "[1]"})
    data = cfg.to_toml_dict(redact_secrets=False)
    assert data["cpu"]["cpu_affinity"] == [1]
    assert msgspec.convert(data, Config) == cfg


def test_resolve_runtime_dir() -> None:
    defaults = load_config(env={})
    xdg = {"XDG_RUNTIME_DIR": "/run/user/5"}
    assert resolve_runtime_dir(defaults, env=xdg) == Path("/run/user/5/kvoffload")
    assert resolve_runtime_dir(defaults, env={}) == Path(f"/tmp/kvoffload-{os.getuid()}")
    cfg = load_config(env={"KVOFFLOAD_SERVICE__RUNTIME_DIR": "/srv/kv"})
    assert resolve_runtime_dir(cfg, env=xdg) == Path("/srv/kv")


def test_a_mistyped_override_is_refused_naming_the_setting_meant(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(None, env={"KVOFFLOAD_POOL_NUM_SLOTS": "128"})
    assert "did you mean KVOFFLOAD_POOL__NUM_SLOTS?" in str(refused.value)
    assert "KVOFFLOAD_POOL_NUM_SLOTS" in str(refused.value)
    with pytest.raises(ConfigError) as unknown:
        load_config(None, env={"KVOFFLOAD_CONFIG": "kvoffload.toml"})
    assert "not a setting" in str(unknown.value)
