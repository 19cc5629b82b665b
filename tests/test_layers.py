"""The dependency rules of the architecture (docs/design/architecture.md), checked on the
imports of every module, lazy ones included: a forbidden import fails here."""

from __future__ import annotations

import ast
import shutil
from dataclasses import dataclass
from pathlib import Path

from kvoffload.testing.helpers import REPO_ROOT


@dataclass(frozen=True)
class Rule:
    """Modules under ``importer`` (a dotted prefix), except those under ``exempt``, may not
    import modules under a ``forbidden`` prefix, except those also under ``allowed``."""

    importer: str
    forbidden: tuple[str, ...]
    why: str
    allowed: tuple[str, ...] = ()
    exempt: tuple[str, ...] = ()


RULES = (
    Rule(
        "kvoffload.tiering",
        ("zmq", "socket", "threading", "multiprocessing", "subprocess", "kvoffload"),
        "the tiering library is bookkeeping: no sockets, threads, processes, protocol or pool",
        allowed=(
            "kvoffload.tiering",
            "kvoffload.wire.vocab",
            "kvoffload.wire.status",
            "kvoffload.wire.events",
            "kvoffload.wire.tenant_ids",
            "kvoffload.logs",
        ),
    ),
    Rule(
        "kvoffload.wire",
        ("kvoffload", "zmq"),
        "the wire is a leaf everyone may import",
        allowed=("kvoffload.wire",),
    ),
    Rule(
        "kvoffload.wire.tenant_ids",
        ("msgspec", "numpy", "xxhash", "kvoffload.wire.protocol"),
        "tenant ids are the standard library only: the tiering library and the client import them",
    ),
    Rule(
        "kvoffload.server",
        (
            "kvoffload.memory.pool",
            "kvoffload.memory.slotcopy",
            "kvoffload.memory.cudacopy",
            "kvoffload.client",
            "kvoffload.integrations",
            "kvoffload.runtime.supervisor",
            "workers",
        ),
        "the manager wraps the tiering library with sockets; it never maps the pool's bytes",
    ),
    Rule(
        "workers",
        ("kvoffload.server", "kvoffload.tiering", "kvoffload.runtime.supervisor"),
        "workers talk to the manager only by messages",
    ),
    Rule(
        "workers",
        ("kvoffload.client",),
        "workers talk to the manager on the job channel; only the peer worker, which serves "
        "other nodes' fetches as a client of its own manager, uses the client",
        exempt=("workers.peer",),
    ),
    Rule(
        "kvoffload.client",
        ("kvoffload.server", "kvoffload.tiering", "workers"),
        "clients talk to the manager only by messages",
    ),
    Rule(
        "kvoffload.integrations",
        ("kvoffload.server", "kvoffload.tiering", "workers", "kvoffload.runtime.supervisor"),
        "engine integrations use the client and the pool, never the manager or the tiering",
    ),
    Rule(
        "kvoffload",
        ("kvoffload.testing", "tests"),
        "the test harnesses are imported by tests, the soak and the benchmarks only",
        exempt=("kvoffload.testing", "kvoffload.soak", "kvoffload.bench"),
    ),
    Rule("workers", ("kvoffload.testing", "tests"), "workers never import the test harnesses"),
)


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file; ``from a import b`` gives ``a.b``, so
    ``from kvoffload import server`` is seen as importing the server."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import"
            assert node.module is not None
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def violations(root: Path) -> list[str]:
    out = []
    for package in ("kvoffload", "workers"):
        for path in sorted((root / package).rglob("*.py")):
            importer = module_name(root, path)
            for line, imported in imports_of(path):
                for rule in RULES:
                    if not _under(importer, rule.importer):
                        continue
                    if any(_under(importer, e) for e in rule.exempt):
                        continue
                    forbidden = any(_under(imported, f) for f in rule.forbidden)
                    if forbidden and not any(_under(imported, a) for a in rule.allowed):
                        where = path.relative_to(root)
                        out.append(f"{where}:{line} imports {imported}: {rule.why}")
    return out


def test_the_tree_keeps_the_dependency_rules():
    assert violations(REPO_ROOT) == []


def test_a_planted_forbidden_import_is_caught(tmp_path: Path):
    for package in ("kvoffload", "workers"):
        shutil.copytree(REPO_ROOT / package, tmp_path / package)
    ledger = tmp_path / "kvoffload" / "tiering" / "ledger.py"
    ledger.write_text(
        ledger.read_text() + "\n\ndef _late():\n    from kvoffload.server import loop\n"
    )
    client = tmp_path / "kvoffload" / "client.py"
    client.write_text("from kvoffload.testing.helpers import wait_until\n" + client.read_text())

    found = violations(tmp_path)

    assert any("tiering/ledger.py" in v and "kvoffload.server" in v for v in found)
    assert any("client.py:1 imports kvoffload.testing" in v for v in found)
    assert len(found) == 2


def module_graph(root: Path) -> dict[str, set[str]]:
    """Every module of the tree and the modules of the tree it imports, lazy and type-only
    imports included (``from a import b`` is module ``a.b`` when that is a module, else
    ``a``). A package is its ``__init__``."""
    paths = {
        module_name(root, path): path
        for package in ("kvoffload", "workers")
        for path in sorted((root / package).rglob("*.py"))
    }
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        targets = set()
        for _, imported in imports_of(path):
            while imported and imported not in paths:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_no_module_is_in_an_import_circle():
    assert import_circles(module_graph(REPO_ROOT)) == []


def test_a_planted_circle_is_caught_even_when_type_only(tmp_path: Path):
    for package in ("kvoffload", "workers"):
        shutil.copytree(REPO_ROOT / package, tmp_path / package)
    primary = tmp_path / "kvoffload" / "tiering" / "primary.py"
    primary.write_text(
        primary.read_text()
        + "\n\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
        + "    from kvoffload.tiering.ledger import TieringLedger\n"
    )

    circles = import_circles(module_graph(tmp_path))

    assert any({"kvoffload.tiering.primary", "kvoffload.tiering.ledger"} <= set(c) for c in circles)
