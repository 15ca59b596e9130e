"""Average sentence length of the docs pages, in words, as a reader meets them.

    python bench/doc_sentences.py            # every docs/*.md page and README.md
    python bench/doc_sentences.py docs/own-model.md

Counted: prose paragraphs and list items. Left out: fenced code blocks, tables, headings, and inline code spans'
insides (a span counts as one word). A sentence ends at ``.``, ``?`` or ``!`` followed by a space and a capital, a
backtick or an opening bracket, or at the end of a paragraph or list item. The goal (issue 39): under 25 words on
average on every page.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_END = re.compile(r"(?<=[.?!])\s+(?=[A-Z`(\[*])")


def paragraphs(text: str) -> list[str]:
    """The page's prose: one string per paragraph or list item."""
    out: list[str] = []
    current: list[str] = []
    fenced = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            fenced = not fenced
            continue
        starts_item = bool(re.match(r"([-*+]|\d+\.)\s", stripped))
        if fenced or not stripped or stripped.startswith(("#", "|", "<")) or starts_item:
            if current:
                out.append(" ".join(current))
            current = []
            if fenced or not stripped or stripped.startswith(("#", "|", "<")):
                continue
            stripped = re.sub(r"^([-*+]|\d+\.)\s+", "", stripped)
        current.append(stripped)
    if current:
        out.append(" ".join(current))
    return out


def sentences(text: str) -> list[int]:
    """The word count of each sentence of the page."""
    counts = []
    for para in paragraphs(text):
        para = re.sub(r"`[^`]*`", "CODE", para)
        para = re.sub(r"\]\([^)]*\)", "]", para)  # a link's target is not read
        for sentence in _END.split(para):
            words = len(sentence.split())
            if words:
                counts.append(words)
    return counts


def main(argv: list[str]) -> None:
    pages = [Path(a) for a in argv] or [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        counts = sentences(page.read_text())
        mean = sum(counts) / len(counts) if counts else 0.0
        longest = max(counts, default=0)
        print(f"{page.name:24s} {mean:5.1f} words/sentence  {len(counts):4d} sentences  longest {longest}")


if __name__ == "__main__":
    main(sys.argv[1:])
