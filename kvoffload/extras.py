"""The optional dependencies (setup.cfg's extras) and how a feature that needs one says so.

A feature behind an extra checks for its modules before it starts work and, when one is
absent, raises ``MissingExtra``: its message names the feature, the missing modules and the
``pip install`` line of the extra.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

EXTRAS: dict[str, tuple[str, ...]] = {
    "bench": ("matplotlib",),
    "engine": ("torch",),
    "object": ("obstore", "boto3"),
    "vllm": ("vllm",),
}
"""The modules each extra provides that kvoffload imports (``rich`` of the bench extra is used
when present, never required)."""


class MissingExtra(ImportError):
    """A feature's optional modules are not installed; ``str()`` says which extra has them."""

    def __init__(self, feature: str, extra: str, missing: Sequence[str]) -> None:
        super().__init__(f"{feature} needs {needs_text(extra, missing)}")
        self.extra = extra
        self.missing = tuple(missing)


def install_line(extra: str) -> str:
    return f"pip install 'kvoffload[{extra}]'"


def needs_text(extra: str, missing: Sequence[str]) -> str:
    """``matplotlib, which is not installed; install the bench extra: pip install ...``."""
    verb = "is" if len(missing) == 1 else "are"
    return (
        f"{', '.join(missing)}, which {verb} not installed; install the {extra} extra: "
        f"{install_line(extra)}"
    )


def missing_modules(modules: Sequence[str]) -> list[str]:
    """The ones of ``modules`` that cannot be imported here."""
    absent = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            absent.append(name)
    return absent


def missing_extra(extra: str, modules: Sequence[str] | None = None) -> str | None:
    """None when the modules of ``extra`` (or the given subset) are importable, else the
    ``needs_text`` of the missing ones."""
    absent = missing_modules(EXTRAS[extra] if modules is None else modules)
    return needs_text(extra, absent) if absent else None


def require_extra(feature: str, extra: str, modules: Sequence[str] | None = None) -> None:
    """Raise ``MissingExtra`` for ``feature`` when a module of ``extra`` is missing."""
    absent = missing_modules(EXTRAS[extra] if modules is None else modules)
    if absent:
        raise MissingExtra(feature, extra, absent)
