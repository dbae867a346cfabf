"""A hostile or broken environment (SPEC §8a): nothing of the state's own is followed, user
text is never markup, bad numbers are refused, and a database that refuses a write says so.

Each test names the class of fault it closes; the inputs are the ones operators tried.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import describe, run_cli, tree_digest, write_config
from statetool.errors import StateError
from statetool.operations.context import MAX_LOCK_WAIT, Context


def _error(proc: object) -> dict[str, object]:
    return json.loads(proc.stderr.strip().splitlines()[-1])  # type: ignore[attr-defined]


@pytest.fixture
def state(tmp_path: Path) -> Path:
    """A config with a state beside it (``statetool init``); returns the config path."""
    config = write_config(tmp_path / "pipeline")
    proc = run_cli("-c", str(config), "init")
    assert proc.returncode == 0, describe(proc)
    return config


@pytest.mark.parametrize("where", ["sidecar", "folder"])
def test_a_symlink_where_a_lease_file_belongs_is_refused_and_its_target_is_never_written(
        state: Path, tmp_path: Path, where: str) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    leases = state.parent / ".rivet_state.leases"
    if where == "sidecar":
        leases.mkdir(exist_ok=True)
        (leases / "chunk-run%3Aorders").symlink_to(victim)
    else:
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (elsewhere / "chunk-run%3Aorders").symlink_to(victim)
        leases.symlink_to(elsewhere)
    before = tree_digest(state.parent)
    for args in (("exports", "set-cursor", "orders", "2026-01-01"), ("leases", "run", "--export", "orders", "--", "true")):
        proc = run_cli("-c", str(state), "--json-errors", "--lock-wait", "0", *args)
        assert proc.returncode == 5 and _error(proc)["code"] == "RIVET_STATE_UNSAFE_FILE", describe(proc)
        assert victim.read_text() == "precious\n", describe(proc)
        assert tree_digest(state.parent) == before, describe(proc)


def test_a_lease_folder_that_is_a_plain_file_is_refused_unsafe_not_internal(state: Path) -> None:
    (state.parent / ".rivet_state.leases").write_text("not a folder\n")
    before = tree_digest(state.parent)
    proc = run_cli("-c", str(state), "--json-errors", "--lock-wait", "0", "leases", "run", "--export", "orders",
                   "--", "true")
    assert proc.returncode == 5 and _error(proc)["code"] == "RIVET_STATE_UNSAFE_FILE", describe(proc)
    assert tree_digest(state.parent) == before


def test_a_fifo_where_a_lease_file_belongs_is_refused_without_blocking(state: Path) -> None:
    leases = state.parent / ".rivet_state.leases"
    leases.mkdir(exist_ok=True)
    os.mkfifo(leases / "chunk-run%3Aorders")
    proc = run_cli("-c", str(state), "--json-errors", "--lock-wait", "0", "leases", "run", "--export", "orders",
                   "--", "true", timeout=30)
    assert proc.returncode == 5 and _error(proc)["code"] == "RIVET_STATE_UNSAFE_FILE", describe(proc)


def test_text_that_looks_like_markup_is_printed_as_it_is_and_never_crashes(state: Path) -> None:
    proc = run_cli("--state-url", "sqlite:[/x]", "-c", str(state), "info")
    assert proc.returncode == 1, describe(proc)
    assert "'[/x]'" in proc.stderr and "Traceback" not in proc.stderr, describe(proc)
    assert "RIVET_STATE_DIR_RELATIVE" in proc.stderr, describe(proc)

    cursor = "[bold red]2026[/bold red][/x]"
    proc = run_cli("-c", str(state), "exports", "set-cursor", "orders", cursor)
    assert proc.returncode == 0, describe(proc)
    for args in (("info",), ("exports", "show", "orders"), ("check",)):
        proc = run_cli("-c", str(state), *args)
        assert "Traceback" not in proc.stderr and proc.returncode in (0, 5), describe(proc)
    shown = run_cli("-c", str(state), "exports", "show", "orders")
    assert "[bold red]2026" in shown.stdout, describe(shown)


def test_a_lock_wait_past_its_documented_maximum_is_refused_as_usage(state: Path) -> None:
    proc = run_cli("-c", str(state), "--json-errors", "--lock-wait", "3000000", "leases", "run", "--export", "orders",
                   "--", "true")
    assert proc.returncode == 1 and _error(proc)["code"] == "RIVET_CLI_USAGE", describe(proc)
    with pytest.raises(StateError) as err:
        Context(state, lock_wait=MAX_LOCK_WAIT + 1)
    assert err.value.code == "RIVET_CLI_USAGE" and "7 days" in err.value.message
    assert Context(state, lock_wait=MAX_LOCK_WAIT).lock_wait == MAX_LOCK_WAIT
