"""Times as people read them in a sentence: UTC, to the second.

The state keeps its times as ISO-8601 text with microseconds (``2026-12-02T01:44:05.448002Z``
on SQLite, ``2026-12-02T01:44:05.570659+00:00`` from PostgreSQL). A message or a log line
gives them in one format, ``2026-12-02T01:44:05Z`` (issue 12 item 4; docs/decisions.md
"Times"): one word, so a sentence wrapped at spaces never splits it; the exact values
stay in ``--json`` and the audit. A table, whose cells are not wrapped, spells the same
time with a space (``render.timestamp``).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any


def parse_time(value: Any) -> datetime | None:
    """An ISO-8601 time or date (``Z`` or an offset; naive is UTC, as the state's times
    are), or a datetime, as an aware datetime in UTC; None when ``value`` is not one, or
    when its UTC falls outside the years 1 to 9999 that Python can hold
    (``9999-12-31T23:59:59-01:00`` is valid ISO-8601, and in 10000 in UTC). The one
    parser of times, the user's (``prune --before``) and the state's alike."""
    if isinstance(value, datetime):
        when = value
    else:
        try:
            when = datetime.fromisoformat(str(value))
        except ValueError:
            return None
    try:
        return when.astimezone(UTC) if when.tzinfo else when.replace(tzinfo=UTC)
    except OverflowError:
        return None


def moment(value: Any, sep: str = "T") -> str:
    """``value`` (ISO-8601 text or a datetime) in UTC to the second, ``2026-01-04T11:15:00Z``
    (``sep`` between date and time: a table gives ``" "``), the ``Z`` naming the zone.
    ``-`` for None; a text that is no time (:func:`parse_time`) is returned as it is (a
    message never fails on it)."""
    if value is None:
        return "-"
    when = parse_time(value)
    return when.strftime(f"%Y-%m-%d{sep}%H:%M:%SZ") if when else str(value)
