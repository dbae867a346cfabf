"""The one ``--json-errors`` parser (docs/errors.md "The --json-errors object", SPEC §7).

Every test that reads the error object of a failed run reads it through
:func:`error_object`, which is as strict as the contract: the object is the one JSON line
on stderr and its last line, parsed without NaN or duplicate keys, with exactly the
documented keys, each consistent with the code's registry entry and with the run's exit
code; every entry of ``failures`` is such an object of its own plus ``export`` (and ``config``: a
fleet's pipeline, whose ``export`` may be null).
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from statetool.errors import EXIT_CODES, REGISTRY, WARNINGS

#: The keys of the object, every one always present (docs/errors.md).
OBJECT_KEYS = frozenset({"error", "exit_class", "code", "kind", "class", "exit_code", "retryable", "action",
                         "message", "failures"})
#: The keys of one entry of ``failures``: the object's own, without ``failures``, plus ``export`` (and
#: ``config`` in a fleet: several pipelines at once, docs/commands.md).
FAILURE_KEYS = (OBJECT_KEYS - {"failures"}) | {"export"}


class Run(Protocol):
    """What a CLI run offers: ``returncode``, ``stdout``, ``stderr`` (text)."""

    returncode: int
    stdout: str
    stderr: str


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    assert len(keys) == len(set(keys)), f"duplicate keys in the error object: {keys}"
    return dict(pairs)


def _no_constant(name: str) -> None:
    raise AssertionError(f"{name} is not JSON (the error object must parse strictly)")


def _check_fields(obj: dict[str, Any], where: str) -> None:
    """The documented consistency of one object: message twice, the code's registry entry."""
    assert isinstance(obj["error"], str) and obj["error"] == obj["message"], f"{where}: error != message: {obj}"
    assert type(obj["exit_code"]) is int and type(obj["exit_class"]) is int, f"{where}: exit codes not ints: {obj}"
    assert obj["exit_code"] == obj["exit_class"], f"{where}: exit_code != exit_class: {obj}"
    assert type(obj["retryable"]) is bool, f"{where}: retryable not a bool: {obj}"
    code = obj["code"]
    if code in REGISTRY:
        entry = REGISTRY[code]
        expected = {"kind": entry.kind, "class": entry.exit_class, "exit_code": entry.exit_code,
                    "retryable": entry.retryable, "action": entry.action}
    else:
        assert code in WARNINGS, f"{where}: {code!r} is neither a registered code nor a registered warning"
        expected = {"kind": "warning", "class": "refusal", "exit_code": EXIT_CODES["refusal"], "retryable": False,
                    "action": WARNINGS[code]}
    actual = {key: obj[key] for key in expected}
    assert actual == expected, f"{where}: {code} does not match its registry entry: {actual} vs {expected}"


def error_object(run: Run) -> dict[str, Any]:
    """The ``--json-errors`` object of a failed ``run`` (``{"error", "exit_class", "code",
    "kind", "class", "exit_code", "retryable", "action", "message", "failures"}``), after
    asserting that stderr holds exactly one JSON line, as its last line, that it parses
    strictly, has exactly the documented keys consistent with the code's registry entry
    (or registered warning), that each ``failures`` entry is such an object plus ``export`` (and ``config``),
    and that the run exited with the object's ``exit_code``."""
    from support.cli import describe

    lines = run.stderr.rstrip("\n").splitlines()
    json_lines = [line for line in lines if line.lstrip().startswith("{")]
    assert len(json_lines) == 1, f"expected exactly one JSON line on stderr\n{describe(run)}"
    assert lines[-1] == json_lines[0], f"the error object is not the last line of stderr\n{describe(run)}"
    obj = json.loads(lines[-1], object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    assert isinstance(obj, dict), f"the error line is not a JSON object\n{describe(run)}"
    assert set(obj) == OBJECT_KEYS, f"keys {sorted(obj)} are not the documented {sorted(OBJECT_KEYS)}"
    _check_fields(obj, "error object")
    assert isinstance(obj["failures"], list), f"failures is not a list: {obj}"
    for i, unit in enumerate(obj["failures"]):
        assert isinstance(unit, dict) and set(unit) in (FAILURE_KEYS, FAILURE_KEYS | {"config"}), \
            f"failures[{i}] keys: {unit}"
        fleet = "config" in unit  # a pipeline of a fleet: about one export, or about the whole pipeline
        assert isinstance(unit["export"], str) and unit["export"] or (fleet and unit["export"] is None), \
            f"failures[{i}] names no export: {unit}"
        assert not fleet or isinstance(unit["config"], str) and unit["config"], f"failures[{i}] names no config"
        _check_fields(unit, f"failures[{i}]")
    assert run.returncode == obj["exit_code"], f"exit {run.returncode} but the object says {obj['exit_code']}"
    return obj  # type: ignore[no-any-return]
