"""The one check of a number an option takes (issue 16 item 2, a fresh user's finding 2).

The argument parser checks an option's range where it declares one, but lets ``nan``
through any range of floats (``nan < 0`` is false, and so is every comparison with it),
and an operation called from Python has no parser in front of it: each operation checks
its numbers here, so ``--keep 99999999999999999999``, ``--older-than nan``,
``--older-than inf`` and ``--keep-runs -1`` are one clear ``RIVET_CLI_USAGE`` naming the
option and its range, whoever calls. And the one way a size in bytes is told to a person
(:func:`size_text`, in messages and on pages alike). Loaded at start-up (no import of its
own).
"""

from statetool.errors import StateError

#: The most a count of things to keep may be (``prune --keep-runs``, ``backups prune --keep``):
#: beyond any real history, and within every backend's integer.
MAX_KEEP = 1_000_000_000
#: The most days ``backups prune --older-than`` may say (about 2,700 years).
MAX_DAYS = 1_000_000


def require_within(option: str, value: float, low: float, high: float, unit: str = "") -> None:
    """Raise ``RIVET_CLI_USAGE`` (``--older-than nan is outside 0 to 1000000 days``) unless
    ``value`` is a number from ``low`` to ``high``, both included: ``nan`` and the
    infinities never are (the one comparison is written so that ``nan`` fails it).
    ``unit`` is the words after the range (``days``, ``seconds (7 days)``)."""
    if not low <= value <= high:
        raise StateError("RIVET_CLI_USAGE", f"{option} {_shown(value)} is outside {_shown(low)} to {_shown(high)}"
                         f"{' ' + unit if unit else ''}")


def size_text(n: int) -> str:
    """A size in bytes as ``45056 bytes (44 KiB)``: the number as ``--json`` has it, to
    compare, and what a person reads (``bytes`` alone below 1 KiB)."""
    scaled, unit = float(n), "bytes"
    for name in ("KiB", "MiB", "GiB", "TiB"):
        if scaled < 1024:
            break
        scaled, unit = scaled / 1024, name
    return f"{n} bytes" if unit == "bytes" else f"{n} bytes ({scaled:.0f} {unit})"


def _shown(number: float) -> str:
    """An integer whole (``1000000000``), a float short (``nan``, ``1e+300``, ``0.5``)."""
    return f"{number:g}" if isinstance(number, float) else str(number)
