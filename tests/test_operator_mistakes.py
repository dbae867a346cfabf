"""Mistakes a new operator made on a fresh install, each once a crash, a leak or a wrong
verdict: every one must end with its registered code, a clear message and no change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import describe, error_object, run_cli, run_cli_process, tree_digest, write_config


def test_password_with_unencoded_at_signs_is_refused_and_never_shown(config: Path) -> None:
    url = "postgresql://u:p@ss@w0rd@localhost/db"
    for command in (["info"], ["check"], ["doctor"], ["migrate", "--sql"]):
        proc = run_cli("-c", str(config), "--json-errors", *command, env={"RIVET_STATE_URL": url})
        assert proc.returncode == 1, describe(proc)
        assert error_object(proc)["code"] == "RIVET_STATE_URL_INVALID", describe(proc)
        assert "w0rd" not in proc.stdout + proc.stderr and "p@ss" not in proc.stdout + proc.stderr, describe(proc)


def test_doctor_never_says_resumes_when_the_state_cannot_be_reached(config: Path) -> None:
    proc = run_cli("-c", str(config), "--json-errors", "doctor",
                   env={"RIVET_STATE_URL": "postgresql://u:secretpw@127.0.0.1:1/db"})
    assert proc.returncode == 2, describe(proc)
    assert error_object(proc)["code"] == "RIVET_STATE_UNREACHABLE", describe(proc)
    assert "resumes" not in proc.stdout, describe(proc)


def test_doctor_on_an_empty_state_file_reports_not_a_state(config: Path) -> None:
    (config.parent / ".rivet_state.db").write_bytes(b"")
    proc = run_cli("-c", str(config), "doctor", "--json")
    assert proc.returncode == 5, describe(proc)
    codes = {r["code"] for e in json.loads(proc.stdout)["exports"] for r in e["reasons"]}
    assert "RIVET_STATE_NOT_A_STATE" in codes, describe(proc)


@pytest.mark.postgres
def test_postgres_url_without_a_host_part_uses_the_host_parameter(config: Path, pg_server: dict[str, str]) -> None:
    socket_dir = pg_server["url"].split("host=")[1]
    url = f"postgresql:///postgres?host={socket_dir}&user=postgres&schema=nohost_{os.getpid()}"
    proc = run_cli("-c", str(config), "init", env={"RIVET_STATE_URL": url})
    assert proc.returncode == 0, describe(proc)
    proc = run_cli("-c", str(config), "check", "--json", env={"RIVET_STATE_URL": url})
    assert proc.returncode == 0, describe(proc)


@pytest.mark.postgres
def test_a_database_that_does_not_exist_is_a_wrong_url_not_a_retry(config: Path, pg_server: dict[str, str]) -> None:
    url = pg_server["url"].replace("/postgres?", "/no_such_db?")
    proc = run_cli("-c", str(config), "--json-errors", "info", env={"RIVET_STATE_URL": url})
    assert proc.returncode == 1, describe(proc)
    assert error_object(proc)["code"] == "RIVET_STATE_URL_INVALID", describe(proc)


def test_check_json_errors_reports_a_lost_cdc_checkpoint_with_its_code(config: Path) -> None:
    from statetool.runtime import StateStore

    store = StateStore.open(config, env={}, create=True)
    with store.transaction() as tx:
        tx.finish_run(tx.start_run("order_events", "cdc"), "succeeded", rows=3, files=1)
    proc = run_cli("-c", str(config), "--json-errors", "check")
    assert proc.returncode == 5, describe(proc)
    assert error_object(proc)["code"] == "RIVET_STATE_CHECKPOINT_MISSING", describe(proc)


def test_relocate_to_a_file_or_below_a_file_is_refused_and_changes_nothing(config: Path, tmp_path: Path) -> None:
    assert run_cli("-c", str(config), "init").returncode == 0
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    before = tree_digest(tmp_path)
    proc = run_cli("-c", str(config), "--json-errors", "relocate", "--to", str(blocker), "--create-dir")
    assert proc.returncode == 5 and error_object(proc)["code"] == "RIVET_STATE_TARGET_NOT_EMPTY", describe(proc)
    proc = run_cli("-c", str(config), "--json-errors", "relocate", "--to", str(blocker / "sub"), "--create-dir")
    assert proc.returncode == 1 and error_object(proc)["code"] == "RIVET_STATE_DIR_MISSING", describe(proc)
    assert tree_digest(tmp_path) == before


def test_leases_with_a_wrong_config_path_is_not_an_all_clear(tmp_path: Path) -> None:
    proc = run_cli("-c", str(tmp_path / "typo" / "rivet.yaml"), "--json-errors", "leases")
    assert proc.returncode == 1 and error_object(proc)["code"] == "RIVET_CONFIG_NOT_FOUND", describe(proc)


def test_leases_run_on_an_unmounted_state_directory_runs_nothing_and_creates_nothing(config: Path,
                                                                                     tmp_path: Path) -> None:
    missing = tmp_path / "not-mounted"
    marker = tmp_path / "ran"
    proc = run_cli_process("-c", str(config), "--json-errors", "leases", "run", "--export", "orders", "--",
                           sys.executable, "-c", f"open({str(marker)!r}, 'w')",
                           env={"RIVET_STATE_URL": f"sqlite:{missing}"})
    assert proc.returncode == 1 and error_object(proc)["code"] == "RIVET_STATE_DIR_MISSING", describe(proc)
    assert not missing.exists() and not marker.exists()


def test_leases_run_with_an_empty_export_name_is_a_usage_error(config: Path) -> None:
    assert run_cli("-c", str(config), "init").returncode == 0
    proc = run_cli_process("-c", str(config), "--json-errors", "leases", "run", "--export", "", "--", "true")
    assert proc.returncode == 1 and error_object(proc)["code"] == "RIVET_CLI_USAGE", describe(proc)
    assert not (config.parent / ".rivet_state.leases" / "chunk-run%3A").exists()


@pytest.mark.postgres
def test_sql_of_a_lossy_downgrade_needs_allow_data_loss(config: Path, pg_url: str) -> None:
    assert run_cli("-c", str(config), "init", env={"RIVET_STATE_URL": pg_url}).returncode == 0
    proc = run_cli("-c", str(config), "--json-errors", "migrate", "--to", "0002", "--sql",
                   env={"RIVET_STATE_URL": pg_url})
    assert proc.returncode == 5 and error_object(proc)["code"] == "RIVET_STATE_DATA_LOSS", describe(proc)
    assert "DROP TABLE" not in proc.stdout, describe(proc)


def test_output_to_a_log_keeps_the_url_to_set_on_one_line(tmp_path: Path) -> None:
    config = write_config(tmp_path / "a-rather-long-pipeline-directory-name" / "with-a-second-level")
    assert run_cli("-c", str(config), "init").returncode == 0
    target = tmp_path / "a-declared-state-directory-with-a-long-name-on-a-mounted-volume"
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "RIVET_STATE_URL")}
    proc = subprocess.run([sys.executable, "-m", "statetool", "-c", str(config), "relocate", "--to", str(target),
                           "--create-dir", "--dry-run"], env=env, text=True, capture_output=True, timeout=120)
    assert proc.returncode == 0, describe(proc)
    assert any(f"RIVET_STATE_URL=sqlite:{target}" in line for line in proc.stdout.splitlines()), describe(proc)
