"""``statetool export``: a state as one versioned JSON document, ``rivet-state/1``, and the
reading of such a document back (``diff``, ``import``). Read-only on the state.

The document (every field: docs/commands.md, "statetool export"; its JSON Schema:
docs/schemas/rivet-state-1.schema.json) carries the state's identity, lineage id and serial
(SPEC §9: every copy of a state carries them), its revision, and per export the progress
a next run resumes from (SPEC §3, §5a): cursor, chunk checkpoints, load-ledger rows, and
the run counts; run history only when asked. It is read in ONE read-only session of the
backend (:meth:`~statetool.backends.base.Backend.reading`): every value comes from one
snapshot of the state, on SQLite and PostgreSQL alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from statetool import __version__
from statetool.backends.base import Backend, Reader
from statetool.backends.durable import CREATE_FLAGS, fsync_dir, regular_or_nothing
from statetool.backends.faults import fault, os_fault, refuse_no_files
from statetool.errors import StateError
from statetool.operations.checkpoint_file import MAX_POSITION_DEPTH, value_depth
from statetool.operations.context import Context, now_iso
from statetool.operations.probe import (ExportProgress, Snapshot, aggregate_rows, chunk_rows, export_rows,
                                        last_successes, ledger_rows, lineage, position_rows, read_snapshot, run_rows)

#: The ``format`` of every document this release writes and reads (docs/commands.md).
FORMAT = "rivet-state/1"
#: The largest document read back (bytes): far above any state's progress, below a memory fault.
MAX_DOCUMENT = 1 << 30


@contextlib.contextmanager
def read_state(backend: Backend) -> Iterator[tuple[Reader, Snapshot]]:
    """One read-only session on ``backend`` and the snapshot read in it, for a state this
    release can read: raises ``RIVET_STATE_MISSING`` (nothing there), the read's codes
    (``RIVET_STATE_NOT_A_STATE``, ``RIVET_STATE_CORRUPT``, ``RIVET_STATE_RELOCATED``,
    ``RIVET_STATE_MOVE_IN_FLIGHT``, ``RIVET_STATE_UNREACHABLE``, ...) and
    ``RIVET_STATE_SCHEMA_NEWER`` / ``RIVET_STATE_SCHEMA_UNEXPECTED`` for a revision this
    release does not know. A state at an older revision is read as it is (SPEC §4)."""
    where = backend.location.display
    if not backend.present():
        raise StateError("RIVET_STATE_MISSING", f"no state at {where}: nothing to read", {"path": where})
    try:
        with backend.reading() as conn:
            snap = read_snapshot(backend, conn)
            unknown = snap.unknown_revision()
            if unknown is not None:
                raise unknown
            yield conn, snap
    except OSError as exc:
        raise os_fault(exc) or exc from None


def _export_doc(name: str, progress: ExportProgress, row: tuple[Any, ...] | None,
                found: dict[str, Any]) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "mode": progress.mode,
        "registered": row is not None,
        "updated_at": row[3] if row is not None else None,
        "cursor": {"value": progress.cursor, "updated_at": progress.cursor_updated_at},
        "chunks": found["chunks"].get(name, []),
        "ledger": found["ledger"].get(name, []),
        "cdc_position": found["positions"].get(name),
        "runs_summary": {"total": progress.runs_total, "succeeded": progress.runs_succeeded,
                         "failed": progress.runs_failed, "last_success": found["successes"].get(name)},
    }
    if found["runs"] is not None:
        doc["runs"] = found["runs"].get(name, [])
    return doc


def state_document(backend: Backend, conn: Reader, snap: Snapshot, *, export: str | None = None,
                   with_history: bool = False) -> dict[str, Any]:
    """The ``rivet-state/1`` document of the state read on ``conn`` (``snap`` its snapshot):
    ``{format, exported_at, statetool, with_history, exported_from, state, exports}`` and,
    with ``with_history``, each export's ``runs`` and the top-level ``run_aggregates``.
    ``export`` limits ``exports`` to that one (``RIVET_EXPORT_UNKNOWN`` when the state does
    not know it). Times are the state's ISO-8601 UTC text; ``cdc_position`` is the position
    the state holds for a CDC export (revision 0006: ``{engine, position, committed_at,
    run_id, fencing_token}``), null where it holds none (the position is then in a
    checkpoint file or a server slot, SPEC §6)."""
    tables = snap.tables
    rows = export_rows(conn)
    positions = position_rows(conn, tables)
    names = sorted(set(snap.exports) | set(rows) | set(positions))
    if export is not None:
        if export not in names:
            raise StateError("RIVET_EXPORT_UNKNOWN", f"export '{export}' is not in the state at "
                             f"{backend.location.display}", {"export": export})
        names = [export]
    lineage_id, serial = lineage(conn, tables)
    found = {"chunks": chunk_rows(conn), "ledger": ledger_rows(conn, tables), "successes": last_successes(conn),
             "positions": positions,
             "runs": run_rows(conn, tables) if with_history else None}
    doc: dict[str, Any] = {
        "format": FORMAT,
        "exported_at": now_iso(),
        "statetool": __version__,
        "with_history": with_history,
        "exported_from": {"backend": backend.location.backend, "location": backend.location.display},
        "state": {"state_key": snap.recorded_key, "lineage": lineage_id, "serial": serial,
                  "revision": snap.effective_revision, "legacy": snap.legacy},
        "exports": {name: _export_doc(name, snap.exports.get(name) or ExportProgress(name), rows.get(name), found)
                    for name in names},
    }
    if with_history:
        doc["run_aggregates"] = aggregate_rows(conn, tables)
    return doc


@dataclass
class ExportResult:
    """What ``statetool export`` wrote: the document, and the file (None: stdout)."""

    document: dict[str, Any]
    output: str | None

    def as_dict(self) -> dict[str, Any]:
        """The document itself (what stdout gets without ``-o``)."""
        return self.document

    def summary(self) -> dict[str, Any]:
        """What a written export reports (``-o FILE``): ``{output, format, state, exports}``,
        ``exports`` the names it holds."""
        return {"output": self.output, "format": self.document["format"], "state": self.document["state"],
                "exports": sorted(self.document["exports"])}


def write_document(path: Path, doc: dict[str, Any], *, force: bool) -> None:
    """Write ``doc`` to ``path`` atomically: a temporary file beside it created exclusively,
    never through a link (``O_EXCL | O_NOFOLLOW``, mode 0600), fsynced, then linked into
    place (a new file) or, with ``force``, renamed over the regular file there; the
    directory fsynced. Raises ``RIVET_STATE_TARGET_NOT_EMPTY`` for an existing ``path``
    without ``force``, ``RIVET_STATE_UNSAFE_FILE`` for a symlink or a non-regular file
    there (even with ``force``), ``RIVET_PLACE_HOLDS_NO_FILES`` for a directory on a kernel
    filesystem (:func:`~statetool.backends.faults.refuse_no_files`), and the filesystem's
    faults (``RIVET_STATE_READ_ONLY``,
    ``RIVET_STATE_PERMISSION_DENIED``, ``RIVET_STATE_DISK_FULL``); no temporary file is
    left behind (SPEC §8a)."""
    path = Path(os.path.abspath(path))
    if not os.path.isdir(path.parent):
        raise StateError("RIVET_CLI_USAGE", f"-o {path}: {path.parent} is no directory; name a file in a directory "
                         "that exists (export creates none)", {"path": str(path)})
    refuse_no_files(path, path.parent)
    if regular_or_nothing(path, "an export is never written through one, --force or not") and not force:
        raise StateError("RIVET_STATE_TARGET_NOT_EMPTY", f"{path} exists; export never overwrites a file "
                         "unless --force is given", {"path": str(path)})
    _remove_dead_temporaries(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.export-tmp")
    body = (json.dumps(doc, indent=2, sort_keys=False, default=str) + "\n").encode()
    try:
        fd = os.open(tmp, CREATE_FLAGS, 0o600)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(body)
                fh.flush()
                os.fsync(fh.fileno())
            if force:
                os.replace(tmp, path)
            else:
                os.link(tmp, path)  # never replaces a file that appeared meanwhile
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        fsync_dir(path.parent)
    except FileExistsError:
        raise StateError("RIVET_STATE_TARGET_NOT_EMPTY", f"{path} appeared while the export was written; nothing "
                         "was replaced", {"path": str(path)}) from None
    except OSError as err:
        raise fault(path, err) or os_fault(err) or err from None


def _remove_dead_temporaries(path: Path) -> None:
    """Remove the temporary files ``.<name>.<pid>.export-tmp`` beside ``path`` that a
    killed export left (its process is gone): each export writes under its own pid, as two
    may run at once with no lease, so none would ever be reused. Only regular files are
    removed; one of a live process is its own."""
    prefix, suffix = f".{path.name}.", ".export-tmp"
    for entry in os.scandir(path.parent):
        pid = entry.name[len(prefix):-len(suffix)]
        if not (entry.name.startswith(prefix) and entry.name.endswith(suffix) and pid.isdigit()):
            continue
        try:
            os.kill(int(pid), 0)
            continue  # a live export's
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # a live process of another user
        if entry.is_file(follow_symlinks=False):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)


def export_state(ctx: Context, *, export: str | None = None, with_history: bool = False,
                 output: Path | None = None, force: bool = False) -> ExportResult:
    """``statetool export``: the ``rivet-state/1`` document of the resolved state
    (:func:`state_document`), read in one read-only session, written to ``output``
    (:func:`write_document`) or returned for stdout. Reads no pipeline config where the
    state is named by ``RIVET_STATE_URL``/``--state-url``. Raises :func:`read_state`'s
    codes, ``RIVET_EXPORT_UNKNOWN``, and :func:`write_document`'s; nothing is written then."""
    backend = ctx.backend()
    with read_state(backend) as (conn, snap):
        doc = state_document(backend, conn, snap, export=export, with_history=with_history)
    if output is not None:
        write_document(output, doc, force=force)
    return ExportResult(doc, str(output) if output is not None else None)


#: The JSON types of each value a ``rivet-state/1`` document holds that ``import`` writes
#: into a state (docs/schemas/rivet-state-1.schema.json): what a hand edit must keep.
_TEXT, _NUMBER, _MAYBE_TEXT, _MAYBE_NUMBER = (str,), (int,), (str, type(None)), (int, type(None))
_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "state": {"state_key": _MAYBE_TEXT, "lineage": _MAYBE_TEXT, "serial": _MAYBE_NUMBER, "revision": _MAYBE_TEXT},
    "export": {"mode": _MAYBE_TEXT, "registered": (bool,), "updated_at": _MAYBE_TEXT, "cursor": (dict,),
               "chunks": (list,), "ledger": (list,), "runs_summary": (dict,), "cdc_position": (dict, type(None))},
    "cdc_position": {"engine": _TEXT, "position": (dict, list, str, int, float, bool, type(None)),
                     "committed_at": _TEXT, "run_id": _MAYBE_TEXT, "fencing_token": _MAYBE_NUMBER},
    "cursor": {"value": _MAYBE_TEXT, "updated_at": _MAYBE_TEXT},
    "chunks": {"run_id": _TEXT, "chunk_index": _NUMBER, "lower_bound": _MAYBE_TEXT, "upper_bound": _MAYBE_TEXT,
               "status": _TEXT, "rows": _NUMBER, "updated_at": _TEXT},
    "ledger": {"id": _MAYBE_NUMBER, "table_name": _TEXT, "part": _TEXT, "rows": _NUMBER, "loaded_at": _MAYBE_TEXT},
    "runs": {"run_id": _TEXT, "mode": _TEXT, "status": _TEXT, "started_at": _TEXT, "finished_at": _MAYBE_TEXT,
             "rows": _NUMBER, "files": _NUMBER, "error": _MAYBE_TEXT, "bytes_read": _MAYBE_NUMBER,
             "duration_ms": _MAYBE_NUMBER, "error_code": _MAYBE_TEXT},
    "run_aggregates": {"run_id": _TEXT, "config_path": _MAYBE_TEXT, "started_at": _TEXT, "finished_at": _MAYBE_TEXT,
                       "status": _TEXT, "details_json": _MAYBE_TEXT},
}
#: The largest integer both backends store (a signed 64-bit column).
_INT_LIMIT = 2 ** 63


def _value_problem(where: str, value: Any, types: tuple[type, ...]) -> str | None:
    """Why ``value`` at ``where`` is not one of ``types`` a state can hold, or None: a bool
    is no number, an integer fits 64 bits, a text holds no NUL (PostgreSQL stores none)."""
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        kinds = " or ".join("null" if t is type(None) else {str: "text", int: "integer", bool: "true/false",
                                                             dict: "object", list: "list", float: "number"}[t]
                            for t in types)
        return f"{where} is {json.dumps(value)[:40]}, where {kinds} belongs"
    if isinstance(value, int) and not isinstance(value, bool) and not -_INT_LIMIT <= value < _INT_LIMIT:
        return f"{where} is {value}, beyond a 64-bit integer"
    if isinstance(value, str) and "\x00" in value:
        return f"{where} holds a NUL character, which a state cannot store"
    if isinstance(value, (dict, list, float)):  # a CDC position: any JSON, stored as its text
        try:
            json.dumps(value, allow_nan=False).encode()
        except (ValueError, UnicodeEncodeError):
            return f"{where} holds NaN, an infinity or a lone surrogate, which no JSON text stores"
    if isinstance(value, str) and not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError:
            return f"{where} holds a lone surrogate (\\ud800-\\udfff), which is no character of any text"
    return None


def _object_problem(where: str, obj: Any, kind: str) -> str | None:
    """What is wrong with ``obj`` as a ``kind`` object of the document (a field missing or of
    the wrong type, :data:`_FIELDS`), or None. Fields beyond those are ignored."""
    if not isinstance(obj, dict):
        return f"{where} is not an object"
    for name, types in _FIELDS[kind].items():
        if name not in obj:
            return f"{where} lacks {name!r}"
        problem = _value_problem(f"{where}.{name}", obj[name], types)
        if problem is not None:
            return problem
    return None


def _problem(doc: Any) -> str | None:
    """What makes ``doc`` no ``rivet-state/1`` document this release reads, or None: the
    first field, by its path in the document, that is missing or holds a value of the
    wrong type (what ``import`` would otherwise fail to write, half way), or a CDC position
    nested deeper than any position may (:func:`_depth_problem`)."""
    if not isinstance(doc, dict):
        return "it is not a JSON object"
    if doc.get("format") != FORMAT:
        return f"its format is {doc.get('format')!r}, not {FORMAT!r}"
    exports = doc.get("exports")
    checks: list[tuple[str, Any, str]] = [("state", doc.get("state"), "state")]
    if not isinstance(exports, dict):
        return "its 'exports' is not an object"
    for name, one in exports.items():
        where = f"exports[{json.dumps(name)}]"
        if not name or "\x00" in name:
            return f"{where} is no export name"
        problem = _object_problem(where, one, "export")
        if problem is not None:
            return problem
        checks.append((f"{where}.cursor", one["cursor"], "cursor"))
        if one["cdc_position"] is not None:
            checks.append((f"{where}.cdc_position", one["cdc_position"], "cdc_position"))
            problem = _depth_problem(f"{where}.cdc_position.position", one["cdc_position"])
            if problem is not None:
                return problem
        for kind in ("chunks", "ledger", "runs"):
            rows = one.get(kind, [])
            if not isinstance(rows, list):
                return f"{where}.{kind} is not a list"
            checks += [(f"{where}.{kind}[{i}]", row, kind) for i, row in enumerate(rows)]
    aggregates = doc.get("run_aggregates", [])
    if not isinstance(aggregates, list):
        return "its 'run_aggregates' is not a list"
    checks += [(f"run_aggregates[{i}]", row, "run_aggregates") for i, row in enumerate(aggregates)]
    problem = next((p for p in (_object_problem(*check) for check in checks) if p is not None), None)
    return problem or _key_problem(doc)


def _depth_problem(where: str, cdc_position: Any) -> str | None:
    """What is wrong with the position of the ``cdc_position`` object at ``where`` that
    nests deeper than a CDC position may
    (:data:`~statetool.operations.checkpoint_file.MAX_POSITION_DEPTH`, counted without
    recursion), or None: no release commits one, and ``diff`` and ``import`` would
    otherwise recurse through it."""
    depth = value_depth(cdc_position.get("position")) if isinstance(cdc_position, dict) else 0
    if depth > MAX_POSITION_DEPTH:
        return (f"{where} nests {depth} levels of arrays and objects, deeper than a CDC position may "
                f"({MAX_POSITION_DEPTH})")
    return None


def _key_problem(doc: dict[str, Any]) -> str | None:
    """A value the document holds twice where a state holds it once (a chunk's run and
    index, a run id, a ledger id), or a serial below 1; None when there is none."""
    serial = doc["state"]["serial"]
    if serial is not None and serial < 1:
        return f"state.serial is {serial}: a serial counts writes from 1"
    seen: dict[str, set[object]] = {"runs": set(), "ledger": set(), "run_aggregates": set()}
    for name, one in doc["exports"].items():
        where = f"exports[{json.dumps(name)}]"
        chunks: set[object] = set()
        for i, chunk in enumerate(one["chunks"]):
            key = (chunk["run_id"], chunk["chunk_index"])
            if key in chunks:
                return f"{where}.chunks[{i}] repeats the chunk {chunk['run_id']}#{chunk['chunk_index']}"
            chunks.add(key)
        rows = [(f"{where}.runs[{i}]", "runs", run["run_id"]) for i, run in enumerate(one.get("runs", []))]
        rows += [(f"{where}.ledger[{i}]", "ledger", row["id"]) for i, row in enumerate(one["ledger"])
                 if row["id"] is not None]
        for at, kind, key in rows:
            if key in seen[kind]:
                return f"{at} repeats the {'run id' if kind == 'runs' else 'ledger id'} {key!r}"
            seen[kind].add(key)
    for i, aggregate in enumerate(doc.get("run_aggregates", [])):
        if aggregate["run_id"] in seen["run_aggregates"]:
            return f"run_aggregates[{i}] repeats the run id {aggregate['run_id']!r}"
        seen["run_aggregates"].add(aggregate["run_id"])
    return None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose every key is given once: a key given twice would have the last
    one win silently (a fresh user's ``"exports": {}`` appended after the real ones)."""
    doc = dict(pairs)
    if len(doc) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _v in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"the key {twice!r} is given twice in one object")
    return doc


def read_input(path: Path, limit: int) -> bytes:
    """Up to ``limit`` bytes of the regular file ``path`` that a command was given to read
    (``import``, ``diff``): opened without waiting (a FIFO is never read from: it would
    block), then checked to be a regular file. Raises ``RIVET_CLI_USAGE`` for nothing there
    (a symlink to nothing too) or a directory, ``RIVET_STATE_UNSAFE_FILE`` for a FIFO, a
    device or a socket, and the file's faults (``RIVET_STATE_PERMISSION_DENIED``, ...)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, IsADirectoryError):
        raise StateError("RIVET_CLI_USAGE", f"{path} is no file: name a {FORMAT} file that statetool export wrote, "
                         "or a state file", {"path": str(path)}) from None
    except OSError as err:
        raise os_fault(err) or err from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise StateError("RIVET_CLI_USAGE", f"{path} is a directory, not a file", {"path": str(path)})
        if not stat.S_ISREG(mode):
            raise StateError("RIVET_STATE_UNSAFE_FILE", f"{path} is not a regular file (a FIFO, a device or a "
                             "socket): nothing was read from it", {"path": str(path)})
        with os.fdopen(os.dup(fd), "rb") as fh:
            return fh.read(limit)
    except OSError as err:
        raise os_fault(err) or err from None
    finally:
        os.close(fd)


def load_document(path: Path) -> dict[str, Any]:
    """Read the ``rivet-state/1`` document at ``path`` (``diff``, ``import``). Raises
    ``RIVET_STATE_EXPORT_FORMAT`` for a file that is not JSON, or not a document of this
    format (another ``format``, a missing field), and the file's faults
    (``RIVET_STATE_PERMISSION_DENIED``, ...)."""
    raw = read_input(path, MAX_DOCUMENT + 1)
    if len(raw) > MAX_DOCUMENT:
        raise StateError("RIVET_STATE_EXPORT_FORMAT", f"{path} is larger than {MAX_DOCUMENT} bytes: not a "
                         f"{FORMAT} document statetool wrote", {"path": str(path)})
    try:
        doc = json.loads(raw, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise StateError("RIVET_STATE_EXPORT_FORMAT", f"{path} nests its JSON deeper than any {FORMAT} document",
                         {"path": str(path)}) from None
    except (UnicodeDecodeError, ValueError) as err:
        raise StateError("RIVET_STATE_EXPORT_FORMAT", f"{path} is not JSON ({err}): not a {FORMAT} document",
                         {"path": str(path)}) from None
    problem = _problem(doc)
    if problem is not None:
        raise StateError("RIVET_STATE_EXPORT_FORMAT", f"{path} is not a {FORMAT} document: {problem}",
                         {"path": str(path)})
    return doc  # type: ignore[no-any-return]
