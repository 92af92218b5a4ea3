"""Every relative link of the README and of the pages in docs/ leads somewhere: the file exists,
and an anchor names a heading of its target as GitHub and MkDocs both spell it. MkDocs checks
the pages of docs/ too (``mkdocs build --strict``, scripts/test.sh), but not the README, which
is outside the site; and it knows only its own spelling of anchors, while the pages are read on
GitHub as well.

The README keeps the table of which check holds which promise, and docs/guarantees.md the same
table beside each promise in full: the two must not drift apart.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]+`")
#: A link or an image: its text (over lines too, one level of brackets inside), then its target.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t#]*$", re.M)


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose(markdown: str) -> str:
    """The text outside fenced blocks."""
    return FENCE.sub("", markdown)


def heading_texts(markdown: str) -> list[str]:
    texts = []
    for match in HEADING.finditer(prose(markdown)):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(2))  # a link: its text
        texts.append(re.sub(r"[`*]", "", text))
    return texts


def github_slug(text: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def mkdocs_slug(text: str) -> str:
    """Python-Markdown's (MkDocs' default ``toc`` slugify): ASCII only, runs of spaces and
    hyphens one hyphen."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", ascii_text).strip().lower())


def anchors(markdown: str) -> tuple[set[str], set[str]]:
    """The anchors of a document's headings, as GitHub and as MkDocs name them (a repeated
    heading's later anchors get ``-1``, ``-2``, ... on both)."""
    github: set[str] = set()
    mkdocs: set[str] = set()
    for slugs, slug in ((github, github_slug), (mkdocs, mkdocs_slug)):
        seen: dict[str, int] = {}
        for text in heading_texts(markdown):
            base = slug(text)
            n = seen.get(base, 0)
            seen[base] = n + 1
            slugs.add(base if n == 0 else f"{base}-{n}")
    return github, mkdocs


def broken_links(path: Path) -> list[str]:
    """What is wrong with the relative links of ``path``, one line each."""
    problems = []
    text = INLINE_CODE.sub("", prose(path.read_text(encoding="utf-8")))
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}: link {target!r}"
        if not linked.exists():
            problems.append(f"{where}: {file_part} does not exist")
            continue
        if anchor and linked.suffix == ".md":
            github, mkdocs = anchors(linked.read_text(encoding="utf-8"))
            if anchor not in github:
                problems.append(f"{where}: no heading of {linked.name} has this anchor on GitHub")
            elif anchor not in mkdocs and linked.is_relative_to(ROOT / "docs"):
                problems.append(f"{where}: no heading of {linked.name} has this anchor in MkDocs")
    return problems


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_somewhere(path: Path) -> None:
    assert broken_links(path) == []


def test_the_documents_are_found() -> None:
    names = {str(p.relative_to(ROOT)) for p in documents()}
    assert {"README.md", "docs/guarantees.md", "docs/wire-protocol.md", "docs/DESIGN.md"} <= names


def test_a_broken_link_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# A\n\n## Wire protocol: Settled ⇄ downstream\n\n## Checks at start\n"
    )
    page = tmp_path / "docs" / "b.md"
    page.write_text(
        "[ok](a.md#checks-at-start) [gone](c.md) [an\nanchor](a.md#checks-at-the-start)\n"
        "[github only](a.md#wire-protocol-settled--downstream) `[code](x.md)` [web](https://x.y)\n"
        "```\n[in a block](nowhere.md)\n```\n"
    )
    assert broken_links(page) == [
        "docs/b.md: link 'c.md': c.md does not exist",
        "docs/b.md: link 'a.md#checks-at-the-start': no heading of a.md has this anchor on GitHub",
        "docs/b.md: link 'a.md#wire-protocol-settled--downstream': no heading of a.md has this "
        "anchor in MkDocs",
    ]


def check_table(markdown: str) -> list[str]:
    """The rows of the table of which check holds which promise."""
    start = markdown.index("| promise | invariant (model checker")
    rows = []
    for line in markdown[start:].splitlines():
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_the_readme_and_the_guarantees_page_have_one_check_table() -> None:
    readme = check_table((ROOT / "README.md").read_text(encoding="utf-8"))
    page = check_table((ROOT / "docs" / "guarantees.md").read_text(encoding="utf-8"))
    assert len(readme) > 5
    only_readme = [row for row in readme if row not in page]
    only_page = [row for row in page if row not in readme]
    assert (only_readme, only_page) == ([], []), (
        "the table of which check holds which promise differs between README.md and "
        "docs/guarantees.md: copy the rows into both"
    )
