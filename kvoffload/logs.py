"""Structured logging: one JSON object per line, with ``proc`` and ``pid`` on every event.

Each process calls ``configure_logging`` once at start-up (after a fork, again if the process
name changes; the pid is read at log time either way). Modules obtain loggers with
``get_logger``, which stays lazy, so module-level loggers created before ``configure_logging``
still follow the configuration in force when they log.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any, Callable, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}

_HANDLER_MARK = "_kvoffload_handler"


def _json_serializer() -> Callable[..., str]:
    """orjson when installed (faster), else the stdlib json module; both produce one line."""
    try:
        import orjson
    except ImportError:
        return lambda obj, **kw: json.dumps(obj, default=str, ensure_ascii=False)

    option = orjson.OPT_NON_STR_KEYS
    return lambda obj, **kw: orjson.dumps(obj, default=str, option=option).decode()


def _add_proc_pid(proc: str) -> Processor:
    def add(logger: WrappedLogger, method: str, event_dict: EventDict) -> EventDict:
        event_dict.setdefault("proc", proc)
        event_dict["pid"] = os.getpid()
        return event_dict

    return add


def level_number(level: str) -> int:
    """Numeric stdlib level of ``level`` (case-insensitive); ValueError for unknown names."""
    try:
        return LEVELS[level.lower()]
    except KeyError:
        raise ValueError(f"unknown log level {level!r}; expected one of {sorted(LEVELS)}") from None


def configure_logging(proc: str, level: str = "info", stream: TextIO | None = None) -> None:
    """Send structlog and stdlib ``logging`` events to ``stream`` (default: ``sys.stderr``) as
    JSON lines, dropping events below ``level``. Calling it again replaces the configuration."""
    min_level = level_number(level)
    out = stream if stream is not None else sys.stderr
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_proc_pid(proc),
    ]
    renderer = structlog.processors.JSONRenderer(serializer=_json_serializer())
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(min_level),
        logger_factory=structlog.WriteLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )

    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    setattr(handler, _HANDLER_MARK, True)
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _HANDLER_MARK, False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(min_level)


def get_logger(**bind: Any) -> Any:
    """A lazy structlog logger with ``bind`` as initial context (e.g. ``tier="disk"``)."""
    return structlog.get_logger(**bind)
