"""Files the tests write and compare: a pipeline config, the digest of a directory tree."""

from __future__ import annotations

import hashlib
import json
import textwrap
from pathlib import Path


#: An incremental export and four CDC exports, one per engine and place of its position: a
#: relative mysql file, a relative mongodb file, a postgres stream with no file (its slot), an
#: oracle file at ``{absolute}`` (``str.format`` it).
CDC_EXPORTS = textwrap.dedent("""\
    exports:
      - name: orders
        mode: incremental
      - name: order_events
        mode: cdc
        cdc:
          engine: mysql
          checkpoint: checkpoints/order_events.json
      - name: carts
        mode: cdc
        cdc:
          engine: mongodb
          checkpoint: carts.pos
      - name: ledger
        mode: cdc
        cdc:
          engine: postgres
      - name: audit
        mode: cdc
        cdc:
          engine: oracle
          checkpoint: {absolute}
    """)


def write_config(directory: Path, *, source_url: str | None = "postgresql://reader@db.internal:5432/sales",
                 exports: str | None = None, name: str = "rivet.yaml",
                 checkpoint: str = "checkpoints/order_events.json") -> Path:
    """Write a pipeline config into ``directory`` (created) and return its path: the
    source ``source_url`` (none when ``None``) and ``exports`` (YAML text; default
    orders/incremental, order_lines/chunked, order_events/cdc with its position in the
    file ``checkpoint``)."""
    directory.mkdir(parents=True, exist_ok=True)
    source = f"source:\n  url: {source_url}\n" if source_url else ""
    body = exports or textwrap.dedent(f"""\
        exports:
          - name: orders
            mode: incremental
          - name: order_lines
            mode: chunked
          - name: order_events
            mode: cdc
            cdc:
              engine: mysql
              checkpoint: {checkpoint}
        """)
    path = directory / name
    path.write_text(source + body)
    return path


def declare_export(config: Path, name: str, mode: str = "full") -> None:
    """Add export ``name`` to the end of the ``exports`` list of ``config`` (written by
    :func:`write_config`): what an operator does before the first run of a new export."""
    config.write_text(config.read_text().rstrip("\n") + f"\n  - name: {json.dumps(name)}\n    mode: {mode}\n")


def tree_digest(directory: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file below ``directory`` (the byte-identical check)."""
    out = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            out[str(path.relative_to(directory))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out
