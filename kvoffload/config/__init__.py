"""Typed configuration: defaults, then one TOML file, then ``KVOFFLOAD_*`` environment overrides.

- ``sections``: the tables and their defaults (``Config`` and one Struct per section);
- ``tenants``: the ``[tenants]`` table (shares and caps per tenant and tier);
- ``loading``: ``load_config`` (file, environment, validation; every error a ``ConfigError``
  naming the key and where its value came from) and ``resolve_runtime_dir``.

What the rest of kvoffload imports is named here.
"""

from kvoffload.config.loading import (
    DEFAULTS_SOURCE,
    ENV_PREFIX,
    ConfigError,
    load_config,
    resolve_runtime_dir,
)
from kvoffload.config.sections import (
    SECTIONS,
    Config,
    CpuConfig,
    DiskConfig,
    EngineConfig,
    EventsConfig,
    ObjectConfig,
    PeerConfig,
    PeerNodeConfig,
    PoolConfig,
    ServiceConfig,
    SupervisorConfig,
)

__all__ = [
    "DEFAULTS_SOURCE",
    "ENV_PREFIX",
    "SECTIONS",
    "Config",
    "ConfigError",
    "CpuConfig",
    "DiskConfig",
    "EngineConfig",
    "EventsConfig",
    "ObjectConfig",
    "PeerConfig",
    "PeerNodeConfig",
    "PoolConfig",
    "ServiceConfig",
    "SupervisorConfig",
    "load_config",
    "resolve_runtime_dir",
]
