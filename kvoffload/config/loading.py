"""Typed configuration: defaults, then one TOML file, then ``KVOFFLOAD_*`` environment overrides.

Every key has a default, so no file is needed. An override variable is named
``KVOFFLOAD_<SECTION>__<KEY>`` (double underscore between section and key, case-insensitive;
``[tenants]`` entries: ``KVOFFLOAD_TENANTS__<NAME>__<KEY>``, see ``kvoffload.config.tenants``);
its value is read as a TOML value (``8``, ``true``, ``[0, 1]``, ``"text"``), falling back to the
raw text. For string keys the raw text is used unless it is a quoted TOML string. ``[[engines]]``
can only be set in the file. Any other ``KVOFFLOAD_*`` variable is refused, naming the closest
setting, unless it is one of ``OTHER_VARIABLES``. Empty ``object.access_key_id`` / ``object.secret_access_key`` are
taken from ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``.

Every error is a ``ConfigError`` naming the key and where its value came from.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
import typing
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any

import msgspec

from kvoffload.config import tenants as tenant_settings
from kvoffload.config.sections import SECTIONS, Config
from kvoffload.memory.blockformat import disk_record_bytes

ENV_PREFIX = "KVOFFLOAD_"
OTHER_VARIABLES = frozenset(
    {
        "KVOFFLOAD_ENDPOINT",  # a client's endpoint (runtime.discovery)
        "KVOFFLOAD_FATAL_REASON_FILE",  # set by the supervisor for its children
        "KVOFFLOAD_TENANT_KEY_FILE",  # the key of tenant ids (wire.tenant_ids)
        "KVOFFLOAD_VLLM033_DIR",  # the test suite's copy of vLLM 0.33's files
    }
)
"""``KVOFFLOAD_*`` variables that are not settings and are left to whoever reads them."""
DEFAULTS_SOURCE = "defaults"


class ConfigError(ValueError):
    """Invalid configuration. ``key`` is the dotted key (or None for the file as a whole),
    ``source`` the file path, the environment variable, or ``"defaults"``."""

    def __init__(self, message: str, key: str | None = None, source: str | None = None) -> None:
        where = ["config"]
        if key:
            where.append(f"key `{key}`")
        if source:
            where.append(f"(from {source})")
        super().__init__(f"{' '.join(where)}: {message}")
        self.key = key
        self.source = source


_PATH_IN_ERROR = re.compile(r" - at `\$([^`]*)`$")


def _read_file(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError("file not found", source=str(path)) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"invalid TOML: {exc}", source=str(path)) from None
    except OSError as exc:
        raise ConfigError(f"cannot read file: {exc}", source=str(path)) from None


def _check_file_keys(data: dict[str, Any], source: str, sources: dict[str, str]) -> None:
    """Reject unknown sections and keys; record ``source`` for every section and key set."""
    for section, table in data.items():
        sources[section] = source
        if section == "engines":
            continue
        if section == "tenants":
            tenant_settings.check_file_table(table, source, sources, _raise)
            continue
        cls = SECTIONS.get(section)
        if cls is None:
            raise ConfigError(
                f"unknown section; expected one of {sorted([*SECTIONS, 'engines', 'tenants'])}",
                key=section,
                source=source,
            )
        if not isinstance(table, dict):
            continue
        known = set(cls.__struct_fields__)
        for key in table:
            sources[f"{section}.{key}"] = source
            if key not in known:
                raise ConfigError(
                    f"unknown key; [{section}] has {sorted(known)}",
                    key=f"{section}.{key}",
                    source=source,
                )


def _raise(key: str, message: str, source: str | None) -> None:
    raise ConfigError(message, key, source)


def _parse_env_value(raw: str, field_type: Any) -> Any:
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
    if typing.get_origin(field_type) is Annotated:
        field_type = typing.get_args(field_type)[0]
    if field_type is str and not isinstance(value, str):
        return raw
    return value


def _apply_env(data: dict[str, Any], sources: dict[str, str], env: Mapping[str, str]) -> None:
    """Apply ``KVOFFLOAD_<SECTION>__<KEY>`` overrides to ``data`` in place; a variable with
    the prefix that is neither a setting's nor in ``OTHER_VARIABLES`` is refused."""
    for var in sorted(env):
        if not var.upper().startswith(ENV_PREFIX) or var.upper() in OTHER_VARIABLES:
            continue
        if "__" not in var:
            raise ConfigError(f"not a setting; {_closest(var)}", var.lower(), var)
        section, _, key = var[len(ENV_PREFIX) :].lower().partition("__")
        dotted = f"{section}.{key}"
        if section == "engines":
            raise ConfigError("[[engines]] can only be set in the config file", dotted, var)
        if section == "tenants":
            raw = _parse_env_value(env[var], Any)
            tenant_settings.apply_env(data, key, raw, var, sources, _raise)
            continue
        cls = SECTIONS.get(section)
        if cls is None:
            raise ConfigError(f"unknown section; expected one of {sorted(SECTIONS)}", dotted, var)
        fields = {f.name: f for f in msgspec.structs.fields(cls)}
        if key not in fields:
            raise ConfigError(f"unknown key; [{section}] has {sorted(fields)}", dotted, var)
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError("is not a table in the config file", section, sources.get(section))
        table[key] = _parse_env_value(env[var], fields[key].type)
        sources[dotted] = var


def _is_http_url(text: str) -> bool:
    """``http(s)://host[:port][/path]`` with nothing a URL cannot hold."""
    try:
        url = urllib.parse.urlsplit(text)
        url.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        return False
    printable = text.isprintable() and not any(c.isspace() for c in text)
    return url.scheme in ("http", "https") and bool(url.hostname) and printable


def _closest(var: str) -> str:
    """Names the setting variable nearest to ``var`` (a mistyped one)."""
    known = [
        f"{ENV_PREFIX}{section.upper()}__{f.name.upper()}"
        for section, cls in SECTIONS.items()
        for f in msgspec.structs.fields(cls)
    ]
    near = difflib.get_close_matches(var.upper(), [*known, *OTHER_VARIABLES], n=1, cutoff=0.6)
    if near:
        return f"did you mean {near[0]}?"
    return f"settings are {ENV_PREFIX}<SECTION>__<KEY> (double underscore)"


def _key_from_error_path(path: str) -> str:
    """``.pool.num_slots`` -> ``pool.num_slots``; ``.engines[0].command[1]`` ->
    ``engines[0].command``."""
    parts = re.findall(r"\.([A-Za-z_][A-Za-z0-9_]*)(\[\d+\])?", path)
    if not parts:
        return "(root)"
    (section, index), rest = parts[0], parts[1:2]
    return ".".join([f"{section}{index}", *(name for name, _ in rest)])


def _source_of(key: str, sources: Mapping[str, str]) -> str:
    """Where ``key`` was set: the env variable or the file that set it (a whole section such as
    ``engines`` counts for its entries), else the defaults."""
    section, _, rest = key.partition(".")
    section = section.split("[")[0]
    plain = f"{section}.{rest.split('[')[0]}" if rest else section
    whole_section = sources.get(section) if section == "engines" or not rest else None
    if section == "tenants" and "." in rest:  # a field of an entry: else where the entry is
        whole_section = sources.get(f"tenants.{rest.rsplit('.', 1)[0]}")
    return sources.get(plain) or whole_section or DEFAULTS_SOURCE


def _convert(data: dict[str, Any], sources: Mapping[str, str]) -> Config:
    try:
        return msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = _PATH_IN_ERROR.search(message)
        key = _key_from_error_path(match.group(1)) if match else "(root)"
        unknown = re.match(r"Object contains unknown field `([^`]+)`", message)
        if unknown:
            key = f"{key}.{unknown.group(1)}"
        raise ConfigError(message, key, _source_of(key, sources)) from None


def _with_aws_credentials(cfg: Config, env: Mapping[str, str]) -> Config:
    obj = cfg.object
    changes = {}
    if not obj.access_key_id and env.get("AWS_ACCESS_KEY_ID"):
        changes["access_key_id"] = env["AWS_ACCESS_KEY_ID"]
    if not obj.secret_access_key and env.get("AWS_SECRET_ACCESS_KEY"):
        changes["secret_access_key"] = env["AWS_SECRET_ACCESS_KEY"]
    if not changes:
        return cfg
    return msgspec.structs.replace(cfg, object=msgspec.structs.replace(obj, **changes))


def _validate(cfg: Config, sources: Mapping[str, str]) -> None:
    """The checks that span fields or look outside the config (single-field constraints are
    the types' ``Meta``)."""

    def fail(key: str, message: str) -> None:
        raise ConfigError(message, key, _source_of(key, sources))

    svc = cfg.service
    if svc.log_level.lower() not in {"debug", "info", "warning", "error", "critical"}:
        fail(
            "service.log_level",
            f"must be debug, info, warning, error or critical, got {svc.log_level!r}",
        )
    if svc.client_endpoint and not svc.client_endpoint.startswith(("ipc://", "tcp://")):
        fail(
            "service.client_endpoint",
            f"must start with ipc:// or tcp://, got {svc.client_endpoint!r}",
        )
    if svc.client_endpoint.startswith("tcp://"):
        if not svc.curve_server_secret_file or not Path(svc.curve_server_secret_file).is_file():
            fail(
                "service.curve_server_secret_file",
                "a tcp:// client_endpoint needs an existing CURVE server secret key file, got "
                f"{svc.curve_server_secret_file!r}",
            )
        if not svc.curve_authorized_dir or not Path(svc.curve_authorized_dir).is_dir():
            fail(
                "service.curve_authorized_dir",
                "a tcp:// client_endpoint needs an existing directory of authorized client "
                f"public keys, got {svc.curve_authorized_dir!r}",
            )
    if svc.heartbeat_timeout_s <= svc.heartbeat_interval_s:
        fail(
            "service.heartbeat_timeout_s",
            f"must exceed service.heartbeat_interval_s ({svc.heartbeat_interval_s}), "
            f"got {svc.heartbeat_timeout_s}",
        )

    pool = cfg.pool
    if pool.key_bytes_min > pool.key_bytes_max:
        fail(
            "pool.key_bytes_min",
            f"must be within [1, pool.key_bytes_max={pool.key_bytes_max}], "
            f"got {pool.key_bytes_min}",
        )

    disk = cfg.disk
    if disk.enabled:
        if not disk.root:
            fail("disk.root", "must not be empty when disk.enabled")
        if disk.capacity_bytes < disk_record_bytes(pool.block_bytes):
            fail(
                "disk.capacity_bytes",
                f"must hold one record (pool.block_bytes + a 4096-byte header = "
                f"{disk_record_bytes(pool.block_bytes)}), got {disk.capacity_bytes}",
            )

    obj = cfg.object
    if obj.enabled:
        if not obj.endpoint:
            fail("object.endpoint", "must be set when object.enabled is true")
        if not _is_http_url(obj.endpoint):
            fail("object.endpoint", f"must be an http:// or https:// URL, got {obj.endpoint!r}")
        if not obj.bucket:
            fail("object.bucket", "must be set when object.enabled is true")
    if obj.breaker_max_cooldown_s < obj.breaker_cooldown_s:
        fail(
            "object.breaker_max_cooldown_s",
            f"must be >= object.breaker_cooldown_s ({obj.breaker_cooldown_s}), "
            f"got {obj.breaker_max_cooldown_s}",
        )

    _validate_peer(cfg, fail)

    sup = cfg.supervisor
    if sup.restart_backoff_max_s < sup.restart_backoff_initial_s:
        fail(
            "supervisor.restart_backoff_max_s",
            f"must be >= supervisor.restart_backoff_initial_s ({sup.restart_backoff_initial_s}), "
            f"got {sup.restart_backoff_max_s}",
        )

    for i, engine in enumerate(cfg.engines):
        if not engine.command or not engine.command[0]:
            fail(f"engines[{i}].command", "must name a program")

    disk_bytes = cfg.disk.capacity_bytes if cfg.disk.enabled else None
    tenant_settings.validate(cfg.tenants, pool.num_slots, disk_bytes, fail)


def _validate_peer(cfg: Config, fail: Callable[[str, str], None]) -> None:
    """``[peer]``: endpoints on tcp:// only (nodes meet over the network, with CURVE), the key
    files they need, distinct node names."""
    peer, svc = cfg.peer, cfg.service
    if bool(peer.fetch_endpoint) != bool(peer.bulk_endpoint):
        fail("peer.bulk_endpoint", "peer.fetch_endpoint and peer.bulk_endpoint go together")
    if peer.fetch_endpoint:
        for key in ("fetch_endpoint", "bulk_endpoint"):
            endpoint = getattr(peer, key)
            if not endpoint.startswith("tcp://"):
                fail(f"peer.{key}", f"must start with tcp://, got {endpoint!r}")
        if not svc.curve_server_secret_file or not Path(svc.curve_server_secret_file).is_file():
            fail(
                "service.curve_server_secret_file",
                "peer.fetch_endpoint needs an existing CURVE server secret key file, got "
                f"{svc.curve_server_secret_file!r}",
            )
        if not svc.curve_authorized_dir or not Path(svc.curve_authorized_dir).is_dir():
            fail(
                "service.curve_authorized_dir",
                "peer.fetch_endpoint needs an existing directory of the following nodes' "
                f"public keys, got {svc.curve_authorized_dir!r}",
            )
    if peer.nodes and not Path(peer.curve_client_secret_file or "/nonexistent").is_file():
        fail(
            "peer.curve_client_secret_file",
            "peer.nodes needs this node's existing CURVE key pair file, got "
            f"{peer.curve_client_secret_file!r}",
        )
    names: set[str] = set()
    for i, node in enumerate(peer.nodes):
        if node.name in names:
            fail(f"peer.nodes[{i}].name", f"names another node already: {node.name!r}")
        names.add(node.name)
        for field in ("events_endpoint", "replay_endpoint", "fetch_endpoint", "bulk_endpoint"):
            endpoint = getattr(node, field)
            if not endpoint.startswith("tcp://"):
                fail(f"peer.nodes[{i}].{field}", f"must start with tcp://, got {endpoint!r}")
        if not Path(node.server_key_file or "/nonexistent").is_file():
            fail(
                f"peer.nodes[{i}].server_key_file",
                f"must name the node's existing CURVE public key file, got "
                f"{node.server_key_file!r}",
            )
    if peer.breaker_max_cooldown_s < peer.breaker_cooldown_s:
        fail(
            "peer.breaker_max_cooldown_s",
            f"must be >= peer.breaker_cooldown_s ({peer.breaker_cooldown_s}), "
            f"got {peer.breaker_max_cooldown_s}",
        )


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Defaults, overlaid by the TOML file at ``path`` (None: no file), overlaid by ``env``
    (None: ``os.environ``), then validated. Raises ConfigError."""
    environ = os.environ if env is None else env
    data: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if path is not None:
        data = _read_file(Path(path))
        _check_file_keys(data, str(path), sources)
    _apply_env(data, sources, environ)
    tenant_settings.check_entries(
        data.get("tenants"),
        lambda key, message: _raise(key, message, _source_of(key, sources)),
    )
    cfg = _convert(data, sources)
    cfg = _with_aws_credentials(cfg, environ)
    _validate(cfg, sources)
    return cfg


def resolve_runtime_dir(cfg: Config, env: Mapping[str, str] | None = None) -> Path:
    """``service.runtime_dir`` when set, else ``$XDG_RUNTIME_DIR/kvoffload``, else
    ``/tmp/kvoffload-<uid>``."""
    if cfg.service.runtime_dir:
        return Path(cfg.service.runtime_dir)
    environ = os.environ if env is None else env
    xdg = environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "kvoffload"
    return Path(f"/tmp/kvoffload-{os.getuid()}")
