"""Structured logging: one JSON object per line, with ``proc`` and ``pid`` on every event.

Each process of the service calls ``configure_logging`` once at start-up (after a fork, again
if the process name changes; the pid is read at log time either way). Modules obtain loggers
with ``get_logger``, which stays lazy, so module-level loggers created before
``configure_logging`` still follow the configuration in force when they log.

Used as a library (the client in an engine's process), kvoffload logs nothing by itself: while
structlog is not configured (by ``configure_logging`` or by the application), events go to the
standard library logger ``kvoffload`` (one JSON object as the message), which has only a
``NullHandler``; an application that configures ``logging`` sees them at the levels it enables.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, TextIO

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

LIBRARY_LOGGER = "kvoffload"
_library_logger = logging.getLogger(LIBRARY_LOGGER)
_library_logger.addHandler(logging.NullHandler())


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


class _LogStream:
    """A log stream that, once its reader is gone (a closed pipe), drops what is written instead
    of raising: a process of the service keeps running when the collector of its logs goes
    away (``kvoffload serve 2>&1 | head``, a restarted log daemon)."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self.reader_gone = False

    def write(self, text: str) -> int:
        if not self.reader_gone:
            try:
                self._out.write(text)
            except BrokenPipeError:
                self._gone()
        return len(text)

    def flush(self) -> None:
        if not self.reader_gone:
            try:
                self._out.flush()
            except BrokenPipeError:
                self._gone()

    def _gone(self) -> None:
        """From now on write nothing; the stream's file descriptor is pointed at /dev/null, so
        the interpreter's own last flush at exit does not fail either."""
        self.reader_gone = True
        try:
            fd = self._out.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)
        except (OSError, ValueError):
            pass


def configure_logging(proc: str, level: str = "info", stream: TextIO | None = None) -> None:
    """Send structlog and stdlib ``logging`` events to ``stream`` (default: ``sys.stderr``) as
    JSON lines, dropping events below ``level``. Calling it again replaces the configuration.
    When the stream's reader goes away (a closed pipe), events are dropped, never raised."""
    min_level = level_number(level)
    out: Any = _LogStream(stream if stream is not None else sys.stderr)
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


class _LazyLogger:
    """Resolved at first use and again whenever the logging configuration changed: structlog
    once it is configured (by ``configure_logging`` or the application), else the stdlib logger
    ``kvoffload`` (silent unless ``logging`` is configured). The resolved logger is kept, so a
    call costs one look at the configuration, not a logger built per event."""

    __slots__ = ("_context", "_resolved", "_resolved_for")

    def __init__(self, context: dict[str, Any]) -> None:
        self._context = context
        self._resolved: Any = None
        self._resolved_for: tuple[Any, ...] | None = None

    def bind(self, **values: Any) -> _LazyLogger:
        return _LazyLogger({**self._context, **values})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger(), name)

    def _logger(self) -> Any:
        config = _configuration()
        cached = self._resolved_for
        if cached is None or any(a is not b for a, b in zip(cached, config, strict=True)):
            self._resolved = _resolve(self._context, configured=config[0] is not None)
            self._resolved_for = config
        return self._resolved


def _configuration() -> tuple[Any, ...]:
    """The objects a resolved logger depends on (compared by identity): structlog's processor
    list, wrapper class and logger factory, or Nones while structlog is not configured."""
    if not structlog.is_configured():
        return (None, None, None)
    config = structlog.get_config()
    return (config["processors"], config["wrapper_class"], config["logger_factory"])


def _resolve(context: dict[str, Any], configured: bool) -> Any:
    if configured:
        return structlog.get_logger().bind(**context)
    return structlog.wrap_logger(
        _library_logger,
        processors=_LIBRARY_PROCESSORS,
        wrapper_class=structlog.stdlib.BoundLogger,
        **context,
    )


_render_json = structlog.processors.JSONRenderer(serializer=_json_serializer())


def _to_stdlib_call(
    logger: WrappedLogger, method: str, event_dict: EventDict
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The event as one JSON message; ``exc_info`` is left to the stdlib logger."""
    exc_info = event_dict.pop("exc_info", None)
    message = _render_json(logger, method, event_dict)
    return (message,), ({"exc_info": exc_info} if exc_info else {})


_LIBRARY_PROCESSORS: list[Processor] = [
    structlog.stdlib.filter_by_level,
    structlog.contextvars.merge_contextvars,
    _to_stdlib_call,
]


def get_logger(**bind: Any) -> Any:
    """A lazy logger with ``bind`` as initial context (e.g. ``tier="disk"``)."""
    return _LazyLogger(bind)
