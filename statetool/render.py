"""Turning results into what people read (rich tables) and what machines read (JSON).

Human output goes to stdout; warnings, errors and progress go to stderr, so stdout stays
one JSON document under ``--json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from statetool.errors import StateError


def out() -> Console:
    """A console on the current ``sys.stdout``, made per call: each invocation (also one
    run in-process by the tests) gets the stdout, width and ``NO_COLOR`` it runs with.

    Not a terminal (a log, CI) and no COLUMNS: wide enough that paths and the one line an
    operator must copy (RIVET_STATE_URL=...) are never cut mid-token at rich's default 80.
    markup=False: paths, URLs, cursors and messages are the user's text, and "[/x]" in them
    is no style tag (SPEC §8a); styles are given as Text objects instead.
    """
    return Console(highlight=False, soft_wrap=False, markup=False,
                   width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 200)


def err() -> Console:
    """A console on the current ``sys.stderr``, made per call (as :func:`out`)."""
    return Console(stderr=True, highlight=False, soft_wrap=True)


#: C0 and C1 control characters and DEL, each shown as an escape: text read from a state
#: (cursors, holders, commands, run errors) must not move the cursor, retitle the terminal
#: or overwrite a line (SPEC §8a). Newline and tab stay (``migrate --sql`` prints lines).
#: The Unicode bidirectional controls (U+202E and its kin) are escaped too (``\\u202e``):
#: they reorder what follows them on the line.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c not in (9, 10)} | {13: "\\r"} | {
    c: f"\\u{c:04x}" for c in (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))}


def visible(value: Any) -> Any:
    """``value`` with every control character in its strings escaped (``\\x1b``), walking
    dicts, lists and tuples; other values are returned as they are."""
    if isinstance(value, str):
        return value.translate(_ESCAPES)
    if isinstance(value, dict):
        return {k: visible(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [visible(v) for v in value]
    return value


def human(renderer: Callable[[dict[str, Any]], None], doc: dict[str, Any]) -> None:
    """Render ``doc`` for people with :func:`visible` text (JSON output escapes by itself)."""
    renderer(visible(doc))


def print_error(error: StateError) -> None:
    """``Error: …`` and ``Try: …`` on stderr (the ``--json-errors`` line is cli.py's)."""
    err().print(Text.assemble(("Error", "bold red"), f" [{error.code}]: {visible(error.message)}"))
    err().print(f"Try: {error.entry.action}")


def print_failure_line(code: str, message: str, error: StateError | None = None,
                       failures: list[dict[str, Any]] | None = None) -> None:
    """The ``--json-errors`` line of a failing row: the error object of ``error`` (or of a
    registered ``code``), else the warning object of a warning ``code``; ``failures`` are
    the failed exports (:func:`statetool.errors.unit_failure`), ``[]`` when none is given."""
    from statetool.errors import failure_object

    sys.stderr.write(json.dumps(failure_object(code, message, error, failures)) + "\n")


def print_warnings(warnings: list[dict[str, str]]) -> None:
    """Each warning on stderr: ``Warning [CODE]: message`` and its action."""
    for w in warnings:
        err().print(Text.assemble(("Warning", "yellow"), f" [{w['code']}]: {w['message']}"))
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


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _kv(title: str, rows: list[tuple[str, Any]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in rows:
        table.add_row(key, _fmt(value))
    return table


def info(doc: dict[str, Any]) -> None:
    """``statetool info`` for people."""
    loc, rev, ident = doc["location"], doc["revision"], doc["identity"]
    real = [("real file", loc["real_path"])] if loc.get("real_path") not in (None, loc["path"]) else []
    out().print(_kv("State", [("location", loc["display"]), *real, ("backend", loc["backend"]),
                            ("scope", loc["scope"]), ("set by", loc["origin"])]))
    pending = ", ".join(rev["pending"]) or "none"
    current = "legacy (no version table)" if rev["legacy"] else rev["current"]
    out().print(_kv("Revision", [("current", current), ("head", rev["head"]), ("pending", pending),
                               ("status", rev["status"])]))
    out().print(_kv("Identity", [("recorded", ident["recorded"]), ("computed", ident["computed"] or "(unknown)"),
                               ("verdict", ident["verdict"]), ("", ident["message"])]))
    exports(doc["exports"])
    if doc.get("leases"):
        leases({"leases": doc["leases"]})
    print_warnings(doc["warnings"])


def exports(rows: list[dict[str, Any]]) -> None:
    """The per-export progress table."""
    table = Table(title="Exports", title_justify="left")
    for col in ("export", "mode", "cursor", "last run", "status", "runs (ok/failed)", "chunks"):
        table.add_column(col, overflow="fold")
    for row in rows:
        last = row.get("last_run") or {}
        name = row["name"] + ("" if row.get("in_config", True) else " (not in config)")
        chunks = f"{row['chunks_done']}/{row['chunks_total']}" if row["chunks_total"] else "-"
        table.add_row(name, _fmt(row.get("mode")), _fmt(row.get("cursor")), _fmt(last.get("started_at")),
                      _fmt(last.get("status")), f"{row['runs_total']} ({row['runs_succeeded']}/{row['runs_failed']})",
                      chunks)
    out().print(table)


def export_list(doc: dict[str, Any]) -> None:
    """``statetool exports list`` for people: the progress table, then the warnings."""
    exports(doc["exports"])
    print_warnings(doc.get("warnings", []))


def export_detail(doc: dict[str, Any]) -> None:
    """``statetool exports show`` for people."""
    exports([doc["export"]])
    table = Table(title="Recent runs", title_justify="left")
    for col in ("run id", "status", "started", "finished", "rows", "files", "error"):
        table.add_column(col, overflow="fold")
    for run in doc["recent_runs"]:
        table.add_row(run["run_id"], run["status"], run["started_at"], _fmt(run["finished_at"]), _fmt(run["rows"]),
                      _fmt(run["files"]), _fmt(run["error"]))
    out().print(table)
    print_warnings(doc.get("warnings", []))


_STATUS_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def check(doc: dict[str, Any]) -> None:
    """``statetool check`` for people: one row per check."""
    table = Table(title="Pre-flight", title_justify="left")
    for col in ("check", "status", "code", "message"):
        table.add_column(col, overflow="fold")
    for row in doc["checks"]:
        style = _STATUS_STYLE[row["status"]]
        table.add_row(row["id"], Text(row["status"], style=style), _fmt(row["code"]), row["message"])
    out().print(table)
    failing = [r for r in doc["checks"] if r["status"] in ("fail", "warn") and r["action"]]
    for row in failing:
        out().print(f"Try ({row['id']}): {row['action']}")
    out().print(Text("ok", style="green") if doc["ok"] else Text("not ok", style="bold red"))


def migrate(doc: dict[str, Any]) -> None:
    """``statetool migrate`` for people: the plan, then what was done."""
    if doc.get("sql"):
        sys.stdout.write(doc["sql"])
        return
    table = Table(title=f"Plan: {doc['from_revision']} -> {doc['to_revision']} ({doc['direction']})",
                  title_justify="left")
    for col in ("revision", "description", "rebuilds (rows)", "drops (rows)"):
        table.add_column(col, overflow="fold")
    for step in doc["steps"]:
        table.add_row(step["id"], step["description"],
                      ", ".join(f"{t} ({n})" for t, n in step["rebuilds"].items()) or "-",
                      ", ".join(f"{t} ({n})" for t, n in step["loses"].items()) or "-")
    out().print(table)
    if doc.get("backup"):
        out().print(f"backup: {doc['backup']}")
    if doc.get("verified_rows"):
        out().print("verified: integrity ok, row counts equal (" +
                  ", ".join(f"{t} {n}" for t, n in doc["verified_rows"].items()) + ")")
    out().print(doc["message"])
    print_warnings(doc.get("warnings", []))


def leases(doc: dict[str, Any]) -> None:
    """``statetool leases`` for people."""
    table = Table(title="Leases", title_justify="left")
    for col in ("key", "state", "pid", "host", "user", "acquired", "heartbeat age (s)", "TTL left (s)", "command"):
        table.add_column(col, overflow="fold")
    for row in doc["leases"]:
        style = {"live": "bold", "stale": "yellow", "free": "dim"}[row["state"]]
        table.add_row(row["key"], Text(row["state"], style=style), _fmt(row["holder_pid"]), _fmt(row["host"]),
                      _fmt(row["user"]), _fmt(row["acquired_at"]), _fmt(row["heartbeat_age"]), _fmt(row["ttl_left"]),
                      _fmt(row["command"]))
    out().print(table)
    if not doc["leases"]:
        out().print("no lease has ever been taken on this state")


def relocate(doc: dict[str, Any]) -> None:
    """``statetool relocate`` for people: the plan, then the outcome."""
    out().print(_kv("Relocation", [("from", doc["source"]), ("to", doc["target"]), ("size (bytes)", doc["size_bytes"]),
                                 ("writers held off by", doc["lock"]), ("every task must set",
                                                                       f"RIVET_STATE_URL={doc['state_url']}")]))
    if doc["tables"]:
        out().print(_kv("Tables (rows)", list(doc["tables"].items())))
    for move in doc["checkpoints"]:
        state = f"{move['bytes']} bytes" if move["present"] else "MISSING"
        out().print(f"checkpoint {move['export']}: {move['source']} -> {move['target']} ({state})")
    if doc.get("kept_as"):
        out().print(f"old bytes kept as {doc['kept_as']}")
    out().print(doc["message"])


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


def doctor(doc: dict[str, Any]) -> None:
    """``statetool doctor`` for people: one block per export, verdict first."""
    state = doc["state"]
    out().print(_kv("State", [("location", state["location"]["display"]), ("set by", state["set_by"]),
                            ("every task must share", state["every_task_must_share"])]))
    for candidate in state.get("candidates", []):
        out().print(f"  possible state: {json.dumps(candidate, sort_keys=True)}")
    lines = []  # plain text: thousands of exports print in well under a second
    for export in doc["exports"]:
        line = f"{export['name']} ({export['mode']}): " + ("resumes" if export["verdict"] == "resumes" else "FIRST RUN")
        if export["resumes_from"]:
            line += f" from {export['resumes_from']}"
            if export["age_seconds"] is not None:
                line += f" ({export['age_seconds']:.0f} s old)"
        lines.append(line)
        for reason in export["reasons"]:
            lines.append(f"  [{reason['code']}] {reason['message']}")
            lines.append(f"    fix: {reason['action']}")
    sys.stdout.write("\n".join(lines) + "\n")


def checkpoints(doc: dict[str, Any]) -> None:
    """``statetool checkpoints`` for people."""
    table = Table(title="CDC checkpoints", title_justify="left")
    for col in ("export", "engine", "resolved path", "why", "present", "bytes", "age (s)", "position"):
        table.add_column(col, overflow="fold")
    for row in doc["checkpoints"]:
        position = row["error"] or (json.dumps(row["position"]) if row["position"] is not None else "-")
        table.add_row(row["export"], row["engine"], _fmt(row["path"]), row["why"], _fmt(row["present"]),
                      _fmt(row["size_bytes"]), _fmt(row["age_seconds"]), position)
    out().print(table)
    print_warnings(doc["warnings"])


def transfer(doc: dict[str, Any]) -> None:
    """``statetool transfer`` for people: the plan, then the outcome."""
    out().print(_kv("Transfer", [("from", doc["source"]), ("to", doc["destination"]), ("size (bytes)", doc["size_bytes"]),
                               ("every task must set", f"RIVET_STATE_URL={doc['state_url']}")]))
    table = Table(title="Tables", title_justify="left")
    for col in ("table", "rows", "verified"):
        table.add_column(col)
    for row in doc["tables"]:
        table.add_row(row["table"], str(row["rows"]), _fmt(row["verified"]))
    out().print(table)
    for cp in doc["checkpoints"]:
        out().print(f"checkpoint {cp['export']}: {cp['configured']} -> set cdc.checkpoint to {cp['set_to']}")
    if doc.get("kept_as"):
        out().print(f"old SQLite bytes kept as {doc['kept_as']}")
    out().print(doc["message"])
    print_warnings(doc.get("warnings", []))


def revisions(doc: dict[str, Any]) -> None:
    """``statetool revisions`` for people."""
    table = Table(title="Revisions (oldest first)", title_justify="left")
    for col in ("revision", "description", "applied"):
        table.add_column(col)
    for row in doc["revisions"]:
        table.add_row(row["id"], row["description"], _fmt(row["applied"]))
    out().print(table)


def key_values(title: str, doc: dict[str, Any]) -> None:
    """A flat result (init, identity, exports changes) as a two-column table."""
    out().print(_kv(title, [(k, v) for k, v in doc.items() if k != "warnings" and not isinstance(v, dict)]))
    for key, value in doc.items():
        if isinstance(value, dict) and value:
            out().print(_kv(f"{title}: {key}", list(value.items())))
    print_warnings(doc.get("warnings", []))
