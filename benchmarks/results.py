"""The benchmarks' shared results file: rows appended to the tables of benchmarks/RESULTS.md, each
stamped with the date and commit measured."""

from __future__ import annotations

import datetime
import subprocess
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def append_row(header: str, row: str, path: Path | None = None) -> None:
    """Insert `row` at the end of the table that starts with `header`, creating either if missing."""
    path = path or RESULTS
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    lines = text.splitlines()
    if header not in lines:
        sep = "|" + "|".join(" --- " for _ in range(header.count("|") - 1)) + "|"
        lines += ["", header, sep]
    i = lines.index(header) + 2
    while i < len(lines) and lines[i].startswith("|"):
        i += 1
    lines.insert(i, row)
    path.write_text("\n".join(lines) + "\n")


def measured() -> str:
    """Today's date and the commit measured; "+changes" when tracked files differ from it (this
    file's results table aside)."""
    root = RESULTS.parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        changed = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", ".", f":!{RESULTS.relative_to(root)}"],
                                 cwd=root).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return f"{datetime.date.today()} (no git)"
    return f"{datetime.date.today()} ({commit}{'+changes' if changed else ''})"


def gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"
