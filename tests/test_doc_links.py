"""Every relative link in README.md, BENCHMARKS.md and docs/*.md reaches a file, and its heading."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def links(path: Path) -> list[str]:
    return [target for target in LINK.findall(FENCE.sub("", path.read_text()))
            if not re.match(r"[a-z]+:", target)]  # http:, https:, mailto: are not checked here


def test_slug_matches_githubs_rule():
    assert slug(" Load: concurrent streams, served (AMX Xeon, packed)") == "load-concurrent-streams-served-amx-xeon-packed"
    assert slug(" CUDA graphs (in-process, on a GPU)") == "cuda-graphs-in-process-on-a-gpu"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(document):
    broken = []
    for target in links(document):
        file, _, anchor = target.partition("#")
        path = (document.parent / file).resolve() if file else document
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no such heading")
    assert not broken, broken
