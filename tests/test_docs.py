"""The documentation checks of docs/testing.md: every ```toml block of README.md and docs/ loads as
a kvoffload configuration (``toml fragment`` blocks only parse), and every relative link names a
file that exists, and a heading of it when it has an anchor."""

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
