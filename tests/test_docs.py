"""The manual and the maintainer's pages: every link and file reference in README.md and docs/*.md resolves inside
the repository, the README stays a manual (at most 800 lines), and its first kernel is the example file it names.

A reference is a markdown link (``[text](path#anchor)``, ``![alt](path)``) or a repository path written in the text
(``scripts/examples/moe_demo.py``, ``shmemx/udma/_engine.c``, ``tests/test_check.py::test_name``), found anywhere
in the page, code blocks included (commands name files too). Links to other sites are not followed.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 800
TOP_DIRS = ("shmemx", "kernels", "scripts", "tests", "launcher", "docs", ".ci")

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_PATH = re.compile(r"(?<![\w/.<-])((?:" + "|".join(re.escape(d) for d in TOP_DIRS) + r")/[\w./*-]*[\w*/])(::\w+)?")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^\s*(```|~~~)")


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _headings(page: Path) -> list[str]:
    """The page's headings outside code blocks, as written."""
    found, fenced = [], False
    for line in page.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else _HEADING.match(line)
        if m:
            found.append(m.group(2))
    return found


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercase, punctuation dropped (but ``-`` and ``_``), spaces to ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor of a page, duplicates numbered as GitHub numbers them (``name``, ``name-1``, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _headings(page):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def _links(page: Path) -> list[str]:
    return [t for t in _LINK.findall(page.read_text()) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def _resolve_link(page: Path, target: str) -> str | None:
    """None when ``target`` (a relative link of ``page``) resolves; else what is wrong with it."""
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if ROOT != dest and ROOT not in dest.parents:
        return "points outside the repository"
    if not dest.exists():
        return "no such file"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"no heading with anchor #{anchor} in {dest.relative_to(ROOT)}"
    return None


def _resolve_path(ref: str, test_name: str | None) -> str | None:
    """None when the repository path ``ref`` (with an optional ``::test_name``) exists; else what is wrong."""
    matches = glob.glob(str(ROOT / ref)) if "*" in ref else [str(ROOT / ref)] if (ROOT / ref).exists() else []
    if not matches:
        return "no such file or folder"
    if test_name and not re.search(rf"^\s*def {re.escape(test_name[2:])}\(", Path(matches[0]).read_text(), re.M):
        return f"no function {test_name[2:]} in it"
    return None


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_link_resolves(page):
    bad = [f"{target}: {why}" for target in _links(page) if (why := _resolve_link(page, target))]
    assert not bad, f"{_page_id(page)} has links that do not resolve:\n" + "\n".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_path_resolves(page):
    refs = sorted(set(_PATH.findall(page.read_text())))
    bad = [f"{ref}{name}: {why}" for ref, name in refs if (why := _resolve_path(ref.rstrip("/"), name or None))]
    assert not bad, f"{_page_id(page)} names paths that are not in the repository:\n" + "\n".join(bad)


# what only the project's own notes can resolve: pages outside the repository, its internal seed documents
_OUTSIDE = re.compile(r"\.\./shared/|\bseeds? 00\d|the issue's notes|DESIGN\.md")


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_no_reference_to_what_the_repository_lacks(page):
    bad = [f"line {k}: {line.strip()}" for k, line in enumerate(page.read_text().splitlines(), 1)
           if _OUTSIDE.search(line)]
    assert not bad, f"{_page_id(page)} points at documents a reader of the repository does not have:\n" + "\n".join(bad)


def test_readme_is_a_manual_not_a_notebook():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_readme_first_kernel_is_the_example_file():
    """The README's first kernel is ``scripts/examples/ring.py`` word for word, so that its command runs it."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## A first kernel", 1)[1]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert block == (ROOT / "scripts" / "examples" / "ring.py").read_text()


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The resolvers fail on a missing file, a missing anchor, a link out of the repository and a missing test."""
    page = ROOT / "docs" / "design.md"
    assert _resolve_link(page, "../README.md#performance") is None
    assert _resolve_link(page, "../README.md#no-such-heading")
    assert _resolve_link(page, "no-such-page.md")
    assert _resolve_link(page, "../../shared/reference/deepep.md") == "points outside the repository"
    assert _resolve_path("scripts/examples/ring.py", None) is None
    assert _resolve_path("scripts/examples/no_such.py", None)
    assert _resolve_path("tests/test_docs.py", "::test_every_link_resolves") is None
    assert _resolve_path("tests/test_docs.py", "::test_no_such_test")
    assert slug("`shmemx.deep_ep`: what differs from DeepEP") == "shmemxdeep_ep-what-differs-from-deepep"
    assert _PATH.findall("see `/dev/shm/shmemx_<job>_udma<pe>` and shmemx/udma/_engine.c") == [
        ("shmemx/udma/_engine.c", "")]
