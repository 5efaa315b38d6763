"""mkdocs hook: a page's link to a file of the repository outside docs/ (``../CONTRIBUTING.md``,
``../src/...``), which works where the pages are read on a forge but is not part of the site, becomes
the link's text on the site. A link whose file does not exist is left alone, so ``mkdocs build
--strict`` still fails on it."""

from __future__ import annotations

import re
from pathlib import Path

LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s#]+)(#[^)\s]*)?\)")


def on_page_markdown(markdown, page, config, files):
    docs = Path(config["docs_dir"]).resolve()
    here = Path(page.file.abs_src_path).parent

    def replace(found: re.Match) -> str:
        target = found.group(2)
        if "://" in target or target.startswith(("/", "mailto:")):
            return found.group(0)
        path = (here / target).resolve()
        if path.is_relative_to(docs) or not path.exists():
            return found.group(0)
        return found.group(1)

    return LINK.sub(replace, markdown)
