"""The results page's words: markdown templates under k3/lab/templates/, one file per experiment, filled from
a run's own numbers.

A template file is a sequence of sections, each opened by a line `<!-- name -->` and running to the next one.
A section's text is a `str.format` template with named fields (`{best:.0%}`; a literal brace is doubled), so
the words live in the file and the code passes only the measured values. `paragraph(file, name, **fields)`
gives one paragraph of a note or a claim: the section's lines joined by single spaces (the file wraps them
for reading; the page keeps a note on one line, as a list item). `text(file, name, **fields)` keeps the
section's line breaks (the page's header). The files are package data, read with importlib.resources, so an
installed wheel carries them.
"""

from __future__ import annotations

import functools
import re
from importlib import resources

_MARK = re.compile(r"^<!-- ([a-z0-9_-]+) -->$", re.MULTILINE)


@functools.cache
def sections(file: str) -> dict[str, str]:
    """The sections of templates/`file`.md: {name: text}, each stripped of the blank lines around it."""
    source = resources.files("k3.lab").joinpath("templates", f"{file}.md").read_text(encoding="utf-8")
    parts = _MARK.split(source)
    found = {}
    for name, body in zip(parts[1::2], parts[2::2]):
        if name in found:
            raise ValueError(f"k3/lab/templates/{file}.md: section {name!r} twice")
        found[name] = body.strip("\n")
    return found


def _section(file: str, name: str) -> str:
    try:
        return sections(file)[name]
    except KeyError:
        raise KeyError(f"k3/lab/templates/{file}.md has no section {name!r}") from None


def text(file: str, name: str, /, **fields) -> str:
    """Section `name` of templates/`file`.md filled from `fields`, its line breaks kept."""
    return _section(file, name).format_map(fields)


def paragraph(file: str, name: str, /, **fields) -> str:
    """Section `name` of templates/`file`.md filled from `fields`, as one line: its lines joined by spaces."""
    return " ".join(line.strip() for line in _section(file, name).splitlines() if line.strip()).format_map(fields)
