"""mkdocs hook: the README is the site's home page.

The README lives at the repository's root, where GitHub shows it, and links to the pages as
`docs/PAGE.md`; in the site, whose pages are docs/ itself, those links become `PAGE.md`. The README is
read at build time, so the site's home page is always the README as committed, never a copy.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(docs/")


def on_files(files, config):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    files.append(File.generated(config, "index.md", content=LINK.sub("](", readme)))
    return files
