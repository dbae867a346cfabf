"""The pipeline config loader (SPEC §2): the few fields statetool reads.

Unknown keys are ignored (the runtime owns the rest of the file). Every refusal names
the file, line and column (1-based) of the offending node.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import yaml

from statetool.access import denied, file_kind
from statetool.errors import StateError
from statetool.location import MAX_LEASE_FILE_NAME, lease_file_name
from statetool.redact import remember_secrets

MODES = ("full", "incremental", "chunked", "cdc")
CDC_ENGINES = ("postgres", "mysql", "mongodb", "oracle")
#: A control character (C0 or DEL), which no export name may hold.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class CdcSpec(NamedTuple):
    """The ``cdc:`` block of a CDC export: ``engine`` and the configured ``checkpoint`` path."""

    engine: str
    checkpoint: str | None


class Export(NamedTuple):
    """One export of the config: its ``name``, ``mode`` and, for ``mode: cdc``, its ``cdc`` block."""

    name: str
    mode: str
    cdc: CdcSpec | None = None


class PipelineConfig(NamedTuple):
    """A parsed pipeline config: where it is, how to find the source URL, and its exports."""

    path: Path
    source_url: str | None
    source_url_env: str | None
    exports: tuple[Export, ...]

    @property
    def directory(self) -> Path:
        """The directory of the config: the default home of the state (SPEC §1)."""
        return self.path.parent

    def resolved_source_url(self, env: Mapping[str, str]) -> str | None:
        """The source URL: ``source.url``, or the value of the variable ``source.url_env`` names."""
        if self.source_url:
            return self.source_url
        if self.source_url_env:
            value = env.get(self.source_url_env) or None
            remember_secrets(value)
            return value
        return None

    def export(self, name: str) -> Export | None:
        """The export called ``name``, or None."""
        return next((e for e in self.exports if e.name == name), None)


#: A pipeline config larger than this is refused unread (bytes): a config is a few KiB.
MAX_CONFIG_BYTES = 16 << 20


def _read_regular(file: Path) -> str:
    """The text of ``file``, opened non-blocking and read only when it is a regular file of
    at most :data:`MAX_CONFIG_BYTES` (a FIFO would hang the read, ``/dev/zero`` fill the
    memory). Raises ``RIVET_CONFIG_INVALID`` for anything else, ``OSError`` as ``open`` does."""
    fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_CONFIG_BYTES:
            what = file_kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else f"{st.st_size} bytes"
            raise StateError("RIVET_CONFIG_INVALID", f"pipeline config {file} is {what}: a config is a regular YAML "
                             f"file of at most {MAX_CONFIG_BYTES} bytes; nothing was read", {"file": str(file)})
        return fh.read().decode("utf-8")


def load_config(path: str | os.PathLike[str]) -> PipelineConfig:
    """Read and validate the pipeline config at ``path``.

    Raises ``RIVET_CONFIG_NOT_FOUND`` when the file is absent or unreadable and
    ``RIVET_CONFIG_INVALID`` (with ``file:line:column``) when it does not parse, is not a
    mapping, lacks ``exports``, or an export lacks a name, has an unknown mode, repeats a
    name, or a CDC export names an unknown engine.
    """
    file = Path(os.path.abspath(os.fspath(path)))
    try:
        text = _read_regular(file)
    except FileNotFoundError:
        raise StateError("RIVET_CONFIG_NOT_FOUND", f"pipeline config {file} does not exist",
                         {"file": str(file)}) from None
    except PermissionError:
        raise denied(file, "read the pipeline config") from None
    except (OSError, UnicodeDecodeError) as err:
        # an OSError's own text names the descriptor it failed on ("[Errno 21] Is a directory: 3"): the
        # message names the file, so only the reason is kept
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise StateError("RIVET_CONFIG_NOT_FOUND", f"pipeline config {file} cannot be read: {reason}",
                         {"file": str(file)}) from None
    try:
        root = yaml.compose(text, Loader=_Loader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark else str(file)
        what = err.problem or err.context
        if err.problem and err.context and err.context_mark and err.context_mark is not mark:
            # An unclosed quote or bracket is only noticed at the end of the file: say where it opened.
            start = err.context_mark
            what = f"{what} ({err.context} that starts at {file}:{start.line + 1}:{start.column + 1})"
        details = {"file": str(file)} | ({"line": mark.line + 1, "column": mark.column + 1} if mark else {})
        raise StateError("RIVET_CONFIG_INVALID", f"{where}: {what}", details) from None
    except yaml.YAMLError as err:
        raise StateError("RIVET_CONFIG_INVALID", f"{file}: {err}", {"file": str(file)}) from None
    return _Reader(file).config(root)


#: The plain scalars YAML 1.1 reads as null (PyYAML's resolver: ``~``, ``null``, ``Null``,
#: ``NULL`` and the empty scalar).
_NULLS = frozenset({"", "~", "null", "Null", "NULL"})


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """libyaml's safe loader when PyYAML has it (several times faster on large configs),
    with a resolver that only tells null from text: the reader asks a node's tag only
    whether it is null, and reads every value as the text the file holds. The full
    resolver's regular expressions, tried on every scalar, were about a quarter of the
    load of a config of 2,000 exports (issue 13). An explicit tag (``!!null``) is kept as written."""

    def resolve(self, kind: type[yaml.Node], value: str | None, implicit: tuple[bool, bool]) -> str:
        """The tag of an untagged node: null for a plain null scalar, else the kind's default."""
        if kind is yaml.ScalarNode:
            return "tag:yaml.org,2002:null" if implicit[0] and value in _NULLS else self.DEFAULT_SCALAR_TAG
        return self.DEFAULT_SEQUENCE_TAG if kind is yaml.SequenceNode else self.DEFAULT_MAPPING_TAG

    def descend_resolver(self, current_node: yaml.Node | None, current_index: object) -> None:
        """Nothing to track: the safe loader has no path resolvers."""

    def ascend_resolver(self) -> None:
        """Nothing to track: the safe loader has no path resolvers."""


class _Reader:
    """Walks the composed YAML nodes so every error can cite a line and a column."""

    def __init__(self, file: Path) -> None:
        self.file = file

    def fail(self, node: yaml.Node | None, what: str) -> StateError:
        if node is None:
            return StateError("RIVET_CONFIG_INVALID", f"{self.file}:1:1: {what}", {"file": str(self.file)})
        mark = node.start_mark
        return StateError("RIVET_CONFIG_INVALID", f"{self.file}:{mark.line + 1}:{mark.column + 1}: {what}",
                          {"file": str(self.file), "line": mark.line + 1, "column": mark.column + 1})

    def mapping(self, node: yaml.Node | None, what: str) -> dict[str, yaml.Node]:
        if not isinstance(node, yaml.MappingNode):
            raise self.fail(node, f"{what} must be a mapping")
        return {k.value: v for k, v in node.value if isinstance(k, yaml.ScalarNode)}

    def scalar(self, node: yaml.Node | None, what: str) -> str | None:
        if node is None or (isinstance(node, yaml.ScalarNode) and node.tag.endswith(":null")):
            return None
        if not isinstance(node, yaml.ScalarNode):
            raise self.fail(node, f"{what} must be a single value")
        return str(node.value)

    def config(self, root: yaml.Node | None) -> PipelineConfig:
        top = self.mapping(root, "the config")
        source = top.get("source")
        url = url_env = None
        if source is not None and not (isinstance(source, yaml.ScalarNode) and source.value in ("", "~", "null")):
            fields = self.mapping(source, "source")
            url = self.scalar(fields.get("url"), "source.url")
            url_env = self.scalar(fields.get("url_env"), "source.url_env")
            remember_secrets(url)
        exports_node = top.get("exports")
        if exports_node is None:
            raise self.fail(root, "the config lacks 'exports' (a list of exports, each with a name and a mode)")
        if not isinstance(exports_node, yaml.SequenceNode):
            raise self.fail(exports_node, "'exports' must be a list")
        exports: list[Export] = []
        seen: set[str] = set()
        for node in exports_node.value:
            export = self.export(node)
            if export.name in seen:
                raise self.fail(node, f"export '{export.name}' is declared twice")
            seen.add(export.name)
            exports.append(export)
        return PipelineConfig(self.file, url, url_env, tuple(exports))

    def export(self, node: yaml.Node) -> Export:
        fields = self.mapping(node, "an export")
        name = self.scalar(fields.get("name"), "name")
        if not name:
            raise self.fail(node, "an export has no 'name'")
        if len(lease_file_name(f"chunk-run:{name}")) > MAX_LEASE_FILE_NAME or _CONTROL.search(name):
            raise self.fail(fields.get("name"), f"export name {name[:60]!r}{'…' if len(name) > 60 else ''} is too long "
                            f"for its run lease (chunk-run:<name> percent-encoded may take {MAX_LEASE_FILE_NAME} "
                            "bytes) or holds control characters")
        mode = self.scalar(fields.get("mode"), "mode") or "full"
        if mode not in MODES:
            raise self.fail(fields.get("mode"), f"export '{name}': mode '{mode}' is not one of {', '.join(MODES)}")
        cdc = None
        if mode == "cdc":
            block = self.mapping(fields.get("cdc"), f"export '{name}': cdc") if fields.get("cdc") else {}
            engine = self.scalar(block.get("engine"), "cdc.engine")
            if engine not in CDC_ENGINES:
                raise self.fail(block.get("engine") or node,
                                f"export '{name}': cdc.engine '{engine}' is not one of {', '.join(CDC_ENGINES)}")
            cdc = CdcSpec(engine, self.scalar(block.get("checkpoint"), "cdc.checkpoint"))
        return Export(name, mode, cdc)
