"""The CLI surface end to end: global options anywhere, JSON documents, error objects."""

from __future__ import annotations

import json
from pathlib import Path

from support import describe, run_cli


def test_init_then_info_on_sqlite_beside_config(config: Path) -> None:
    proc = run_cli("-c", str(config), "init")
    assert proc.returncode == 0, describe(proc)
    proc = run_cli("info", "--json", "-c", str(config))
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    assert {"location", "revision", "identity", "exports", "warnings"} <= set(doc)
    assert doc["revision"]["status"] == "head"
    assert doc["identity"]["recorded"] == "postgresql://db.internal:5432/sales"


def test_init_then_check_on_postgres(config: Path, pg_url: str) -> None:
    proc = run_cli("-c", str(config), "init", env={"RIVET_STATE_URL": pg_url})
    assert proc.returncode == 0, describe(proc)
    proc = run_cli("-c", str(config), "check", "--json", env={"RIVET_STATE_URL": pg_url})
    assert proc.returncode == 0, describe(proc)
    assert json.loads(proc.stdout)["ok"] is True
