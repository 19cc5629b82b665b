"""The configuration written back as TOML (``kvoffload config show``, test and bench harnesses):
flat tables of scalars, arrays and inline tables; a list of tables becomes an array of tables
(``[[engines]]``). A None value is left out (its key then reads as its default)."""

from __future__ import annotations

from typing import Any


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        inner = ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items() if v is not None)
        return "{ " + inner + " }"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def to_toml(sections: dict[str, Any]) -> str:
    lines: list[str] = []
    for name, table in sections.items():
        for entry in table if isinstance(table, list) else [table]:
            lines.append(f"[[{name}]]" if isinstance(table, list) else f"[{name}]")
            lines.extend(
                f"{key} = {toml_value(value)}" for key, value in entry.items() if value is not None
            )
            lines.append("")
    return "\n".join(lines)
