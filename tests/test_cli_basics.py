"""The CLI surface end to end: global options anywhere, JSON documents, error objects."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from support import describe, process_env, run_cli


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


def test_the_installed_entry_point_and_the_guides_zygote_answer_alike(
        config: Path, tmp_path: Path, guide_shell: dict[str, str]) -> None:
    """The ``statetool`` script pip installed, and the zygote's client the guide tests find
    on PATH instead (tests/support/zygote.py), give the same output and exit code, read
    stdin, take redirections, and pass a signal on to the command."""
    installed = shutil.which("statetool", path=str(Path(sys.executable).parent))
    assert installed, "the statetool entry point is not installed beside the interpreter"
    assert run_cli("-c", str(config), "init").returncode == 0
    script = (f"statetool -c {config} info > out.txt; echo info=$?; "
              f"statetool -c {config} --json-errors exports set-cursor nosuch 1 2> err.txt || echo refused=$?; "
              "echo 'exports: [' | statetool -c /dev/stdin check || echo stdin=$?")
    answers = []
    for path in (str(Path(installed).parent), guide_shell["PATH"]):
        work = tmp_path / f"run-{len(answers)}"
        work.mkdir()
        env = process_env({**guide_shell, "PATH": f"{path}{os.pathsep}{os.environ.get('PATH', '')}"})
        proc = subprocess.run(["bash", "-c", script], cwd=work, env=env, text=True, capture_output=True, timeout=120)
        answers.append((proc.stdout, proc.stderr, (work / "out.txt").read_text(), (work / "err.txt").read_text()))
    assert answers[0] == answers[1], answers
    stdout, _stderr, info, refused = answers[0]
    # a config that does not parse decides check's exit (1), whatever the state (none beside /dev)
    assert "info=0" in stdout and "refused=1" in stdout and "stdin=1" in stdout, answers[0]
    assert "/dev/stdin is a FIFO" in stdout and "sqlite" in info  # stdin is the pipe, stdout the file
    assert json.loads(refused.splitlines()[-1])["code"] == "RIVET_EXPORT_UNKNOWN"
    env = process_env(guide_shell)
    proc = subprocess.Popen(["statetool", "-c", str(config), "leases", "run", "--export", "orders", "--",
                             "sleep", "60"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(row.get("child_pid") for row in json.loads(run_cli("-c", str(config), "--json",
                                                                     "leases").stdout)["leases"]):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)  # until the command runs: leases run forwards signals from then on
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM  # the command's code, as leases run reports it
