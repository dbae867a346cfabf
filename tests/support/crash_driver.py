"""Run ``relocate``, ``transfer``, ``migrate``, ``restore``, ``checkpoints import|export`` or
``prune`` in a real process that SIGKILLs itself at one named step (the crash tests of
tests/test_relocate.py, tests/test_transfer.py, tests/test_migrate_crashes.py,
tests/test_restore_crashes.py, tests/test_position_crashes.py and tests/test_prune.py), forked
from the test process's fork server
(:mod:`support.forked`) so that it starts with statetool imported.

The hook is the operation's own: :attr:`statetool.operations.context.Context.on_step` is
told each step's name (``relocate.CRASH_POINTS``, ``copy-page-<n>``, ``migrate.CRASH_POINTS``,
``restore.CRASH_POINTS``, ``restore.CREATE_POINTS``, ``positions.CRASH_POINTS``,
``positions.EXPORT_POINTS``, prune's ``archived-<n>``, ``deleted-<n>``, ``committed-<n>``);
this driver builds
the Context the CLI would, with an ``on_step`` that kills the process at ``POINT``.
Nothing in statetool reads the environment for it. As a script::

    python tests/support/crash_driver.py POINT -c CONFIG [--state-url URL] [--lock-wait S] \
        relocate --to DIR [--full-verify] [--create-dir]
    python tests/support/crash_driver.py POINT -c CONFIG transfer --to URL [--with-checkpoints]
    python tests/support/crash_driver.py POINT -c CONFIG migrate
    python tests/support/crash_driver.py POINT -c CONFIG [--state-url URL] restore WHAT [--allow-older] [--if-absent]
    python tests/support/crash_driver.py POINT -c CONFIG [--state-url URL] checkpoints import|export [--export NAME]
    python tests/support/crash_driver.py POINT -c CONFIG prune [--before DATE] [--keep-runs N] [--batch-size N] \
        [--archive FILE]

It exits 3 when the operation ended without passing ``POINT`` (a wrong name, or a path that
does not pass there); a failure of the operation is its traceback and exit 1.

``POINT`` may also be ``FAULT@STEP``: at ``STEP`` the driver does not kill the move but
writes a fault into one of its files, from outside the move's code, and lets it go on
(relocate only; the move's ``StateError`` then ends the driver with ``CODE: message`` on
stderr and the code's exit status):

* ``scribble-copy``: one byte of the copy's second page (``<to>/.rivet_state.db.relocating``)
  is changed, after the move wrote it (what a faulty disk, cache or another process does);
* ``rewrite-source``: the source's second page is written again with its own bytes by
  another open of the file, past the SQLite write lock (a writer that ignores the lock).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

DRIVER = Path(__file__).resolve()


def run_killed_at(point: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run :func:`main` in a process forked from the test's fork server
    (:mod:`support.forked`; the environment of :func:`support.cli.process_env`): the move
    of ``args`` (statetool's own arguments), killed at ``point``."""
    from support.cli import process_env  # here: run as a script, this file has no support package
    from support.forked import fork_call

    proc = fork_call(f"{__name__}:main", point, *args, env=process_env())
    try:
        stdout, stderr = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess([str(DRIVER), point, *args], proc.wait(), stdout, stderr)


def main(argv: list[str]) -> int:
    from statetool.backends.sqlite_file import page_size_of
    from statetool.location import DEFAULT_CONFIG
    from statetool.operations.context import Context
    from statetool.redact import command_line

    point, args = argv[0], argv[1:]
    parser = argparse.ArgumentParser(prog="crash_driver")
    parser.add_argument("-c", "--config", type=Path, default=Path(DEFAULT_CONFIG))
    parser.add_argument("--state-url")
    parser.add_argument("--lock-wait", type=float, default=600.0)
    verbs = parser.add_subparsers(dest="verb", required=True)
    relocate = verbs.add_parser("relocate")
    relocate.add_argument("--to", required=True)
    relocate.add_argument("--full-verify", action="store_true")
    relocate.add_argument("--create-dir", action="store_true")
    transfer_verb = verbs.add_parser("transfer")
    transfer_verb.add_argument("--to", required=True)
    transfer_verb.add_argument("--with-checkpoints", action="store_true")
    verbs.add_parser("migrate")
    restore = verbs.add_parser("restore")
    restore.add_argument("what")
    restore.add_argument("--allow-older", action="store_true")
    restore.add_argument("--if-absent", action="store_true")
    positions = verbs.add_parser("checkpoints")
    positions.add_argument("direction", choices=("import", "export"))
    positions.add_argument("--export")
    prune_verb = verbs.add_parser("prune")
    prune_verb.add_argument("--before")
    prune_verb.add_argument("--keep-runs", type=int)
    prune_verb.add_argument("--batch-size", type=int, default=1000)
    prune_verb.add_argument("--archive", type=Path)
    options = parser.parse_args(args)

    fault, _, step = point.rpartition("@")

    def on_step(name: str) -> None:
        if name != step:
            return
        if not fault:
            os.kill(os.getpid(), signal.SIGKILL)
        source = ctx.location.real_path or ctx.location.path
        assert source is not None
        page_size = page_size_of(source.read_bytes()[:100])
        if fault == "scribble-copy":
            with open(Path(options.to) / ".rivet_state.db.relocating", "r+b") as fh:
                fh.seek(page_size + 17)
                byte = fh.read(1)
                fh.seek(page_size + 17)
                fh.write(bytes([byte[0] ^ 0xFF]))
        elif fault == "rewrite-source":
            with open(source, "r+b") as fh:
                fh.seek(page_size)
                page = fh.read(page_size)
                time.sleep(0.01)  # a later modification time than the copy's start, on any clock granularity
                fh.seek(page_size)
                fh.write(page)
        else:
            raise SystemExit(f"crash_driver: no fault {fault!r}")

    ctx = Context(options.config, options.state_url, dict(os.environ), options.lock_wait,
                  command_line(["statetool", *args]), on_step=on_step)
    if options.verb == "relocate":
        from statetool.errors import StateError
        from statetool.operations.relocate import relocate as move

        try:
            move(ctx, options.to, create_dir=options.create_dir, full_verify=options.full_verify)
        except StateError as err:
            if not fault:
                raise
            sys.stderr.write(f"{err.code}: {err.message}\n")
            return err.exit_code
    elif options.verb == "migrate":
        from statetool.operations.migrate import migrate

        migrate(ctx)
    elif options.verb == "prune":
        from statetool.operations.retention import prune_history

        prune_history(ctx, before=options.before, keep_runs=options.keep_runs, batch_size=options.batch_size,
                      archive=options.archive)
    elif options.verb == "restore":
        from statetool.operations.restore import restore as put_back

        put_back(ctx, options.what, allow_older=options.allow_older, if_absent=options.if_absent)
    elif options.verb == "checkpoints":
        from statetool.operations.positions import export_positions, import_positions

        (import_positions if options.direction == "import" else export_positions)(ctx, options.export)
    else:
        from statetool.operations.transfer import transfer

        transfer(ctx, options.to, with_checkpoints=options.with_checkpoints)
    sys.stderr.write(f"crash_driver: the {options.verb} ended without passing {point}\n")
    return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
