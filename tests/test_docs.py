"""The README is a short guide and docs/ builds: every relative link and #anchor in README.md and
docs/*.md resolves, and `mkdocs build --strict` (mkdocs-material, the dev extra) passes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m:
            fence = None if fence == m.group(1) else (fence or m.group(1))
            continue
        if fence is None:
            out.append((number, line))
    return out


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: its text without markup, lowercased, punctuation other than
    '-' and '_' dropped, each space a '-' (repeats kept)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return "".join(c for c in text.lower() if c.isalnum() or c in " -_").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, duplicates numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(path.read_text()):
        m = _HEADING.match(line)
        if not m:
            continue
        slug = github_anchor(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    """Relative links of `path` whose file or #anchor does not exist, as 'file:line: target (why)'."""
    problems = []
    for number, line in _prose_lines(path.read_text()):
        for target in _LINK.findall(_INLINE_CODE.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(REPO)}:{number}: {target}"
            if not dest.exists():
                problems.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where} (no heading with anchor #{anchor} in {dest.name})")
            elif anchor and dest.suffix != ".md":
                problems.append(f"{where} (an anchor into a file that is not Markdown)")
    return problems


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_readme_is_a_short_guide():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"
    headings = [line for line in lines if line.startswith("## ")]
    assert headings[0] == "## Quick start", headings


def test_every_relative_link_and_anchor_resolves():
    problems = [p for page in _pages() for p in broken_links(page)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_link_checker_finds_what_is_broken(tmp_path, monkeypatch):
    """The checker itself: a missing file, a missing anchor and a missing local anchor are reported;
    links in code, external links and GitHub's anchors for headings with markup are not."""
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "other.md").write_text("# Other page\n\n## `_apply` on your own model\n\n## Data\n\n## Data\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Title: one, two\n\n"
        "[ok](other.md#_apply-on-your-own-model) [dup](other.md#data-1) [self](#title-one-two)\n"
        "[web](https://example.com/x#y) `[code](missing.md)`\n\n"
        "```\n[fenced](missing.md)\n```\n\n"
        "[gone](missing.md) [no anchor](other.md#nope) [no local](#nope) [Data](other.md#data-2)\n"
    )
    problems = broken_links(page)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "missing.md (no such file)",
        "other.md#nope (no heading with anchor #nope in other.md)",
        "#nope (no heading with anchor #nope in page.md)",
        "other.md#data-2 (no heading with anchor #data-2 in other.md)",
    ], problems


def test_docs_site_builds_strictly(tmp_path):
    """mkdocs (material theme) in strict mode: a page link, an anchor or a nav entry that does not
    resolve fails the build (mkdocs.yml's `validation` turns each into a warning)."""
    try:
        import material  # noqa: F401
        import mkdocs  # noqa: F401
    except ImportError as e:  # the dev extra installs both
        pytest.fail(f"{e}: install the dev extra: pip install -e '.[dev]' -c constraints.txt")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "planner" / "index.html").is_file()
