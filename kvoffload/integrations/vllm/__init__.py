"""kvoffload as vLLM's KV offload store, loaded out of tree: ``KVOffloadConnector``
(``kvoffload.integrations.vllm.connector``) selects ``KVOffloadSpec`` (``.spec``), whose
scheduler side is ``KVOffloadManager`` (``.manager``) and whose model-worker side is
``KVOffloadWorker`` (``.worker``). See docs/vllm.md.

This package itself imports nothing of vLLM, so its pure parts (keys, layout, link, settings)
are usable and testable without it."""

from __future__ import annotations

import logging


def integration_logger(module: str) -> logging.Logger:
    """Loggers of the integration live under vLLM's ``vllm`` logger, so their events show in
    vLLM's log, with its level and handlers, inside the engine's processes."""
    return logging.getLogger(f"vllm.kvoffload.{module.rsplit('.', 1)[-1]}")
