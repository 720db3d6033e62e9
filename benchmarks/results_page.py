"""A results page that mixes generated numbers with prose: a benchmark rewrites only its
own marked section, so a rerun refreshes the table without clobbering the reading of it."""
from __future__ import annotations

from pathlib import Path


def replace_section(path: Path, name: str, text: str, title: str) -> None:
    """Write ``text`` between the ``generated:name`` markers of ``path`` (appended when the
    page has none; the page is created with ``title`` when missing), leaving the prose
    around it alone: a rerun refreshes its numbers without clobbering the reading."""
    begin, end = f"<!-- generated:{name} begin -->", f"<!-- generated:{name} end -->"
    block = f"{begin}\n{text.rstrip()}\n{end}"
    page = path.read_text(encoding="utf-8") if path.exists() else f"{title}\n"
    if begin in page and end in page:
        head, rest = page.split(begin, 1)
        page = head + block + rest.split(end, 1)[1]
    else:
        page = page.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
