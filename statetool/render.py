"""Turning results into what people read (tables, sentences) and what machines read (JSON).

Human output goes to stdout; warnings, errors and progress go to stderr, so stdout stays
one JSON document under ``--json``.

The rules of the output for people (issue 12 items 1-5; docs/decisions.md, "Output for
people"), each kept in one place here:

- **Width**: ``COLUMNS`` when set, else the terminal's; not on a terminal there is none,
  and nothing is wrapped (:func:`terminal_width`).
- **Words are never broken**: codes, keys, names, modes, revisions, paths, times. A
  table is laid out only when its word columns and the longest word of its prose columns
  fit the width; otherwise each row is printed as a list of ``name  value`` lines
  (:meth:`Page.table`). Prose is wrapped at spaces only (:func:`wrap`).
- **Lines to copy** (``RIVET_STATE_URL=...``, a backup's path) are printed whole on a
  line of their own (:meth:`Page.line`); a setting is shell-quoted when it needs it
  (:meth:`Page.setting`). No line ends in spaces (:meth:`Page.show`).
- **Times and ages**: a time to the second (:func:`timestamp`), an age as a person says it
  (:func:`ago`, :func:`duration`); the exact values stay in ``--json``.
- **Results are sentences**: a change says what it changed, where the backup is and what
  the next run does; the raw result is ``--json``'s.

rich loads only when a page holds a table or a line goes to stderr (its import is about
a tenth of a ``doctor`` on 2,000 exports, whose page is lines only; issue 13): the rest
of a page is plain text written to stdout as it is.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from statetool.errors import StateError
from statetool.moments import moment, parse_time

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

# -- the console: width, colour, stderr ---------------------------------------------------

#: The width a console gets where there is none to keep to (not a terminal, no COLUMNS):
#: wider than any line statetool prints, so nothing is wrapped or cut.
_UNBOUNDED = 1 << 20


def terminal_width() -> int | None:
    """The width people read stdout at, in columns: ``COLUMNS`` when it is a whole number
    of at least 1, else the terminal's when stdout is one; None when stdout is not a
    terminal (a log, a pipe, CI), where no width is forced and nothing is wrapped
    (issue 12 item 2)."""
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    try:
        if sys.stdout.isatty():
            return os.get_terminal_size(sys.stdout.fileno()).columns
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor, or a closed one
        pass
    return None


def _console(width: int | None) -> Console:
    """A console on the current ``sys.stdout`` (made per call: each invocation, also one run
    in-process by the tests, gets the stdout it runs with). Colour follows rich's rules:
    only on a terminal, never under ``NO_COLOR``. markup=False: paths, URLs, cursors and
    messages are the user's text, and "[/x]" in them is no style tag (SPEC §8a)."""
    from rich.console import Console

    return Console(width=width or _UNBOUNDED, highlight=False, markup=False, emoji=False, soft_wrap=False)


def err() -> Console:
    """A console on the current ``sys.stderr``, made per call; its lines are never wrapped
    (``soft_wrap``): a message or an action is copied whole."""
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


#: C0 and C1 control characters and DEL, each shown as an escape: text read from a state
#: (cursors, holders, commands, run errors) must not move the cursor, retitle the terminal
#: or overwrite a line (SPEC §8a). Newline and tab stay (``migrate --sql`` prints lines).
#: Unicode's invisible format characters are escaped too (``\\u202e``): the bidirectional
#: controls (U+202E and its kin) reorder what follows them on the line, and the zero-width
#: ones (U+200B space, joiners, U+2060 word joiner, U+FEFF, the soft hyphen) make two
#: different cursors or names look the same. The list is Unicode's ``Cf`` characters that
#: text from a state can hold unseen, written out: deriving it at import would walk all of
#: Unicode at every start.
_INVISIBLE = (0x00AD, 0x061C, 0x180E, *range(0x200B, 0x2010), *range(0x202A, 0x202F), *range(0x2060, 0x2065),
              *range(0x2066, 0x2070), 0xFEFF, *range(0xFFF9, 0xFFFC))
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c not in (9, 10)} | {13: "\\r"} | {
    c: f"\\u{c:04x}" for c in _INVISIBLE}


def visible(value: Any) -> Any:
    """``value`` with every control character in its strings escaped (``\\x1b``), walking
    dicts, lists and tuples; other values are returned as they are."""
    if isinstance(value, str):
        # Every character escaped is one str.isprintable() refuses (Cc, Cf): a printable
        # text, nearly every one, is returned without a translation.
        return value if value.isprintable() else value.translate(_ESCAPES)
    if isinstance(value, dict):
        return {k: visible(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [visible(v) for v in value]
    return value


def human(renderer: Callable[[dict[str, Any]], None], doc: dict[str, Any]) -> None:
    """Render ``doc`` for people with :func:`visible` text (JSON output escapes by itself)."""
    renderer(visible(doc))


def stderr_width() -> int | None:
    """The width stderr is read at, in columns, when it is a terminal (``COLUMNS`` when set
    to a whole number, else the terminal's); None when it is not one (a log, a pipe, CI),
    where no message is wrapped."""
    try:
        if not sys.stderr.isatty():
            return None
        columns = os.environ.get("COLUMNS", "").strip()
        if columns.isdigit() and int(columns) > 0:
            return int(columns)
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor, or a closed one
        return None


def _labelled(label: str, style: str, code: str, message: str) -> None:
    """``Label [CODE]: message`` on stderr, the message wrapped at spaces to a terminal's
    width under its first line (a long warning is not broken mid-word by the terminal);
    when stderr is no terminal, the message exactly as it is (its own lines unindented)."""
    from rich.text import Text

    width = stderr_width()
    text = f"{label} [{code}]: {message}"
    lines = text.split("\n") if width is None else wrap(text, width, rest="  ")
    err().print(Text.assemble((label, style), lines[0][len(label):]))
    for line in lines[1:]:
        err().print(line)


def print_error(error: StateError) -> None:
    """``Error: …`` and ``Try: …`` on stderr (the ``--json-errors`` line is cli.py's); the
    ``Try:`` line is printed whole: it often holds a command to copy."""
    _labelled("Error", "bold red", error.code, visible(error.message))
    err().print(f"Try: {error.entry.action}")


def print_failure_line(code: str, message: str, error: StateError | None = None,
                       failures: list[dict[str, Any]] | None = None) -> None:
    """The ``--json-errors`` line of a failing row: the error object of ``error`` (or of a
    registered ``code``), else the warning object of a warning ``code``; ``failures`` are
    the failed exports (:func:`statetool.errors.unit_failure`), ``[]`` when none is given."""
    from statetool.errors import failure_object

    sys.stderr.write(json.dumps(failure_object(code, message, error, failures)) + "\n")


def print_warnings(warnings: list[dict[str, str]]) -> None:
    """Each warning on stderr: ``Warning [CODE]: message`` (wrapped on a terminal, as
    :func:`print_error`'s) and its action, one line."""
    for w in warnings:
        _labelled("Warning", "yellow", w["code"], w["message"])
        err().print(f"  Try: {w['action']}")


@contextlib.contextmanager
def rich_progress(description: str) -> Iterator[Callable[[int, int], None]]:
    """A rich progress bar on stderr (the CLI uses it only on a terminal, without ``--json``)."""
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                  console=err(), transient=True) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total or None)

        yield update


# -- times, ages, sizes ----------------------------------------------------------------

_MINUTE, _HOUR, _DAY = 60, 3600, 86400


def duration(seconds: float) -> str:
    """A span of time as a person says it, rounded down to its largest unit (issue 12
    item 4): below a minute ``23 s``, below an hour ``5 min``, below a day ``3 h``, below
    45 days ``2 days`` ("40 days" says more than "1 month"), below 365 days months of 30
    days (``8 months``), then years of 365 days (``3 years``). A negative span is said by
    its size."""
    size = abs(seconds)
    if size < _MINUTE:
        return f"{int(size)} s"
    if size < _HOUR:
        return f"{int(size // _MINUTE)} min"
    if size < _DAY:
        return f"{int(size // _HOUR)} h"
    if size < 45 * _DAY:
        return _plural(int(size // _DAY), "day")
    if size < 365 * _DAY:
        return _plural(int(size // (30 * _DAY)), "month")
    return _plural(int(size // (365 * _DAY)), "year")


def ago(seconds: float | None) -> str:
    """An age in seconds as ``23 s ago``; ``in 23 s`` for a negative age (a clock ahead of
    this host's); ``-`` for None."""
    if seconds is None:
        return "-"
    return f"in {duration(seconds)}" if seconds < 0 else f"{duration(seconds)} ago"


def timestamp(value: Any) -> str:
    """A time for a table, in UTC to the second: ``2026-01-04 11:15:00Z`` (issue 12 item 1;
    :func:`statetool.moments.moment`, the helper every message uses, with a space: a
    table cell is never wrapped); ``-`` for None; any other text as it is."""
    return moment(value, " ")


def since(value: Any, now: datetime) -> str:
    """How long before ``now`` the time ``value`` was (:func:`ago`); ``-`` for None, the text
    as it is when it is no time."""
    when = parse_time(value) if value is not None else None
    if when is None:
        return "-" if value is None else str(value)
    return ago((now - when).total_seconds())


def size(n: int | None) -> str:
    """A size in bytes as ``45056 bytes (44 KiB)`` (:func:`statetool.numbers.size_text`);
    ``-`` for None."""
    from statetool.numbers import size_text

    return "-" if n is None else size_text(n)


def _plural(n: int, one: str) -> str:
    """``1 day``, ``2 days``."""
    return f"{n} {one if n == 1 else one + 's'}"


def _sentence(message: str) -> str:
    """An operation's message (``re-keyed from A to B``) as the start of a sentence."""
    return message[:1].upper() + message[1:]


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


# -- the page: what one command prints on stdout --------------------------------------------


#: The whitespace textwrap turns into spaces (tabs expanded), which a line that fits keeps
#: only when it goes through textwrap.
_MUNGED = re.compile(r"[\t\x0b\x0c\r]")


def wrap(text: str, width: int | None, first: str = "", rest: str = "") -> list[str]:
    """``text`` as lines of at most ``width`` columns, broken at spaces only: a word longer
    than the line stands whole on a line of its own. The first line starts with ``first``,
    every other with ``rest``; each newline of ``text`` starts a new line. ``width`` None:
    one line per line of ``text``, never wrapped."""
    lines: list[str] = []
    for n, part in enumerate(text.split("\n")):
        lead = first if n == 0 else rest
        if width is None:
            lines.append(lead + part)
            continue
        # At least 20 columns for the text itself: a deep indent at a narrow width goes past it.
        room = max(width, len(lead) + 20, len(rest) + 20)
        if len(lead) + len(part) <= room and part and not part[-1].isspace() and not _MUNGED.search(part):
            # What textwrap gives a line that fits, without its cost (2,000 of them in a doctor
            # of 2,000 exports): nothing to break, no tab to expand, no space to drop at the end.
            lines.append(lead + part)
            continue
        lines += textwrap.wrap(part, room, initial_indent=lead, subsequent_indent=rest, break_long_words=False,
                               break_on_hyphens=False) or [lead]
    return lines


@dataclass
class Column:
    """A table column: its header, whether it holds prose (wrapped at spaces; every other
    column holds words, never broken), and the rich style of some of its values."""

    header: str
    prose: bool = False
    styles: dict[str, str] = field(default_factory=dict)


#: Columns between two columns of a table: the (blank) rule and one padding (collapsed).
_GAP = 2
#: Trailing spaces and tabs at a line's end, also before the colour codes that close it.
_TRAILING = re.compile(r"(?:[ \t]|\x1b\[[0-9;]*m)+$", re.MULTILINE)
_SGR = re.compile(r"\x1b\[[0-9;]*m")


def _cell_len(text: str) -> int:
    """The columns ``text`` takes on a terminal (rich's measure: a wide character takes two)."""
    from rich.cells import cell_len

    return cell_len(text)


def _unpadded(text: str) -> str:
    """``text`` with no line ending in spaces or tabs, also not before the colour codes
    that close it (kept). Without colour codes, each line is stripped as it is: the
    pattern, tried at every character, took near a tenth of a doctor of 2,000 exports (issue 13)."""
    if "\x1b" in text:
        return _TRAILING.sub(lambda m: "".join(_SGR.findall(m.group())), text)
    return "\n".join(line.rstrip(" \t") for line in text.split("\n"))


def _words(text: str) -> int:
    """The width of the longest word of ``text`` (0 for none)."""
    return max((_cell_len(w) for w in text.split()), default=0)


def _widest(text: str) -> int:
    """The width of the longest line of ``text``."""
    return max(_cell_len(line) for line in text.split("\n"))


def _fit(columns: Sequence[Column], cells: list[list[str]], width: int | None) -> list[int] | None:
    """The width of each column of a table that fits ``width`` with no word broken: a
    word column is as wide as its widest value (and header); a prose column at least as
    wide as its longest word, and widened towards its widest value with what is left.
    None when that does not fit; ``width`` None: every column as wide as its widest value."""
    widest = [max([_cell_len(c.header), *(_widest(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    if width is None:
        return widest
    least = [max([_cell_len(c.header), *(_words(row[i]) for row in cells)]) if c.prose else widest[i]
             for i, c in enumerate(columns)]
    spare = width - _GAP * (len(columns) - 1) - sum(least)
    if spare < 0:
        return None
    widths = list(least)
    growing = [i for i, c in enumerate(columns) if c.prose and widths[i] < widest[i]]
    while spare > 0 and growing:
        share = max(1, spare // len(growing))
        for i in list(growing):
            step = min(share, widest[i] - widths[i], spare)
            widths[i] += step
            spare -= step
            if widths[i] == widest[i]:
                growing.remove(i)
    return widths


class Page:
    """What one command prints for people, block by block, written to stdout by
    :meth:`show` with no line ending in spaces."""

    def __init__(self) -> None:
        self.width = terminal_width()
        self._parts: list[str | Table] = []

    def line(self, text: str = "") -> None:
        """One line as it is, never wrapped or padded: a heading, a blank line, or a line to
        copy (``RIVET_STATE_URL=...``, a path) that must be pasted whole (issue 12 item 2)."""
        self._parts.append(text)

    def setting(self, text: str) -> None:
        """A line to paste into a shell, ``NAME=value`` (``RIVET_STATE_URL=...``), whole on
        its line, the value shell-quoted when it needs it (issue 12 item 4:
        ``RIVET_STATE_URL='postgresql://...?host=%2Ftmp&schema=x'``; a ``&``, a space or a
        ``$`` would otherwise end, split or expand it). A text that is no assignment
        (``RIVET_STATE_URL unset ...``) is printed as it is."""
        name, sep, value = text.partition("=")
        self.line(f"{name}={shlex.quote(value)}" if sep and name.isidentifier() else text)

    def para(self, text: str, first: str = "", rest: str = "") -> None:
        """Prose wrapped at spaces at the width (:func:`wrap`)."""
        self._parts.extend(wrap(text, self.width, first, rest))

    def pairs(self, title: str | None, rows: Sequence[tuple[str, Any]], indent: str = "") -> None:
        """A ``key  value`` list under ``title``, each value wrapped at spaces under itself."""
        if title:
            self.line(title)
        keys = max((len(key) for key, _ in rows), default=0)
        for key, value in rows:
            label = f"{indent}{key:<{keys}}  "
            self.para(_fmt(value), label, " " * len(label))

    def table(self, title: str | None, columns: Sequence[Column], rows: Sequence[Sequence[Any]]) -> None:
        """A table under ``title`` when it fits the width without breaking a word
        (:func:`_fit`); else each row as its first value and a ``header  value`` line per
        other value that is not empty (``-``): a list reads better than a table whose
        names wrap (issue 12 item 1). No rows: the title alone."""
        cells = [[_fmt(value) for value in row] for row in rows]
        if title:
            self.line(title)
        if not cells:
            return
        widths = _fit(columns, cells, self.width)
        if widths is None:
            for row in cells:
                self.line(row[0])
                self.pairs(None, [(c.header, v) for c, v in zip(columns[1:], row[1:]) if v != "-"], indent="  ")
            return
        from rich import box
        from rich.table import Table
        from rich.text import Text

        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True,
                      header_style="bold")
        for column, width in zip(columns, widths):
            table.add_column(column.header, width=width, no_wrap=not column.prose, overflow="fold")
        for row in cells:
            table.add_row(*(Text(v, style=c.styles.get(v, "")) for c, v in zip(columns, row)))
        self._parts.append(table)

    def show(self) -> None:
        """Write the page to stdout. A table is laid out by rich at the page's width; no
        line ends in spaces (issue 12 item 2: a log keeps no padding)."""
        console = None
        text: list[str] = []
        for part in self._parts:
            if isinstance(part, str):
                text.append(part + "\n")
                continue
            console = console or _console(self.width)
            with console.capture() as captured:
                console.print(part)
            text.append(captured.get())
        sys.stdout.write(_unpadded("".join(text)))


# -- reads -------------------------------------------------------------------------------


def _now() -> datetime:
    return datetime.now(UTC)


_EXPORT_COLUMNS = (Column("export"), Column("mode"), Column("cursor"), Column("last run"), Column("status"),
                   Column("runs (ok/failed)"), Column("chunks"))


def _exports(page: Page, rows: list[dict[str, Any]], now: datetime) -> None:
    """The per-export progress table; ``last run`` is the age of the last run's start."""
    table = []
    for row in rows:
        last = row.get("last_run") or {}
        table.append([row["name"] + ("" if row.get("in_config", True) else " (not in config)"), row.get("mode"),
                      row.get("cursor"), since(last.get("started_at"), now) if last else None, last.get("status"),
                      f"{row['runs_total']} ({row['runs_succeeded']}/{row['runs_failed']})",
                      f"{row['chunks_done']}/{row['chunks_total']}" if row["chunks_total"] else None])
    page.table("Exports", _EXPORT_COLUMNS, table)


_LEASE_STYLES = {"live": "bold", "stale": "yellow", "free": "dim"}


def _lease_table(page: Page, rows: list[dict[str, Any]]) -> None:
    """The lease table. The heartbeat and TTL columns only when a lease has them: a
    PostgreSQL lease row does, an flock sidecar (SQLite) never (issue 12 item 1)."""
    beats = any(row.get("heartbeat_age") is not None for row in rows)
    columns = [Column("key"), Column("state", styles=_LEASE_STYLES), Column("pid"), Column("host"), Column("user"),
               Column("acquired"), *([Column("heartbeat"), Column("TTL left")] if beats else []),
               Column("command", prose=True)]
    table = []
    for row in rows:
        ttl = row.get("ttl_left")
        table.append([row["key"], row["state"], row["holder_pid"], row["host"], row["user"],
                      timestamp(row["acquired_at"]),
                      *([ago(row["heartbeat_age"]), None if ttl is None else duration(ttl)] if beats else []),
                      row["command"]])
    page.table("Leases", columns, table)


def leases(doc: dict[str, Any]) -> None:
    """``statetool leases`` for people."""
    page = Page()
    _lease_table(page, doc["leases"])
    if not doc["leases"]:
        # true on both backends: a released PostgreSQL lease leaves no row, a SQLite one its sidecar
        page.line("no lease is held or recorded")
    page.show()


def info(doc: dict[str, Any]) -> None:
    """``statetool info`` for people: where, revision, identity, then the tables: the
    exports, the CDC checkpoints (when the config has a CDC export), the leases."""
    loc, rev, ident = doc["location"], doc["revision"], doc["identity"]
    page = Page()
    real = [("real file", loc["real_path"])] if loc.get("real_path") not in (None, loc["path"]) else []
    page.pairs("State", [("location", loc["display"]), *real, ("backend", loc["backend"]), ("scope", loc["scope"]),
                         ("set by", loc["origin"])])
    page.line()
    current = "legacy (no version table)" if rev["legacy"] else rev["current"]
    page.pairs("Revision", [("current", current), ("head", rev["head"]),
                            ("pending", ", ".join(rev["pending"]) or "none"), ("status", rev["status"])])
    page.line()
    lineage = doc.get("lineage") or {}
    page.pairs("Identity", [("recorded", ident["recorded"]), ("computed", ident["computed"] or "(unknown)"),
                            ("verdict", ident["verdict"]), ("", ident["message"]),
                            ("lineage", lineage.get("id") or "none recorded"), ("serial", lineage.get("serial"))])
    page.line()
    _exports(page, doc["exports"], _now())
    if doc.get("checkpoints"):  # SPEC §8: info shows the checkpoints (finding 5 of issue 15's fresh user)
        page.line()
        _checkpoint_table(page, doc["checkpoints"])
    if doc.get("leases"):
        page.line()
        _lease_table(page, doc["leases"])
    page.show()
    print_warnings(doc["warnings"])


def export_list(doc: dict[str, Any]) -> None:
    """``statetool exports list`` for people: the progress table, then the warnings."""
    page = Page()
    _exports(page, doc["exports"], _now())
    page.show()
    print_warnings(doc.get("warnings", []))


_RUN_COLUMNS = (Column("run id"), Column("status"), Column("started"), Column("finished"), Column("rows"),
                Column("files"), Column("error", prose=True))


def export_detail(doc: dict[str, Any]) -> None:
    """``statetool exports show`` for people: its progress, then its recent runs."""
    page = Page()
    _exports(page, [doc["export"]], _now())
    page.line()
    page.table("Recent runs", _RUN_COLUMNS, [[run["run_id"], run["status"], timestamp(run["started_at"]),
                                              timestamp(run["finished_at"]), run["rows"], run["files"], run["error"]]
                                             for run in doc["recent_runs"]])
    if not doc["recent_runs"]:
        page.line("no run recorded")
    page.show()
    print_warnings(doc.get("warnings", []))


_STATUS_STYLES = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}
_CHECK_COLUMNS = (Column("check"), Column("status", styles=_STATUS_STYLES), Column("message", prose=True))


def check(doc: dict[str, Any]) -> None:
    """``statetool check`` for people: one row per check. A failing or warning row's code
    and message follow as a paragraph under the table, then its action on a line, where a long message reads
    as prose, not as a tall cell (issue 12 item 1), and each code is printed once. Then
    ``ok`` / ``not ok``."""
    findings = [row for row in doc["checks"] if row["status"] in ("fail", "warn")]
    page = Page()
    page.table("Pre-flight", _CHECK_COLUMNS, [[row["id"], row["status"], "see below" if row in findings
                                               else row["message"]] for row in doc["checks"]])
    for row in findings:
        page.line()
        page.para(row["message"], f"{row['id']}: {row['status']} [{_fmt(row['code'])}] ", "  ")
        if row["action"]:  # what to run next: whole on its line, to copy (issue 12 item 2)
            page.line(f"Try ({row['id']}): {row['action']}")
    page.line()
    page.line("ok" if doc["ok"] else "not ok")
    page.show()


def _said(text: str, *times: Any) -> str:
    """``text`` (a sentence of a JSON document, which keeps its exact times) with each of
    ``times`` that it names said to the second (:func:`statetool.moments.moment`; issue 12
    item 4)."""
    for when in times:
        if when:
            text = text.replace(str(when), moment(when))
    return text


def _reason(page: Page, reason: dict[str, Any], indent: str) -> None:
    """One finding of ``doctor``: ``[CODE] message`` (the time of a reset it names to the
    second), and ``fix: action`` under it whole on its line: what to run next is copied,
    never wrapped (issue 12 item 2)."""
    reset = (reason.get("evidence") or {}).get("reset") or {}
    page.para(_said(reason["message"], reset.get("at")), f"{indent}[{reason['code']}] ", indent + "  ")
    page.line(f"{indent}  fix: {reason['action']}")


def _candidate(page: Page, found: dict[str, Any], now: datetime) -> None:
    """A place ``doctor`` found where the state probably is, and the line that selects it."""
    facts = [f"the old place of a state moved to {found.get('moved_to')}" if found.get("kind") == "relocated"
             else "a state"]
    for key in ("identity", "revision"):
        if found.get(key):
            facts.append(f"{key} {found[key]}")
    if found.get("last_run_finished_at"):
        facts.append(f"last run finished {since(found['last_run_finished_at'], now)}")
    if found.get("exports_with_cursor") is not None:
        facts.append(_plural(int(found["exports_with_cursor"]), "export") + " with a cursor")
    page.para(", ".join(facts), f"  {found['path']}: ", "    ")
    url = found.get("state_url")
    if url:
        page.line("  to use it, every task must set:")
        page.setting(f"RIVET_STATE_URL={url}")
    elif url is not None:
        page.line("  to use it: RIVET_STATE_URL unset (or empty) and this config")


def verdict(export: dict[str, Any], own_reasons: bool = True) -> str:
    """What doctor says of one export's next run, from its diagnosis (``doctor --json``'s
    ``exports[i]``): ``resumes from cursor '…' (4 h old)``, ``REFUSED (CODE): …`` (doctor's
    words, :func:`~statetool.operations.doctor.next_run_words`), or ``FIRST RUN``, with
    ``(because of the state, above)`` when the export has no reason of its own."""
    if export["verdict"] == "refused":
        from statetool.operations.doctor import next_run_words

        return next_run_words(export)
    if export["verdict"] != "resumes":
        return "FIRST RUN" + ("" if own_reasons else " (because of the state, above)")
    words = "resumes" + (f" from {_said(export['resumes_from'], export.get('resumes_from_at'))}"
                         if export["resumes_from"] else "")
    return words + (f" ({duration(export['age_seconds'])} old)" if export["age_seconds"] is not None else "")


def doctor(doc: dict[str, Any]) -> None:
    """``statetool doctor`` for people: the state (where, what set it, the line every task
    must share, what was found about it as a whole, once), then one block per export, its
    verdict first, with only its own reasons (issue 12 item 5: a state-wide reason,
    such as ``RIVET_STATE_ORPHAN_WAL``, is every export's and is printed once, above)."""
    state, now = doc["state"], _now()
    page = Page()
    page.pairs("State", [("location", state["location"]["display"]), ("set by", state["set_by"])])
    page.line("every task must share:")
    page.setting(state["every_task_must_share"])
    shared = state.get("reasons", [])
    if shared:
        page.line()
        page.line("About the state (every export):")
        for reason in shared:
            _reason(page, reason, "  ")
    if state.get("candidates"):
        page.line()
        page.line("Where the state may be:")
        for found in state["candidates"]:
            _candidate(page, found, now)
    page.line()
    for export in doc["exports"]:
        own = [r for r in export["reasons"] if r not in shared]
        page.para(f"{export['name']} ({export['mode']}): {verdict(export, bool(own))}", "", "  ")
        for reason in own:
            _reason(page, reason, "  ")
    page.show()


_CHECKPOINT_COLUMNS = (Column("export"), Column("engine"), Column("stored in"), Column("resolved path"),
                       Column("why", prose=True), Column("present"), Column("bytes"), Column("written"),
                       Column("position", prose=True))
#: The columns of a position the state holds (``stored_in`` ``state``): when and by which run
#: it was committed, shown only when some position is in the state (a file has neither).
_COMMITTED_COLUMNS = (Column("committed"), Column("run"))
#: ``stored_in`` as people say it.
_STORED_IN = {"state": "state", "file": "file", "server_slot": "server slot", "unknown": "unknown"}


def _checkpoint_table(page: Page, checkpoints: list[dict[str, Any]]) -> None:
    """The table of CDC checkpoints ``statetool checkpoints`` and ``statetool info`` show:
    where each position lives (``stored in``: state, file or server slot; issue 15 item 5),
    ``written`` the file's age; with ``committed`` (UTC to the second) and ``run`` when a
    position is in the state."""
    in_state = any(row["stored_in"] == "state" for row in checkpoints)
    rows = []
    for row in checkpoints:
        position = row["error"] or (json.dumps(row["position"]) if row["position"] is not None else None)
        rows.append([row["export"], row["engine"], _STORED_IN[row["stored_in"]], row["path"], row["why"],
                     row["present"], row["size_bytes"], ago(row["age_seconds"]), position,
                     *([timestamp(row["committed_at"]), row["run_id"]] if in_state else [])])
    page.table("CDC checkpoints", _CHECKPOINT_COLUMNS + (_COMMITTED_COLUMNS if in_state else ()), rows)


def checkpoints(doc: dict[str, Any]) -> None:
    """``statetool checkpoints`` for people: the table of :func:`_checkpoint_table`, then
    the warnings."""
    page = Page()
    _checkpoint_table(page, doc["checkpoints"])
    if not doc["checkpoints"]:
        page.line("no CDC export in the config")
    page.show()
    print_warnings(doc["warnings"])


def revisions(doc: dict[str, Any]) -> None:
    """``statetool revisions`` for people."""
    page = Page()
    page.table("Revisions (oldest first)", (Column("revision"), Column("description", prose=True),
                                            Column("applied")),
               [[row["id"], row["description"], row["applied"]] for row in doc["revisions"]])
    page.show()


def identity(doc: dict[str, Any]) -> None:
    """``statetool identity show`` for people: the keys, the verdict here and in each scope."""
    page = Page()
    page.pairs("Identity", [("recorded", doc["recorded"]), ("computed", doc["computed"] or "(unknown)"),
                            ("scope", doc["scope"]), ("verdict", doc["verdict"]), ("code", doc["code"]),
                            ("", doc["message"])])
    if doc["by_scope"]:
        page.line()
        page.pairs("A write would, by scope", list(doc["by_scope"].items()))
    page.show()
    print_warnings(doc.get("warnings", []))


# -- writes: what happened, in a sentence or two ---------------------------------------------


def init(doc: dict[str, Any]) -> None:
    """``statetool init`` for people: where the new state is, and its identity."""
    page = Page()
    # The display of a PostgreSQL state ends in "(schema NAME)": a second parenthesis after
    # it read as "(schema s) (revision 0004)", so the revision is its own clause.
    page.para(f"Created a new, empty state at {doc['location']['display']}, at revision {doc['revision']}.")
    if doc["state_key"]:
        page.para(f"It records the identity {doc['state_key']}; each export's next run is its first and is "
                  "recorded here.")
    else:
        page.para("No identity was recorded (the config's source URL gives no state_key here): the first write "
                  "that has one stamps it. Each export's next run is its first and is recorded here.")
    page.show()


def _planned(value: Any) -> str:
    """A value of a plan's change row: ``none``, a count, or a text quoted (a cursor's
    spaces and empty text stay visible)."""
    return "none" if value is None else repr(value) if isinstance(value, str) else str(value)


def plan(page: Page, doc: dict[str, Any]) -> None:
    """The plan of a dry run (a ``plan`` document, :class:`~statetool.operations.writes.WritePlan`)
    for people, the same blocks for every write's ``--dry-run``: that nothing was changed,
    each change ``what  before -> after`` (a value kept: ``what  value (unchanged)``), the
    backup the real run would take first (its path whole on its line, its time the real
    run's), the leases it would hold as they are now, and the audit rows it would write."""
    page.para("Dry run: nothing was changed. The real run would:")
    page.pairs(None, [(row["what"], f"{_planned(row['before'])} (unchanged)" if row["before"] == row["after"] else
                       f"{_planned(row['before'])} -> {_planned(row['after'])}") for row in doc["changes"]]
               or [("change", "nothing")], indent="  ")
    if doc["backup"]:
        page.line("back the state up first, as (the time is the real run's):")
        page.line(doc["backup"])
    if doc["leases"]:
        page.line("hold these leases (as they are now; a live one is waited for up to --lock-wait):")
        page.pairs(None, [(lease["key"], lease["state"] + (f", held by {lease['holder']}" if lease["holder"] else ""))
                          for lease in doc["leases"]], indent="  ")
    page.para("write the audit rows: " + ", ".join(doc["audit"]) if doc["audit"] else "write no audit row.")


def identity_change(doc: dict[str, Any]) -> None:
    """``statetool identity adopt`` / ``rekey`` for people: what the state records now (a
    dry run: its plan)."""
    page = Page()
    if doc.get("dry_run") and doc["plan"]["changes"]:
        plan(page, doc["plan"])
    elif doc["changed"]:
        page.para(f"{_sentence(doc['message'])}; an audit row records the change.")
    else:
        page.para(f"Nothing was changed: the state already records {doc['recorded']}.")
    page.show()
    print_warnings(doc.get("warnings", []))


def _backup(page: Page, backup: str | None) -> None:
    """Where the copy of the state from before a change is: its path whole, to copy."""
    if backup:
        page.line("backup of the state before the change:")
        page.line(backup)


def export_written(doc: dict[str, Any]) -> None:
    """``statetool export -o FILE`` for people: the file, and what it holds."""
    state = doc["state"]
    page = Page()
    page.para(f"Wrote the {doc['format']} export of {_plural(len(doc['exports']), 'export')} to:")
    page.line(doc["output"])
    serial = "not recorded" if state["serial"] is None else state["serial"]
    page.para(f"State {state['state_key'] or '(no identity recorded)'}, revision {state['revision']}, lineage "
              f"{state['lineage'] or 'not recorded'}, serial {serial}.")
    page.show()


def _difference(d: dict[str, Any]) -> str:
    """One line of ``statetool diff``: where, what, A's value -> B's."""
    where = "state" if d["scope"] == "state" else f"export {d['export']}"
    if "changed" in d:
        parts = [f"{label}: {', '.join(d[key])}" for key, label in
                 (("only_a", "only in A"), ("only_b", "only in B"), ("changed", "changed")) if d[key]]
        return f"{where}: {d['field']}: {d['a']} -> {d['b']} rows ({'; '.join(parts)})"
    if d["field"] == "present":
        return f"{where}: only in {'A' if d['a'] else 'B'}"
    return f"{where}: {d['field']}: {json.dumps(d['a'])} -> {json.dumps(d['b'])}"


def diff(doc: dict[str, Any]) -> None:
    """``statetool diff`` for people: the two sides, then each difference on a line."""
    page = Page()
    for side in ("a", "b"):
        one = doc[side]
        page.line(f"{side.upper()}: {one['location']} ({one['kind'].replace('_', ' ')})")
    if doc["equal"]:
        page.para("No difference: the identity, lineage, serial, revision and every export's progress are equal.")
    else:
        page.para(f"{_plural(len(doc['differences']), 'difference')} (A -> B):")
        for d in doc["differences"]:
            page.line(f"  {_difference(d)}")
    page.show()


def imported(doc: dict[str, Any]) -> None:
    """``statetool import`` for people: what was (or would be) written, before -> after."""
    page = Page()
    create = doc["action"] == "create"
    if doc["dry_run"]:
        what = "Would create the state" if create else "Would replace one export's progress"
    else:
        what = "Created the state" if create else "Replaced one export's progress"
    page.para(f"{what} at {doc['location']}:")
    for change in doc["changes"]:
        page.line(f"  {change['export']}: {_progress_text(change['before'])} -> {_progress_text(change['after'])}")
    if doc["dry_run"]:
        page.para("Nothing was written (--dry-run).")
    _backup(page, doc["backup"])
    page.show()
    print_warnings(doc.get("warnings", []))


def _progress_text(progress: dict[str, Any] | None) -> str:
    if progress is None:
        return "(none)"
    cursor = "no cursor" if progress["cursor"] is None else f"cursor {progress['cursor']!r}"
    return f"{cursor}, {_plural(progress['chunks'], 'chunk')}, {_plural(progress['ledger'], 'ledger row')}"


def export_change(doc: dict[str, Any]) -> None:
    """``statetool exports set-cursor`` / ``reset`` for people: the change, the next run,
    the backup."""
    before, name = doc["before"], doc["export"]
    page = Page()
    if doc.get("dry_run"):
        plan(page, doc["plan"])
        page.para(f"Next run of {name} after it: {doc['next_run']}.")
        page.show()
        print_warnings(doc.get("warnings", []))
        return
    if doc["action"] == "reset":
        cleared = f"cursor {before['cursor']!r} cleared" if before.get("cursor") is not None else "no cursor to clear"
        page.para(f"Reset {name}: {cleared}, {_plural(int(before.get('chunks') or 0), 'chunk checkpoint')} "
                  "removed; its run history and load ledger are kept.")
    else:
        old = "none" if before.get("cursor") is None else repr(before["cursor"])
        page.para(f"Set the cursor of {name} from {old} to {doc['after']['cursor']!r}.")
    diagnosis = doc.get("diagnosis")
    if diagnosis is None:
        page.para(f"Next run of {name}: {doc['next_run']}.")
    else:  # doctor's words: the cursor alone does not decide (a CDC stream, a full export)
        page.para(f"Next run of {name}: {verdict(diagnosis)}.")
    _backup(page, doc["backup"])
    page.show()
    print_warnings(doc.get("warnings", []))


def _released(gone: dict[str, Any]) -> str:
    """Whose record a release removes: ``pid P on HOST as USER since TIME (STATE): COMMAND``."""
    return (f"pid {gone['holder_pid']} on {gone['host']} as {gone['user']} since {timestamp(gone['acquired_at'])} "
            f"({gone['state']}): {gone['command']}")


def lease_release(doc: dict[str, Any]) -> None:
    """``statetool leases release`` for people: whose record was removed, or that none was
    (a dry run: its plan, and whose record it would remove)."""
    page = Page()
    gone = doc["released"]
    if gone is None:
        page.para(f"Lease {doc['key']} was already free: nothing was changed.")
    elif doc.get("dry_run"):
        plan(page, doc["plan"])
        page.para(f"The record it would remove: {_released(gone)}")
    else:
        page.para(f"Released lease {doc['key']}, last held by {_released(gone)}")
        page.para("An audit row records it" + (f" (reason: {doc['reason']})." if doc["reason"] else ".")
                  + (f" The next run of {gone['export']} takes the lease at once." if gone.get("export") else ""))
    page.show()
    print_warnings(doc.get("warnings", []))


def migrate(doc: dict[str, Any]) -> None:
    """``statetool migrate`` for people: the plan of a dry run as a table, else what was
    done in a sentence (with the backup), or that nothing was to do."""
    if doc.get("sql"):
        sys.stdout.write(doc["sql"])
        return
    page = Page()
    crossing = f"from {doc['from_revision']} to {doc['to_revision']}"
    if doc["applied"]:
        steps = ", ".join(step["id"] for step in doc["steps"]) or "none"
        page.para(f"Migrated the state at {doc['location']['display']} {crossing} (revisions {steps}), in one "
                  f"transaction; verified: integrity ok and the row counts of "
                  f"{_plural(len(doc['verified_rows']), 'table')} unchanged.")
        _backup(page, doc["backup"])
    elif doc["dry_run"] and doc["steps"]:
        drops = any(n for step in doc["steps"] for n in step["loses"].values())
        page.table(f"Plan: {crossing} ({doc['direction']})",
                   (Column("revision"), Column("description", prose=True), Column("rebuilds (rows)", prose=True),
                    Column("drops (rows)", prose=True)),
                   [[step["id"], step["description"],
                     ", ".join(f"{t} ({n})" for t, n in step["rebuilds"].items()) or None,
                     ", ".join(f"{t} ({n})" for t, n in step["loses"].items()) or None] for step in doc["steps"]])
        page.line()
        page.para(f"Dry run: nothing was changed; migrate would move the state at {doc['location']['display']} "
                  f"{crossing} in one transaction" + ("; this downgrade drops the rows in the 'drops (rows)' "
                                                      "column." if drops else "."))
    else:  # at the target already, or another migration got there first
        page.para(_sentence(doc["message"]) + ".")
    page.show()
    print_warnings(doc.get("warnings", []))


def _every_task(page: Page, doc: dict[str, Any], heading: str) -> None:
    """The line every task must run with after a move, whole on a line of its own."""
    page.line(heading)
    page.setting(f"RIVET_STATE_URL={doc['state_url']}")


def _move_end(page: Page, doc: dict[str, Any], checkpoints: list[str], kept: str, move: str) -> None:
    """The end of a relocation's or a transfer's page: its CDC checkpoints, where the old
    bytes are kept, and the ``RIVET_STATE_URL`` line every task must set."""
    if checkpoints:
        page.line()
    for line in checkpoints:
        page.para(line, "", "  ")
    if doc.get("kept_as"):
        page.line()
        page.line(kept)
        page.line(doc["kept_as"])
    page.line()
    _every_task(page, doc, f"After the {move}, every task must run with:" if doc["dry_run"]
                else "From now on, every task must run with:")
    page.show()


def relocate(doc: dict[str, Any]) -> None:
    """``statetool relocate`` for people: the plan of a dry run, else what was moved, where
    the old bytes are kept, and the ``RIVET_STATE_URL`` line every task must set."""
    page = Page()
    if doc.get("already"):
        page.para(f"Already relocated to {doc['target']}: nothing to move.")
        _every_task(page, doc, "Every task must run with:")
        page.show()
        return
    if doc["dry_run"]:
        page.pairs("Relocation plan (dry run: nothing was changed)",
                   [("from", doc["source"]), ("to", doc["target"]), ("size", size(doc["size_bytes"])),
                    ("writers held off by", doc["lock"])])
        if doc["tables"]:
            page.line()
            page.pairs("Tables (rows)", list(doc["tables"].items()))
    else:
        page.para(f"Relocated {doc['source']} to {doc['target']}" + (" (finishing an interrupted relocation)"
                                                                  if doc["resumed"] else "")
                  + f": {size(doc['size_bytes'])} copied and verified; the old place now refuses every open "
                    "(RIVET_STATE_RELOCATED).")
    _move_end(page, doc, [f"checkpoint {m['export']}: {m['source']} -> {m['target']} "
                          + (f"({m['bytes']} bytes)" if m["present"] else "(MISSING)") for m in doc["checkpoints"]],
              "old bytes kept as:", "move")
    print_warnings(doc.get("warnings", []))


def _positions_moved(positions: dict[str, Any] | None) -> list[str]:
    """The lines of ``transfer --with-checkpoints``'s positions: each moved into the
    destination (and the name its file was renamed to), each skipped with why."""
    if positions is None:
        return []
    verb = "would move" if positions["dry_run"] else "moved"
    return ([f"position {m['export']}: {verb} from {m['file']} into the state"
             + (f"; the file is renamed {m['kept_as']}" if m["kept_as"] else "") for m in positions["moved"]]
            + [f"position {k['export']}: not moved ({k['why']})" for k in positions["skipped"]])


def _in_state(cp: dict[str, Any], dry_run: bool) -> str:
    """Where a transfer's checkpoint ``cp`` whose position is in the state after it had it
    before: in the source state, or in its file, which a dry run says is where it is now
    (finding 2 of issue 15's fresh user: a plan never says the place to come is the one now)."""
    if cp.get("stored_in_before", "state") == "state":
        return "its position is in the state; the file is not read for it"
    if dry_run:
        return "its position is in its checkpoint file now; the transfer moves it into the state, and the file is " \
               "not read for it after"
    return "its position was in its checkpoint file and is in the state now; the file is not read for it"


def transfer(doc: dict[str, Any]) -> None:
    """``statetool transfer`` for people: the plan of a dry run, else what was copied and
    verified, where the old bytes are kept, and the ``RIVET_STATE_URL`` line every task
    must set."""
    page = Page()
    if doc.get("already"):
        page.para(f"Already transferred to {doc['destination']}: nothing to copy.")
        for line in _positions_moved(doc.get("positions")):
            page.para(line, "", "  ")
        _every_task(page, doc, "Every task must run with:")
        page.show()
        print_warnings(doc.get("warnings", []))
        return
    if doc["dry_run"]:
        page.pairs("Transfer plan (dry run: nothing was changed)",
                   [("from", doc["source"]), ("to", doc["destination"]), ("size", size(doc["size_bytes"]))])
        page.line()
        page.table("Tables", (Column("table"), Column("rows")), [[t["table"], t["rows"]] for t in doc["tables"]])
    else:
        rows = sum(t["rows"] for t in doc["tables"])
        page.para(f"Transferred {doc['source']} into {doc['destination']}" + (
            " (finishing an interrupted transfer)" if doc["resumed"] else "")
            + f": {_plural(len(doc['tables']), 'table')}, {_plural(rows, 'row')}, each verified by its row count "
              "and checksum; the old place now refuses every open (RIVET_STATE_RELOCATED).")
    # A relative checkpoint's warning (RIVET_STATE_CHECKPOINT_RELATIVE, SPEC §6) is the
    # finding about that checkpoint: it is its line here, in full, and not again on
    # stderr (issue 12 item 5: each finding once per command).
    relative = [w for w in doc.get("warnings", []) if w["code"] == "RIVET_STATE_CHECKPOINT_RELATIVE"]
    lines = []
    for cp in doc["checkpoints"]:
        found = next((w for w in relative if cp["resolves_to"] in w["message"]), None)
        lines.append(f"checkpoint {cp['export']}: {_in_state(cp, doc['dry_run'])}"
                     if cp.get("stored_in") == "state" else
                     f"checkpoint {cp['export']}: [{found['code']}] {found['message']} At least, set "
                     f"cdc.checkpoint to {cp['set_to']}, or move the position into the state "
                     "(--with-checkpoints)." if found else
                     f"checkpoint {cp['export']}: {cp['configured']} (absolute: nothing to change)")
    lines += _positions_moved(doc.get("positions"))
    _move_end(page, doc, lines, "old SQLite bytes kept as:", "transfer")
    print_warnings([w for w in doc.get("warnings", []) if not any(w["message"] in line for line in lines)])


def _annotation_escape(text: str) -> str:
    return visible(text).replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def github_annotations(rows: list[dict[str, Any]], to_stderr: bool) -> None:
    """GitHub Actions workflow commands (``::error``/``::warning``) for failing and warning rows."""
    stream = sys.stderr if to_stderr else sys.stdout
    for row in rows:
        level = {"fail": "error", "warn": "warning"}.get(row["status"])
        if level:
            title = _annotation_escape(f"statetool {row['id']}: {row['code']}")
            body = _annotation_escape(f"{row['message']} (try: {row['action']})")
            stream.write(f"::{level} title={title.replace(',', '%2C').replace(':', '%3A')}::{body}\n")


_COPY_COLUMNS = (Column("name"), Column("kind"), Column("taken"), Column("revision"), Column("serial"),
                 Column("size"), Column("status", prose=True))


def _copy_status(copy: dict[str, Any], live: dict[str, Any]) -> str:
    """How a copy reads against the live state: its problem, another lineage, ahead of it."""
    if copy["problem"]:
        return f"[{copy['code']}] {copy['problem']}"
    if live["lineage"] and copy["lineage"] and copy["lineage"] != live["lineage"]:
        return "another lineage"
    if live["serial"] is not None and copy["serial"] is not None and copy["serial"] > live["serial"]:
        return "AHEAD of the live state"
    return "verified" if copy["checked"] else "ok"


def backups(doc: dict[str, Any]) -> None:
    """``statetool backups list`` / ``verify`` for people: one row per copy, oldest first,
    then the live state's lineage and serial to read them against."""
    page = Page()
    live = doc["live"]
    page.table("Backups and keeps", _COPY_COLUMNS, [
        [c["name"], c["kind"], timestamp(c["taken_at"]), c["revision"] or "-", c["serial"] or "-",
         _size(c["size"]), _copy_status(c, live)] for c in doc["copies"]])
    if not doc["copies"]:
        page.line(f"no backup or keep beside {doc['location']['display']}")
    page.line()
    page.pairs("Live state", [("lineage", live["lineage"] or "(none)"), ("serial", live["serial"])])
    page.show()


def _size(size: int | None) -> str:
    if size is None:
        return "-"
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024  # type: ignore[assignment]
    return str(size)


def pruned(doc: dict[str, Any]) -> None:
    """``statetool backups prune`` for people: what was (or would be) removed, what stays."""
    page = Page()
    removed = [c["name"] for c in doc["removed"]]
    if doc["dry_run"]:
        page.para(f"Dry run: nothing was removed. The real run would remove {_plural(len(removed), 'file')}:")
    else:
        page.para(f"Removed {_plural(len(removed), 'file')}; an audit row records them:" if removed else
                  "Nothing to remove.")
    for name in removed:
        page.line(f"  {name}")
    kept = doc["kept"]
    if kept:
        page.para(f"Kept {_plural(len(kept), 'file')}: the newest good copy of this state's lineage, those the "
                  "options keep, and every copy that did not verify or is of another lineage (never removed).")
    else:
        page.para("No copy is kept: there is none.")
    page.show()
    print_warnings(doc.get("warnings", []))


def restored(doc: dict[str, Any]) -> None:
    """``statetool restore`` for people: what was restored where, the serials, the backup."""
    page = Page()
    if doc["action"] == "none":
        page.para(f"{_sentence(doc['message'])}.")
    elif doc["dry_run"] and doc["plan"]:
        page.para(f"{_sentence(doc['message'])}.")
        plan(page, doc["plan"])
        page.show()
        print_warnings(doc["plan"]["warnings"])
        return
    else:
        before, after = doc["before"], doc["after"]
        page.para(f"{_sentence(doc['message'])}.")
        if before is not None:
            def serial(value: Any) -> str:
                return "none (a copy from before lineages)" if value is None else str(value)

            page.pairs(None, [("serial", f"{serial(before['serial'])} -> {serial(after['serial'])}"),
                              ("revision", f"{before['revision']} -> {after['revision']}")], indent="  ")
        _backup(page, doc["backup"])
    page.show()


def positions_moved(doc: dict[str, Any]) -> None:
    """``statetool checkpoints import`` / ``export`` for people: each position moved, the
    file it came from or went to, the exports skipped with why, and the warnings on stderr."""
    page = Page()
    into = doc["direction"] == "into_state"
    verb = ("Would move" if doc["dry_run"] else "Moved") + (" into the state" if into else " back to its file")
    for moved in doc["moved"]:
        page.line(f"{verb}: {moved['export']}, position {json.dumps(moved['position'])}")
        page.line(f"  {'from' if into else 'to'} {moved['file']}" +
                  (f"; the file {'would be' if doc['dry_run'] else 'is'} kept as {moved['kept_as']}"
                   if moved["kept_as"] else ""))
    for skipped in doc["skipped"]:
        page.line(f"Skipped {skipped['export']}: {skipped['why']}")
    if not doc["moved"] and not doc["skipped"]:
        page.line("no CDC export in the config")
    page.show()
    print_warnings(doc.get("warnings", []))


# -- several pipelines at once (issue 16 item 1) ------------------------------------------------


def fleet_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every failing or warning row of a fleet's document as ``check``'s rows
    (``{id, status, code, message, action}``), ``id`` prefixed with the pipeline's config:
    each pipeline's checks, the error that stopped its read, then the fleet's findings."""
    rows: list[dict[str, Any]] = []
    for p in doc["pipelines"]:
        rows += [{**row, "id": f"{p['config']} {row['id']}"} for row in p.get("checks", ())
                 if row["status"] in ("fail", "warn")]
        rows += _fleet_error(p)
    return rows + doc["fleet"]


def _fleet_error(p: dict[str, Any]) -> list[dict[str, Any]]:
    """The error that stopped one pipeline's read, as a failing row (none when it was read)."""
    e = p["error"]
    return [{"id": f"{p['config']} error", "status": "fail", "code": e["code"], "message": e["message"],
             "action": e["action"]}] if e else []


def _finding_status(code: str) -> str:
    """``fail`` for a registered error's code, ``warn`` for a registered warning's."""
    from statetool.errors import REGISTRY

    return "fail" if code in REGISTRY else "warn"


def _fleet_end(page: Page, doc: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Each failing or warning row (:func:`fleet_rows`) as a paragraph and its action whole on
    a line, then how many pipelines are ok (each pipeline's ``ok``: neither failing on its
    own nor named by a failing fleet finding; info's findings fail nothing), and ``ok`` /
    ``not ok``."""
    for row in rows:
        page.line()
        page.para(row["message"], f"{row['id']}: {row['status']} [{_fmt(row['code'])}] ", "  ")
        page.line(f"Try ({row['id']}): {row['action']}")
    page.line()
    fine = sum(1 for p in doc["pipelines"] if p["ok"])
    page.line(f"{_plural(len(doc['pipelines']), 'pipeline')}: {fine} ok, {len(doc['pipelines']) - fine} not ok")
    page.line("ok" if doc["ok"] else "not ok")


def _fleet_named(doc: dict[str, Any], config: str) -> list[dict[str, Any]]:
    """The fleet findings that name the pipeline ``config``."""
    return [f for f in doc["fleet"] if config in f["configs"]]


_FLEET_CHECK_COLUMNS = (Column("pipeline"), Column("check"), Column("status", styles=_STATUS_STYLES),
                        Column("message", prose=True))
_FLEET_INFO_COLUMNS = (Column("pipeline"), Column("location"), Column("revision"), Column("identity"),
                       Column("exports"), Column("status", styles=_STATUS_STYLES), Column("findings", prose=True))
_FLEET_DOCTOR_COLUMNS = (Column("pipeline"), Column("export"), Column("mode"), Column("next run", prose=True))


def _fleet_check(page: Page, doc: dict[str, Any]) -> None:
    table = []
    for p in doc["pipelines"]:
        table += [[p["config"], row["id"], row["status"], "see below" if row["status"] in ("fail", "warn")
                   else row["message"]] for row in p["checks"]]
        if p["error"]:
            table.append([p["config"], "error", "fail", "see below"])
        table += [[p["config"], f["id"], f["status"], "see below"] for f in _fleet_named(doc, p["config"])]
    page.table(f"Pre-flight of {_plural(len(doc['pipelines']), 'pipeline')}", _FLEET_CHECK_COLUMNS, table)


def _fleet_info(page: Page, doc: dict[str, Any]) -> list[dict[str, Any]]:
    table, notes = [], []
    for p in doc["pipelines"]:
        described = p["info"] or {}
        warnings = described.get("warnings", [])
        notes += [{"id": f"{p['config']} warning", "status": "warn", **w} for w in warnings] + _fleet_error(p)
        codes = [w["code"] for w in warnings] + [f["code"] for f in _fleet_named(doc, p["config"])]
        table.append([p["config"], (p["location"] or {}).get("display"),
                      (described.get("revision") or {}).get("status"), (described.get("identity") or {}).get("verdict"),
                      len(described["exports"]) if described else None,
                      "fail" if p["error"] else "warn" if codes else "ok",
                      p["error"]["code"] if p["error"] else ", ".join(codes) or None])
    page.table(f"{_plural(len(doc['pipelines']), 'pipeline')}", _FLEET_INFO_COLUMNS, table)
    return notes


def _fleet_doctor(page: Page, doc: dict[str, Any]) -> list[dict[str, Any]]:
    table, notes = [], []
    for p in doc["pipelines"]:
        notes += _fleet_error(p)
        if p["doctor"] is None:
            table.append([p["config"], None, None, "see below"])
            continue
        shared = p["doctor"]["state"].get("reasons", [])
        notes += [{"id": f"{p['config']} state", "status": _finding_status(r["code"]), **r} for r in shared]
        for export in p["doctor"]["exports"]:
            own = [r for r in export["reasons"] if r not in shared]
            # the state's reasons follow the table, as "<config> state:" (never "above")
            table.append([p["config"], export["name"], export["mode"], verdict(export)])
            notes += [{"id": f"{p['config']} {export['name']}", "status": _finding_status(r["code"]), **r}
                      for r in own]
    page.table(f"Next runs of {_plural(len(doc['pipelines']), 'pipeline')}", _FLEET_DOCTOR_COLUMNS, table)
    return notes


def fleet(doc: dict[str, Any]) -> None:
    """``check``, ``info`` or ``doctor`` over several configs for people (``doc["command"]``
    says which): one table of every pipeline (check: one row per pipeline and check; info:
    one per pipeline; doctor: one per pipeline and export), with a row per fleet finding
    under each pipeline it names (check) or its codes (info); then each failure, warning
    and finding once as a paragraph with its action, and the count of pipelines ok."""
    page = Page()
    notes: list[dict[str, Any]] = []
    if doc["command"] == "check":
        _fleet_check(page, doc)
    elif doc["command"] == "info":
        notes = _fleet_info(page, doc)
    else:
        notes = _fleet_doctor(page, doc)
    _fleet_end(page, doc, fleet_rows(doc) if doc["command"] == "check" else notes + doc["fleet"])
    page.show()


_HISTORY_COLUMNS = (Column("export"), Column("state"), Column("runs removed"), Column("runs kept"),
                    Column("ledger removed"), Column("ledger kept"), Column("protected"), Column("batches"))


def history_pruned(doc: dict[str, Any]) -> None:
    """``statetool prune`` for people: per export what was (or would be) removed and kept,
    the archive, the vacuum."""
    page = Page()
    runs, ledger = doc["removed"]["rivet_runs"], doc["removed"]["rivet_load_ledger"]
    what = f"{_plural(runs, 'run')} and {_plural(ledger, 'load-ledger row')}"
    if doc["dry_run"]:
        page.para(f"Dry run: nothing was changed. The real run would remove {what}:")
    else:
        batches = f"{doc['batches']} {'batch' if doc['batches'] == 1 else 'batches'}"
        page.para(f"Removed {what} in {batches}, each audited:" if runs or ledger else "Nothing to remove.")
    rows = [[e["export"], e["state"] + (f" (run lease held by {e['holder']})" if e["holder"] else ""),
             e["removed"]["rivet_runs"], e["kept"]["rivet_runs"], e["removed"]["rivet_load_ledger"],
             e["kept"]["rivet_load_ledger"], sum(e["protected"].values()), e["batches"]] for e in doc["exports"]]
    if rows:
        page.table(None, _HISTORY_COLUMNS, rows)
    archive = doc["archive"]
    if archive is not None and not archive["rows"]:
        page.line()
        page.para(("The real run would remove no row, so it would" if doc["dry_run"] else "No row was removed, so "
                   "statetool did") + f" not create the archive {archive['path']}.")
    elif archive is not None:
        page.line()
        page.para(f"The real run would write {_plural(archive['rows'], 'row')} to the archive:" if doc["dry_run"]
                  else f"Archived {_plural(archive['rows'], 'row')} ({size(archive['bytes'])}) in:")
        page.line(f"  {archive['path']}")
    vacuum = doc["vacuum"]
    if vacuum is not None:
        page.line()
        if vacuum["ran"]:
            page.para(f"Vacuumed: {size(vacuum['before_bytes'])} before, {size(vacuum['after_bytes'])} after.")
        else:
            page.para("The real run would then vacuum" + (", holding every run lease (it waits for live runs)."
                                                          if vacuum["exclusive"] else ", beside live runs."))
    page.show()
    print_warnings(doc["warnings"])
