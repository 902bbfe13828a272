"""The documents a reader starts from stay short and their links lead somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "benchmarks" / "RESULTS.md",
]
_LINK = re.compile(r"\]\(([^)\s]+)\)|src=\"([^\"]+)\"")
_FENCE = re.compile(r"```.*?```", re.S)


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lower case, punctuation dropped)."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def _links(path: Path) -> list[str]:
    text = _FENCE.sub("", path.read_text())
    return [a or b for a, b in _LINK.findall(text) if not (a or b).startswith("http")]


def test_readme_is_short_names_the_two_commands_and_links_the_docs():
    """README.md stays an entry page (at most ~200 lines): the commands `make demo` and `make
    test` (issue 31: the test command is `make test`), and links to every page of docs/ and
    to the results."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "make test " in readme and "make demo " in readme
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")} | {"benchmarks/RESULTS.md"}
    assert pages <= {link.partition("#")[0] for link in _links(ROOT / "README.md")}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    """Every relative link and image in the README, docs/ and RESULTS names a file that
    exists, and a `#fragment` into a Markdown file names one of its headings."""
    broken = []
    for link in _links(doc):
        path, _, fragment = link.partition("#")
        target = (doc.parent / path).resolve() if path else doc
        if not target.exists():
            broken.append(link)
        elif fragment and target.suffix == ".md" and fragment not in _anchors(target):
            broken.append(link)
    assert not broken, f"{doc.relative_to(ROOT)}: broken links {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_files_exist(doc):
    """Every repository path a document names in code (`trace_replay/...py`, `tests/...py`,
    `benchmarks/...`) exists: the documents follow the modules when they move."""
    named = re.findall(
        r"`((?:trace_replay|tests|benchmarks|data|notebooks|docs)/[\w/.\-]*\.\w+)", doc.read_text()
    )
    missing = sorted({path for path in named if not (ROOT / path).exists()})
    assert not missing, f"{doc.relative_to(ROOT)} names files that do not exist: {missing}"
