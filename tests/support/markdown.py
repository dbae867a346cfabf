"""The docs' markdown as the tests read it: fenced code blocks with the headings above
them, the headings, and the prose outside the blocks. One reader for every test that runs
a guide's ``sh`` blocks or checks a page's sections and links.

Fences and headings follow CommonMark (https://spec.commonmark.org/0.31.2/, §4.5 fenced
code blocks, §4.2 ATX headings): a fence is three or more backticks or tildes, indented
at most three spaces; it closes on a line of the same character, at least as long, with
nothing after it; a backtick fence's info string holds no backtick. One rule is stricter
than CommonMark: a fence still open at the end of the page raises :class:`UnclosedFence`
instead of running to the end, so a guide test never runs half a page of prose as shell.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_OPEN = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_HEADING = re.compile(r"^ {0,3}(?P<marks>#{1,6})(?:[ \t]+(?P<title>.*?))?(?:[ \t]+#+)?[ \t]*$")


class UnclosedFence(ValueError):
    """A fenced block that no closing fence ends: the page is malformed."""


@dataclass(frozen=True)
class Heading:
    """An ATX heading outside every fenced block: 1-based ``line``, ``level`` 1-6, and
    ``title`` as written (inline markup such as backticks kept, closing ``#``s dropped)."""

    line: int
    level: int
    title: str


@dataclass(frozen=True)
class Block:
    """One fenced code block.

    ``info`` is the info string after the opening fence (stripped), ``code`` the lines
    between the fences joined by ``\\n`` (no trailing newline; the opening fence's
    indentation removed from each, as CommonMark does), ``line`` the 1-based line of the
    opening fence, ``outline`` the headings it sits under, outermost first.
    """

    info: str
    code: str
    line: int
    outline: tuple[Heading, ...]

    @property
    def lang(self) -> str:
        """The first word of the info string (``sh``, ``text``...), ``""`` for a bare fence."""
        return self.info.split(maxsplit=1)[0] if self.info else ""

    def under(self, level: int) -> str:
        """The title of the level-``level`` heading this block sits under, ``""`` if none."""
        return next((h.title for h in self.outline if h.level == level), "")

    @property
    def section(self) -> str:
        """The level-2 heading above the block: the section a guide test runs it in."""
        return self.under(2)


@dataclass(frozen=True)
class Page:
    """A markdown page read once: its ``headings`` and ``blocks`` in order, and its
    ``prose`` (every line outside the fenced blocks, fence lines excluded)."""

    name: str
    headings: tuple[Heading, ...]
    blocks: tuple[Block, ...]
    prose: str

    def blocks_in(self, lang: str) -> list[Block]:
        """The blocks whose language is ``lang``, in order."""
        return [b for b in self.blocks if b.lang == lang]

    def sh_blocks(self) -> list[Block]:
        """The ```sh blocks, in order: the commands a guide tells the reader to run."""
        return self.blocks_in("sh")


def _closes(line: str, fence: str) -> bool:
    stripped = line.rstrip(" \t")
    body = stripped.lstrip(" ")
    return (len(stripped) - len(body) <= 3 and len(body) >= len(fence)
            and body == fence[0] * len(body))


def parse(text: str, name: str = "<markdown>") -> Page:
    """Read ``text`` (a page called ``name`` in error messages) into a :class:`Page`.

    Raises :class:`UnclosedFence` naming the page and the line of a fence that never closes.
    """
    headings: list[Heading] = []
    blocks: list[Block] = []
    prose: list[str] = []
    outline: list[Heading] = []
    opened: tuple[str, int, str, int] | None = None  # (fence, indent, info, line)
    body: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        if opened is not None:
            fence, indent, info, start = opened
            if _closes(line, fence):
                blocks.append(Block(info, "\n".join(body), start, tuple(outline)))
                opened, body = None, []
            else:
                body.append(re.sub(rf"^ {{0,{indent}}}", "", line))
            continue
        match = _OPEN.match(line)
        if match and not (match["fence"][0] == "`" and "`" in match["info"]):
            opened = (match["fence"], len(match["indent"]), match["info"].strip(), number)
            continue
        prose.append(line)
        heading = _HEADING.match(line)
        if heading:
            found = Heading(number, len(heading["marks"]), (heading["title"] or "").strip())
            headings.append(found)
            outline = [h for h in outline if h.level < found.level] + [found]
    if opened is not None:
        raise UnclosedFence(f"{name}: the {opened[0]} fence opened on line {opened[3]} is never closed")
    return Page(name, tuple(headings), tuple(blocks), "\n".join(prose))


def read(path: Path) -> Page:
    """:func:`parse` of the file at ``path``, named by its file name."""
    return parse(path.read_text(), path.name)
