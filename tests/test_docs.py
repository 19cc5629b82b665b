"""The documentation checks of docs/testing.md: every ```toml block of README.md and docs/ loads as
a kvoffload configuration (``toml fragment`` blocks only parse), and every relative link names a
file that exists, and a heading of it when it has an anchor; the architecture's source tree
names what exists and every package of kvoffload/."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from kvoffload.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
EXAMPLE_CONFIGS = sorted(REPO.glob("*.example.toml"))

FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(?P<text>.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(`+).*?\1")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    info: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def split(path: Path) -> tuple[list[Block], list[tuple[int, str]]]:
    """The fenced blocks of a Markdown file, and its other lines (numbered from 1)."""
    blocks: list[Block] = []
    prose: list[tuple[int, str]] = []
    opening: tuple[int, str, str] | None = None  # line, fence, info
    body: list[str] = []
    indent = ""
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = FENCE.match(line)
        if opening is None:
            if match and not ("`" in match["info"] and match["fence"][0] == "`"):
                opening = (number, match["fence"], match["info"].strip())
                indent = match["indent"]
                body = []
            else:
                prose.append((number, line))
            continue
        fence = opening[1]
        closes = match and match["fence"][0] == fence[0] and len(match["fence"]) >= len(fence)
        if closes and not match["info"].strip():
            blocks.append(Block(path, opening[0], opening[2], "\n".join(body) + "\n"))
            opening = None
            continue
        body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
    assert opening is None, f"{path.relative_to(REPO)}:{opening[0]}: unclosed code fence"
    return blocks, prose


def toml_blocks() -> list[Block]:
    return [b for path in DOCS for b in split(path)[0] if b.info.split()[:1] == ["toml"]]


def is_fragment(block: Block) -> bool:
    return "fragment" in block.info.split()[1:]


@pytest.mark.parametrize("block", toml_blocks(), ids=lambda b: b.where)
def test_toml_block_is_a_valid_kvoffload_config(block: Block, tmp_path: Path) -> None:
    try:
        tomllib.loads(block.text)
    except tomllib.TOMLDecodeError as exc:
        pytest.fail(f"{block.where}: not TOML: {exc}")
    if is_fragment(block):
        return
    config = tmp_path / "snippet.toml"
    config.write_text(block.text)
    try:
        load_config(config, env={})
    except ConfigError as exc:
        pytest.fail(
            f"{block.where}: {exc}\n(mark a block that is not a whole kvoffload config "
            "```toml fragment, see docs/testing.md)"
        )


def test_the_docs_have_toml_blocks_to_check() -> None:
    """The checker finds the blocks (a parser that found none would pass everything)."""
    checked = [b for b in toml_blocks() if not is_fragment(b)]
    assert len(checked) >= 3, [b.where for b in toml_blocks()]


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=lambda p: p.name)
def test_shipped_example_configs_load(path: Path) -> None:
    load_config(path, env={})


def slug(heading: str) -> str:
    """GitHub's id of a heading: the text without markup, lowercased, punctuation dropped,
    spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in split(path)[1]:
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match["text"])
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return frozenset(out)


def relative_links(path: Path) -> list[tuple[int, str]]:
    links = []
    for number, line in split(path)[1]:
        for match in LINK.finditer(CODE_SPAN.sub("", line)):
            target = match["target"].strip("<>")
            if not SCHEME.match(target):
                links.append((number, target))
    return links


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_at_files_and_headings_that_exist(path: Path) -> None:
    broken = []
    for number, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(REPO)}:{number}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
        elif REPO not in dest.parents and dest != REPO:
            broken.append(f"{where} (outside the repository)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{where} (no such heading)")
    assert not broken, "\n".join(broken)


def test_slugs_follow_github() -> None:
    assert slug("Configuration (`[object]`)") == "configuration-object"
    assert slug("Object tier (S3-compatible)") == "object-tier-s3-compatible"
    assert slug("`kvoffload demo`") == "kvoffload-demo"
    assert slug("1. Install") == "1-install"
    assert slug("Cascades and durability") == "cascades-and-durability"


ARCHITECTURE = REPO / "docs" / "design" / "architecture.md"
DESCRIPTION_COLUMN = 24
"""In the source tree block, a line whose first word starts left of this column names an
entry (a directory ending in ``/`` or a module); words further right describe it."""
NAMED_MODULE = re.compile(r"\b[\w/]*\w\.py\b")
NAMED_DIRECTORY = re.compile(r"(?<![\w/])([a-z_]+/)(?=[,;\s]|$)")


@dataclass(frozen=True)
class SourceTree:
    directories: frozenset[str]
    modules: frozenset[str]


def source_tree(text: str) -> SourceTree:
    """The directories and modules (repo-relative paths) the ``## Source tree`` block names:
    each entry under the last entry less indented than it, each word of a description under
    its entry's directory."""
    section = text.split("## Source tree", 1)[1]
    block = section.split("```", 2)[1].split("\n", 1)[1]
    directories: set[str] = set()
    modules: set[str] = set()
    stack: list[tuple[int, str]] = []
    here = ""
    for line in block.splitlines():
        stripped = line.lstrip()
        if not stripped:
            continue
        indent = len(line) - len(stripped)
        description = line
        if indent < DESCRIPTION_COLUMN:
            entry, _, description = stripped.partition(" ")
            while stack and stack[-1][0] >= indent:
                stack.pop()
            parent = stack[-1][1] if stack else ""
            path = parent + entry
            if entry.endswith("/"):
                parts = path.split("/")[:-1]
                directories.update("/".join(parts[: i + 1]) + "/" for i in range(len(parts)))
                stack.append((indent, path))
                here = path
            else:
                modules.add(path)
                here = parent
        for name in NAMED_MODULE.findall(description):
            modules.add(here + name)
        for name in NAMED_DIRECTORY.findall(description):
            directories.add(here + name)
    return SourceTree(frozenset(directories), frozenset(modules))


def named_but_missing(tree: SourceTree) -> list[str]:
    return sorted(p for p in tree.directories | tree.modules if not (REPO / p).exists())


def left_unnamed(tree: SourceTree) -> list[str]:
    """The packages of ``kvoffload/`` and its top-level modules that the tree leaves out."""
    packages = {
        init.parent.relative_to(REPO).as_posix() + "/"
        for init in (REPO / "kvoffload").rglob("__init__.py")
    } - {"kvoffload/"}
    top_level = {p.relative_to(REPO).as_posix() for p in (REPO / "kvoffload").glob("*.py")}
    return sorted((packages - tree.directories) | (top_level - tree.modules))


def test_the_source_tree_names_what_exists() -> None:
    tree = source_tree(ARCHITECTURE.read_text())
    assert "kvoffload/wire/protocol.py" in tree.modules
    assert named_but_missing(tree) == []


def test_the_source_tree_names_every_package_and_top_level_module() -> None:
    assert left_unnamed(source_tree(ARCHITECTURE.read_text())) == []


def test_the_source_tree_check_sees_a_missing_module_and_an_unnamed_package() -> None:
    planted = source_tree(ARCHITECTURE.read_text().replace("  wire/ ", "  wires/", 1))
    assert "kvoffload/wires/protocol.py" in named_but_missing(planted)
    assert "kvoffload/wire/" in left_unnamed(planted)


OPERATIONS = REPO / "docs" / "operations.md"


def cli_flags() -> dict[str, list[str]]:
    """``kvoffload <command ...>`` -> its flags (without ``--help``), from the CLI's parser."""
    import argparse

    from kvoffload.cli import build_parser

    out: dict[str, list[str]] = {}

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        for action in subcommands:
            for name, sub in action.choices.items():
                walk(sub, f"{path} {name}")
        if not subcommands:
            out[path] = [
                max(a.option_strings, key=len)
                for a in parser._actions
                if a.option_strings and "--help" not in a.option_strings
            ]

    walk(build_parser(), "kvoffload")
    return out


def command_rows(text: str) -> list[str]:
    section = text.split("## Commands", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| `kvoffload ")]


def undocumented_flags(flags: dict[str, list[str]], text: str) -> list[str]:
    """``command flag`` for each flag that no row of the command table naming the command
    mentions (and each command no row names)."""
    rows = command_rows(text)
    missing = []
    for command, names in flags.items():
        mine = [r for r in rows if f"`{command}" in r.split("|")[1]]
        if not mine:
            missing.append(command)
        missing.extend(f"{command} {n}" for n in names if not any(n in r for r in mine))
    return missing


def test_every_cli_flag_is_in_the_command_table() -> None:
    flags = cli_flags()
    assert "--curve-server-key" in flags["kvoffload status"]
    assert undocumented_flags(flags, OPERATIONS.read_text()) == []


def test_the_flag_check_sees_a_planted_flag_and_command() -> None:
    planted = {**cli_flags(), "kvoffload status": ["--planted"], "kvoffload planted": []}
    assert undocumented_flags(planted, OPERATIONS.read_text()) == [
        "kvoffload status --planted",
        "kvoffload planted",
    ]
