"""The README and the pages under docs/ link only to what exists: every relative link names a file or folder of
the repository, and a link with an anchor names a heading of the Markdown file it points at (the anchor as
GitHub makes it). The pictures the README shows are committed SVGs made from Graphviz sources in docs/
(`make docs-images`); each SVG ends with its source's sha256, so a source edited without a new SVG fails here.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: ``[text](target)`` and ``![alt](target)``; a target ends at the first space or closing parenthesis.
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~)")
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def _text_outside_code(text: str) -> str:
    """The page without fenced blocks and code spans, where brackets and parentheses are not links."""
    kept: list[str] = []
    fenced = False
    for line in text.splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(_CODE_SPAN.sub("", line))
    return "\n".join(kept)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept),
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor of a Markdown page's headings, a repeated one numbered as GitHub numbers it."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text().splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        match = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = _slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(page: Path) -> list[str]:
    return _LINK.findall(_text_outside_code(page.read_text()))


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """What in ``page`` does not resolve: a missing file or folder, or an anchor no heading makes."""
    broken: list[str] = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not the repository's
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
            continue
        if not resolved.is_relative_to(root):
            broken.append(f"{target}: outside the repository")
            continue
        if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading makes #{anchor} in {resolved.relative_to(root)}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_the_check_finds_a_broken_file_and_a_broken_anchor(tmp_path: Path) -> None:
    """The check itself: a missing file, a missing anchor, a link inside a code span (ignored) and a
    repeated heading's numbered anchor."""
    (tmp_path / "other.md").write_text("# Top\n## Same\n## Same\n```\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#same-1) [ok](#here) ![img](other.md) `[not](missing.md)`\n"
        "[gone](missing.md) [bad](other.md#not-a-heading) [code](other.md#not-a-heading-1) [web](https://x.y/z)\n"
        "## Here\n"
    )
    assert anchors(tmp_path / "other.md") == {"top", "same", "same-1"}
    assert [b.split(":")[0] for b in broken_links(page, tmp_path)] == [
        "missing.md",
        "other.md#not-a-heading",
        "other.md#not-a-heading-1",
    ]


def test_github_anchors_of_headings_with_code_and_punctuation() -> None:
    assert _slug("Prefix-cache routing (`prefixaware`)") == "prefix-cache-routing-prefixaware"
    assert _slug("Reasons and their errors (one table, `Director.error_for`)") == (
        "reasons-and-their-errors-one-table-directorerror_for"
    )
    assert _slug("One values file, two places: `vllm-stack up`") == "one-values-file-two-places-vllm-stack-up"


def test_readme_starts_with_the_two_commands() -> None:
    """A fresh reader's first lines: `make run` and `make test`, in one block, before anything else."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[0].startswith("# ") and lines[2] == "```bash", lines[:3]
    assert lines[3].startswith("make run ") and lines[4].startswith("make test "), lines[3:5]
    assert lines[5] == "```", lines[5]


@pytest.mark.parametrize("source", sorted((ROOT / "docs").glob("*.dot")), ids=lambda p: p.name)
def test_pictures_are_made_from_their_sources(source: Path) -> None:
    """Each Graphviz source has its SVG beside it, stamped with the source's sha256 by `make docs-images`,
    and the README or a docs page shows it."""
    svg = source.with_suffix(".svg")
    assert svg.exists(), f"{svg.name} is missing: run make docs-images"
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    stamp = f"<!-- source: docs/{source.name} sha256 {digest} -->"
    assert svg.read_text().rstrip().endswith(stamp), (
        f"{svg.name} was not made from the current {source.name}: run make docs-images and commit both"
    )
    shown = [p for p in PAGES for target in links(p) if (p.parent / target).resolve() == svg.resolve()]
    assert shown, f"no page shows {svg.name}"
