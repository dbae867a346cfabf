"""THE reader of a CDC checkpoint file (SPEC §6, §5a, §8a): every place that reads one
(the runtime's ``read_position``, ``checkpoints`` and its file-newer warning, ``checkpoints
import``, ``doctor``, ``check``, ``transfer --with-checkpoints``) reads it through
:func:`read_checkpoint`, so one file reads the same everywhere (issue 15, the fresh user's
findings 1-5; docs/decisions.md "One reader of checkpoint files").

The rules, in the order they are applied:

- nothing at the path (and no symlink there; a path through a file holds nothing either):
  *absent*, the one outcome that lets a run start from no position;
- a symlink is followed (the config names the path, and an operator may link it to
  durable storage), but its target must be a regular file; a symlink to nothing (a volume
  not mounted) is never *absent*;
- a FIFO, a directory, a device, a socket, a symlink to nothing or a loop of symlinks is
  ``RIVET_STATE_CHECKPOINT_NOT_A_FILE``, found by ``stat`` before any open (a FIFO is never
  opened, so never waited on; the open is non-blocking in case it changed meanwhile);
- a file this user may not read (or whose directory it may not enter) is
  ``RIVET_STATE_PERMISSION_DENIED``, never *absent* nor unreadable;
- more than :data:`MAX_CHECKPOINT_BYTES` bytes, a byte-order mark, bytes that are not
  UTF-8, JSON nested deeper than :data:`MAX_POSITION_DEPTH` levels (counted on the text,
  before it is parsed), text that is not strict JSON (``NaN`` and ``Infinity`` are no
  JSON), or JSON ``null`` (no position) is ``RIVET_STATE_CHECKPOINT_UNREADABLE``; at most
  the cap and one byte are read.

The two limits of a position, :data:`MAX_CHECKPOINT_BYTES` and :data:`MAX_POSITION_DEPTH`,
live here and bind every entry point: this reader, the one writer of the state's position
rows (:func:`statetool.operations.positions.require_fits`), the runtime's
``commit_position`` (:func:`value_depth`, before the value is serialized) and the reader of
a stored row (:func:`statetool.operations.probe.decode_position`).
"""

from __future__ import annotations

import codecs
import errno
import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from statetool.access import denied, file_kind
from statetool.errors import StateError

#: The largest checkpoint file read (bytes): a position is a few hundred bytes; anything
#: larger is no position (and is never read whole: at most this and one byte are).
MAX_CHECKPOINT_BYTES = 1 << 20

#: The deepest a position may nest (levels of JSON arrays and objects; a bare value is 0,
#: ``{"file": "mysql-bin.000042", "pos": 4}`` is 1). A real engine's position nests a few
#: levels (Debezium's offsets, a MongoDB resume token: at most 3 or 4); anything far deeper
#: is no position, and JSON nested some hundreds of levels deep is past what Python's
#: recursive JSON, rendering and redaction code can handle (docs/decisions.md, "How deep a
#: position may nest").
MAX_POSITION_DEPTH = 64

#: A JSON string (escapes included), and a bracket outside one: what :func:`json_depth` scans.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")

#: The end of a container's children in :func:`value_depth`'s walk.
_END = object()

#: Byte-order marks a checkpoint must not start with, and the encoding each one names.
_MARKS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF8, "UTF-8 with a BOM"),
          (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))


@dataclass(frozen=True)
class CheckpointFile:
    """What is at a checkpoint place: ``text`` the file's JSON exactly and ``position`` its
    value (never None: a file holding ``null`` is refused), ``size_bytes`` and ``modified``
    (``st_mtime``, seconds since the epoch); all None when nothing is there (``present``
    False)."""

    path: Path
    text: str | None = None
    position: object = None
    size_bytes: int | None = None
    modified: float | None = None

    @property
    def present(self) -> bool:
        """True when a checkpoint file is there (and was read)."""
        return self.text is not None


def _not_a_file(path: Path, what: str) -> StateError:
    return StateError("RIVET_STATE_CHECKPOINT_NOT_A_FILE",
                      f"the CDC checkpoint {path} is {what}, not a regular file: its position cannot be read, and a "
                      "run never starts from no position while one may exist; nothing was read from it",
                      {"path": str(path)})


def _unreadable(path: Path, why: str) -> StateError:
    return StateError("RIVET_STATE_CHECKPOINT_UNREADABLE", f"the CDC checkpoint {path} is not a position in "
                      f"UTF-8 JSON: {why}", {"path": str(path)})


def _stat(path: Path) -> os.stat_result | None:
    """``stat`` of ``path`` (through a symlink), None when nothing is there at all."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        if os.path.lexists(path):
            raise _not_a_file(path, f"a symlink to nothing ({os.readlink(path)})") from None
        return None  # (a path through a file holds nothing: a declared directory that is a file is its own finding)
    except PermissionError:
        raise denied(path, "read") from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise _not_a_file(path, "a loop of symlinks") from None
        raise _unreadable(path, err.strerror or str(err)) from None


def _read_capped(path: Path) -> tuple[os.stat_result, bytes]:
    """The ``fstat`` and at most :data:`MAX_CHECKPOINT_BYTES` + 1 bytes of the regular file
    ``path``, opened without waiting and without taking a terminal."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise _unreadable(path, "it was removed while it was read") from None
    except PermissionError:
        raise denied(path, "read") from None
    except OSError as err:
        raise _unreadable(path, err.strerror or str(err)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # it changed kind since the stat
            raise _not_a_file(path, file_kind(st.st_mode))
        chunks: list[bytes] = []
        left = MAX_CHECKPOINT_BYTES + 1
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return st, b"".join(chunks)
    except OSError as err:
        raise _unreadable(path, err.strerror or str(err)) from None
    finally:
        os.close(fd)


def json_depth(text: str) -> int:
    """How many levels of arrays and objects the JSON ``text`` nests (0 for a bare value),
    counted by one scan of its brackets outside strings, never by a parser (which recurses
    once per level). Text that is not JSON gets a count too; its parse refuses it after."""
    depth = deepest = 0
    for bracket in _BRACKET.finditer(_STRING.sub("", text)):
        depth += 1 if bracket.group() in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def value_depth(value: object) -> int:
    """How many levels of lists, tuples and dicts the value ``value`` nests (0 for a bare
    value), walked without recursion (``json.dumps`` recurses once per level). Raises
    ``ValueError`` for a value that contains itself (no JSON)."""
    deepest = 0
    path: list[tuple[int, Iterator[object]]] = []  # (id, children left) of each container entered
    on_path: set[int] = set()
    child: object = value
    while True:
        if isinstance(child, (dict, list, tuple)):
            if id(child) in on_path:
                raise ValueError("the value refers to itself: a position is JSON, which cannot")
            on_path.add(id(child))
            path.append((id(child), iter(child.values() if isinstance(child, dict) else child)))
            deepest = max(deepest, len(path))
        while path:
            child = next(path[-1][1], _END)
            if child is not _END:
                break
            on_path.discard(path.pop()[0])
        else:
            return deepest


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is no JSON value")


def _parse(path: Path, data: bytes) -> tuple[str, object]:
    """The text and value of the checkpoint bytes ``data`` read from ``path``, by the rules
    of the module docstring (cap, no byte-order mark, strict UTF-8, strict JSON, not
    ``null``, no deeper than :data:`MAX_POSITION_DEPTH`). Raises
    ``RIVET_STATE_CHECKPOINT_UNREADABLE``."""
    if len(data) > MAX_CHECKPOINT_BYTES:
        raise _unreadable(path, f"it is larger than {MAX_CHECKPOINT_BYTES} bytes")
    mark = next((name for bom, name in _MARKS if data.startswith(bom)), None)
    if mark is not None:
        raise _unreadable(path, f"it starts with a byte-order mark ({mark}); a checkpoint is UTF-8 without one")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _unreadable(path, f"byte {err.start} is not UTF-8") from None
    depth = json_depth(text)
    if depth > MAX_POSITION_DEPTH:
        raise _unreadable(path, f"its JSON nests {depth} levels deep, deeper than a position may "
                          f"({MAX_POSITION_DEPTH} levels of arrays and objects)")
    try:
        position = json.loads(text, parse_constant=_no_constant)
    except ValueError as err:
        raise _unreadable(path, f"it is not JSON ({err})") from None
    if position is None:
        raise _unreadable(path, "it holds JSON null, which is no position (remove the file to start the stream "
                         "from no position on purpose)")
    return text, position


def read_checkpoint(path: Path) -> CheckpointFile:
    """Read the CDC checkpoint file at ``path`` by the rules of the module docstring:
    :class:`CheckpointFile` (``present`` False when nothing is there). Raises
    ``RIVET_STATE_CHECKPOINT_NOT_A_FILE``, ``RIVET_STATE_PERMISSION_DENIED`` and
    ``RIVET_STATE_CHECKPOINT_UNREADABLE``; reads at most :data:`MAX_CHECKPOINT_BYTES` + 1
    bytes, opens no FIFO, writes nothing."""
    st = _stat(path)
    if st is None:
        return CheckpointFile(path)
    if not stat.S_ISREG(st.st_mode):
        raise _not_a_file(path, file_kind(st.st_mode))
    if st.st_size > MAX_CHECKPOINT_BYTES:
        raise _unreadable(path, f"it is {st.st_size} bytes, larger than {MAX_CHECKPOINT_BYTES}")
    st, data = _read_capped(path)
    text, position = _parse(path, data)
    return CheckpointFile(path, text, position, len(data), st.st_mtime)
