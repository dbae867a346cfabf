"""OpenMetrics text exposition: metric families as the text a monitoring system scrapes
(issue 16 item 3; the OpenMetrics 1.0 specification, "Text format").

Pure: no I/O. The text is also valid Prometheus text format 0.0.4, which node-exporter's
textfile collector parses (docs/decisions.md, "Metrics: our own writer, one text for
both parsers"): only the ``gauge`` and ``counter`` types, no sample timestamps, and
``# UNIT`` and ``# EOF``, which that parser reads as comments.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class Family(NamedTuple):
    """One metric family: ``name`` (a counter's without ``_total``), ``kind`` ``gauge`` or
    ``counter``, ``help`` (one line, no double quote), ``unit`` (``seconds``, ``bytes``:
    the name's own suffix; empty for none)."""

    name: str
    kind: str
    help: str
    unit: str = ""


#: One sample: its family, its labels (``(name, value)`` pairs in order) and its value.
Sample = tuple[Family, tuple[tuple[str, str], ...], float]


def label_value(text: str) -> str:
    """``text`` escaped as a label value: backslash, double quote and line feed, the three
    escapes both formats define."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def number(value: float) -> str:
    """A sample value: an integral value as an integer (``3``, not ``3.0``), any other as
    Python's shortest round-tripping float (``0.25``, ``1e-05``)."""
    if float(value).is_integer() and abs(value) < 2 ** 53:
        return str(int(value))
    return repr(float(value))


def exposition(families: Iterable[Family], samples: Iterable[Sample]) -> str:
    """The text of ``samples``, family by family in the order of ``families``, each family's
    samples in the order given, then ``# EOF``. A family without samples is left out (its
    metadata alone would say nothing, and a text-format parser drops it). Each family gets
    ``# TYPE`` and ``# HELP``, and ``# UNIT`` when it has one; a counter's samples are named
    ``<name>_total``."""
    grouped: dict[str, list[Sample]] = {}
    for sample in samples:
        grouped.setdefault(sample[0].name, []).append(sample)
    lines: list[str] = []
    for family in families:
        found = grouped.get(family.name)
        if not found:
            continue
        lines += [f"# TYPE {family.name} {family.kind}", f"# HELP {family.name} {label_value(family.help)}"]
        if family.unit:
            lines.append(f"# UNIT {family.name} {family.unit}")
        name = f"{family.name}_total" if family.kind == "counter" else family.name
        for _family, labels, value in found:
            pairs = ",".join(f'{key}="{label_value(text)}"' for key, text in labels)
            lines.append(f"{name}{{{pairs}}} {number(value)}" if pairs else f"{name} {number(value)}")
    lines.append("# EOF")
    return "\n".join(lines) + "\n"
