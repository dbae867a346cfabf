"""The error registry, the one error type, and the error object (SPEC §7).

The registry is the only place that maps a code to its kind, exit class, exit code,
retryable flag and action. Everything else raises :class:`StateError` with a code and a
message, and the CLI turns it into text or the ``--json-errors`` object through
:func:`error_object`.
"""

import signal
from typing import Any

#: Exit classes: name -> exit code (SPEC §7).
EXIT_CODES: dict[str, int] = {
    "generic": 1,
    "retryable": 2,
    "schema_drift": 3,
    "data_integrity": 4,
    "refusal": 5,
    "internal": 6,
}

#: The exit code of a command interrupted by Ctrl-C: 128 + SIGINT, the shell's convention
#: for a process ended by a signal (no class of the registry: nothing failed, nothing was committed).
EXIT_INTERRUPTED = 128 + int(signal.SIGINT)

#: Which class wins when several checks fail at once: the more specific instruction
#: first (data_integrity > internal > refusal > schema_drift > retryable > generic).
STOP_RANK: dict[str, int] = {
    "generic": 0,
    "retryable": 1,
    "schema_drift": 2,
    "refusal": 3,
    "internal": 4,
    "data_integrity": 5,
}


class Entry(tuple[str, str, str, int]):
    """One registered code: its kind (what happened), class (what to do), action and exit
    code; a ``(kind, exit_class, action, exit_code)`` tuple, immutable and equal by value.
    The exit code is the class's (:data:`EXIT_CODES`), except for a code whose exit a
    convention older than statetool fixes (a command ``leases run`` cannot start: 126 or
    127, as a shell exits; docs/decisions.md, "A command that cannot start").

    The registry's classes are plain (no ``dataclasses``, and no ``NamedTuple``, whose class
    costs more to create than the registry itself: it compiles its ``__new__``): this module
    loads at every start-up, ``statetool --help`` included (issue 13 item 5)."""

    __slots__ = ()

    def __new__(cls, kind: str, exit_class: str, action: str, exit_code: int | None = None) -> "Entry":
        return super().__new__(cls, (kind, exit_class, action,
                                     EXIT_CODES[exit_class] if exit_code is None else exit_code))

    def __repr__(self) -> str:
        return (f"Entry(kind={self.kind!r}, exit_class={self.exit_class!r}, action={self.action!r}, "
                f"exit_code={self.exit_code!r})")

    @property
    def kind(self) -> str:
        """What happened: ``usage``, ``config``, ``environment``, ``busy``, ``schema``, ..."""
        return self[0]

    @property
    def exit_class(self) -> str:
        """What to do: the exit class (a key of :data:`EXIT_CODES`)."""
        return self[1]

    @property
    def action(self) -> str:
        """The registered action: what the operator does next (the ``Try:`` line)."""
        return self[2]

    @property
    def exit_code(self) -> int:
        """The process exit code: the class's (1-6), or the one the entry fixes (126, 127)."""
        return self[3]

    @property
    def retryable(self) -> bool:
        """True when a re-run without human action may succeed (class ``retryable``)."""
        return self.exit_class == "retryable"


def _e(kind: str, exit_class: str, action: str, exit_code: int | None = None) -> Entry:
    return Entry(kind, exit_class, action, exit_code)


#: The exit codes of a command that cannot be started, as a shell gives them (POSIX,
#: "Consequences of Shell Errors"; coreutils' env, nohup and timeout too): found but not
#: executable, and not found.
EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND = 126, 127


REGISTRY: dict[str, Entry] = {
    # generic (1): fix the input
    "RIVET_STATE_URL_INVALID": _e(
        "usage", "generic",
        "set RIVET_STATE_URL (or --state-url) to one of: empty (beside the config), "
        "sqlite:/absolute/dir, postgresql://host/db?schema=NAME (a '?' before the first parameter, "
        "'&' before each further one: ?host=/run/postgresql&schema=NAME)",
    ),
    "RIVET_STATE_DIR_RELATIVE": _e(
        "usage", "generic",
        "give the state directory as an absolute path (sqlite:/srv/rivet/state), the same on every task",
    ),
    "RIVET_CONFIG_NOT_FOUND": _e(
        "config", "generic", "pass the pipeline config with --config/-c PATH (default ./rivet.yaml)",
    ),
    "RIVET_CONFIG_INVALID": _e(
        "config", "generic", "fix the config at the file, line and column named in the message",
    ),
    "RIVET_CLI_USAGE": _e(
        "usage", "generic", "see statetool --help, or statetool COMMAND --help",
    ),
    "RIVET_EXPORT_UNKNOWN": _e(
        "usage", "generic", "name an export of the config or of the state (statetool exports list)",
    ),
    "RIVET_STATE_REVISION_UNKNOWN": _e(
        "usage", "generic", "name a revision that statetool revisions lists, or head",
    ),
    "RIVET_STATE_DIR_MISSING": _e(
        "usage", "generic",
        "mount or create the declared state directory first (a sqlite: location names a directory, never a "
        "file); statetool never creates it, "
        "because a missing mount would hide the real state",
    ),
    "RIVET_STATE_SQL_UNSUPPORTED": _e(
        "usage", "generic",
        "--sql is for PostgreSQL states; a SQLite upgrade is built in a verified copy that replaces the state, "
        "the original kept as the backup (statetool migrate --dry-run shows the plan)",
    ),
    "RIVET_STATE_BACKEND_UNSUPPORTED": _e(
        "usage", "generic",
        "relocate moves SQLite states; transfer moves between SQLite and PostgreSQL or between PostgreSQL "
        "schemas, never to where the state is: check RIVET_STATE_URL and the destination",
    ),
    "RIVET_STATE_AUTH_FAILED": _e(
        "environment", "generic", "check the user and password of the state URL",
    ),
    "RIVET_STATE_KEY_UNCOMPUTABLE": _e(
        "usage", "generic",
        "set the source URL (source.url, or the variable source.url_env names) so the state key can be computed",
    ),
    "RIVET_SOURCE_URL_INVALID": _e(
        "config", "generic",
        "percent-encode the password of the source URL (source.url, the variable source.url_env names, or "
        "identity rekey --new): '/' %2F, '?' %3F, '#' %23, '@' %40, a space %20",
    ),
    "RIVET_STATE_LEASE_KEY_INVALID": _e(
        "usage", "generic",
        "name a lease as statetool leases lists it: chunk-run:<export>, load-table:<table>, staging:<prefix> "
        "or state:exclusive",
    ),
    "RIVET_STATE_LEASE_UNKNOWN": _e(
        "usage", "generic", "statetool leases lists every lease this state has; release one of those",
    ),
    "RIVET_STATE_BACKUP_UNKNOWN": _e(
        "usage", "generic", "statetool backups list names every backup and keep beside the state; name one of those, "
        "or give the path of a state file",
    ),
    # generic (fix the input), with a shell's exit codes: `leases run` exits as its command would
    "RIVET_COMMAND_NOT_FOUND": _e(
        "usage", "generic",
        "check the command after --: give its path, or put its directory on the PATH of the task that runs "
        "statetool",
        EXIT_NOT_FOUND,
    ),
    "RIVET_COMMAND_NOT_EXECUTABLE": _e(
        "usage", "generic",
        "make the file after -- executable (chmod +x), fix its #! line, or name its interpreter first "
        "(-- sh job.sh)",
        EXIT_NOT_EXECUTABLE,
    ),
    # generic, not retryable: the database itself refuses, the same way on every re-run.
    "RIVET_STATE_WRITE_REFUSED": _e(
        "environment", "generic",
        "the state database refused the write (a constraint or a trigger, named in the message): fix that on the "
        "database side, then re-run; nothing was written",
    ),
    "RIVET_STATE_READ_ONLY": _e(
        "environment", "generic",
        "the place the message names (the state's filesystem, a checkpoint file's directory) is on a filesystem mounted "
        "read-only: mount it read-write (or run only read commands), then re-run; "
        "on PostgreSQL, point the state URL at the primary server, or turn default_transaction_read_only off for "
        "the role or database (the message says which)",
    ),
    "RIVET_STATE_PERMISSION_DENIED": _e(
        "environment", "generic",
        "run as the user that owns the file named in the message (or grant this user access to it and to each "
        "directory above it), then re-run; on PostgreSQL, run the GRANT statements the message prints (as the "
        "owner it names, or a superuser), or use a role that has those rights",
    ),
    # generic, not retryable: a re-run fails the same way until someone frees space.
    "RIVET_STATE_DISK_FULL": _e(
        "environment", "generic",
        "free space on the filesystem named in the message, or files where it says no inode is left (or choose "
        "a directory on a larger one), then re-run; the state was left as it was",
    ),
    # CDC positions, the write side (issue 15, the fresh user's findings)
    "RIVET_STATE_POSITION_TOO_LARGE": _e(
        "usage", "generic",
        "keep a CDC position under 1 MiB of JSON, what a checkpoint file may hold: commit only the engine's position "
        "(a log file and offset, a resume token), never data; nothing was written, and a position already in the "
        "state stays there",
    ),
    "RIVET_STATE_POSITION_TOO_DEEP": _e(
        "usage", "generic",
        "commit only the engine's position (a log file and offset, a resume token), which nests a few levels: a CDC "
        "position may nest at most 64 levels of JSON arrays and objects; nothing was written, and a position already "
        "in the state stays there",
    ),
    "RIVET_STATE_CHECKPOINT_MOUNTED": _e(
        "environment", "generic",
        "mount the checkpoint file's directory rather than the file alone (no rename can move a file mounted by "
        "itself), or move its position into the state where the file is an ordinary file; nothing was written",
    ),
    # statetool prune (issue 16 item 2): a failure after some of its batches committed
    "RIVET_STATE_PRUNE_INCOMPLETE": _e(
        "environment", "generic",
        "the batches the message names stay removed, audited and archived; fix the cause it names (its code stands "
        "in parentheses after it), then run the same prune again (with --archive naming a new file): it removes the "
        "rest",
    ),
    "RIVET_STATE_CHECKPOINT_NOT_RENAMED": _e(
        "environment", "generic",
        "nothing is lost: the position is in the state, which every run reads; make the checkpoint file's directory "
        "writable, then run the command the message names (it only renames the file), or move the file aside",
    ),
    # statetool metrics --textfile PATH (issue 16 item 3)
    "RIVET_METRICS_DIR_MISSING": _e(
        "usage", "generic",
        "create the directory of --textfile PATH first (node-exporter's --collector.textfile.directory), or name "
        "a file in one that exists; metrics creates no directory",
    ),
    "RIVET_PLACE_HOLDS_NO_FILES": _e(
        "usage", "generic",
        "name a file on a filesystem that stores files (a disk, a volume, a tmpfs); /proc, /sys and the other "
        "kernel filesystems hold only the kernel's own entries",
    ),
    "RIVET_METRICS_TEXTFILE_UNWRITABLE": _e(
        "environment", "generic",
        "name a --textfile PATH in a directory this user may create files in, on a filesystem mounted read-write "
        "(node-exporter's --collector.textfile.directory, writable by the user cron or the timer runs metrics as), "
        "or make that directory so; nothing was written",
    ),
    # retryable (2): a re-run without human action may succeed
    "RIVET_STATE_UNREACHABLE": _e(
        "transient", "retryable", "check that the state database is up and reachable, then re-run",
    ),
    "RIVET_STATE_LOCK_TIMEOUT": _e(
        "busy", "retryable", "re-run when the holder has finished, or raise --lock-wait",
    ),
    "RIVET_STATE_RUN_IN_PROGRESS": _e(
        "busy", "retryable", "re-run when the run named in the message has finished",
    ),
    "RIVET_STATE_CHANGED_DURING_READ": _e(
        "busy", "retryable", "run the command again: a live run wrote the state while it was read",
    ),
    "RIVET_STATE_UPGRADE_BESIDE_LIVE_RUN": _e(
        "busy", "retryable", "re-run the migration when the runs named in the message have finished",
    ),
    "RIVET_STATE_LEASE_LOST": _e(
        "busy", "retryable",
        "another holder took the lease over (this holder stalled past its TTL, or its lease was released); "
        "nothing was written under the lost lease: re-run",
    ),
    "RIVET_STATE_MIGRATION_LOCKED": _e(
        "environment", "retryable",
        "another migration holds the state; re-run when it has finished, or raise --lock-wait",
    ),
    # schema_drift (3): the schema is not what this release expects
    "RIVET_STATE_SCHEMA_NEWER": _e(
        "schema", "schema_drift",
        "use the statetool release that wrote this state (or newer); never open it with an older one",
    ),
    "RIVET_STATE_SCHEMA_UNEXPECTED": _e(
        "schema", "schema_drift",
        "the state was left as it was; make its tables match its revision (docs/setup-guides/upgrading-a-state.md) "
        "or restore a backup made by statetool, then re-run statetool migrate",
    ),
    "RIVET_STATE_MIGRATION_PENDING": _e(
        "schema", "schema_drift", "run statetool migrate (statetool migrate --dry-run shows the plan)",
    ),
    "RIVET_STATE_EXPORT_FORMAT": _e(
        "schema", "schema_drift",
        "give a file that statetool export wrote (format rivet-state/1); a file of a newer format is read by "
        "the release that wrote it",
    ),
    # data_integrity (4): the state is damaged
    "RIVET_STATE_CORRUPT": _e(
        "integrity", "data_integrity",
        "restore the state from its latest backup (.rivet_state.db.backup-*); do not run a pipeline on it",
    ),
    "RIVET_STATE_INTERRUPTED_WRITE": _e(
        "integrity", "data_integrity",
        "a writer was killed mid-transaction; open the state once with a writing command "
        "(statetool migrate, or the pipeline) so SQLite rolls the hot journal back, then re-run",
    ),
    "RIVET_STATE_CHECKPOINT_UNREADABLE": _e(
        "integrity", "data_integrity",
        "restore the checkpoint file from a backup; if none exists, reset the export on purpose",
    ),
    "RIVET_STATE_POSITION_INVALID": _e(
        "integrity", "data_integrity",
        "the state's position row for the export named holds no position (JSON null, text that is not JSON, or JSON "
        "nested deeper than 64 levels): "
        "write the right position to the export's checkpoint file and run statetool checkpoints import --export NAME, "
        "which replaces the row with it (audited, the row's old text kept in the audit row), or restore the state "
        "from a backup made by statetool; a run never falls back to the checkpoint file while the row is there",
    ),
    "RIVET_STATE_VERIFY_FAILED": _e(
        "integrity", "data_integrity",
        "the state was left as it was before; report this with the message, and keep the backup it names",
    ),
    # refusal (5): refused on purpose to protect the state
    "RIVET_STATE_FOREIGN": _e(
        "refusal", "refusal", "choose another state directory (RIVET_STATE_URL=sqlite:/other/dir)",
    ),
    "RIVET_STATE_NOT_A_STATE": _e(
        "refusal", "refusal",
        "point RIVET_STATE_URL at a rivet state, or move the file named in the message out of the way",
    ),
    "RIVET_STATE_MISSING": _e(
        "refusal", "refusal",
        "check RIVET_STATE_URL and --config: every task must open the same state; "
        "create a new one only on purpose with statetool init",
    ),
    "RIVET_STATE_RELOCATED": _e(
        "refusal", "refusal", "set RIVET_STATE_URL to the new place named in the message",
    ),
    "RIVET_STATE_VALUE_UNTRANSFERABLE": _e(
        "refusal", "refusal",
        "correct the value the message names in the source state (a hand edit left a value its column cannot "
        "hold in PostgreSQL), then run the transfer again; nothing was written at the destination",
    ),
    "RIVET_STATE_MOVE_IN_FLIGHT": _e(
        "refusal", "refusal",
        "a relocate or transfer into this place has not finished; the old place is still the live state: "
        "run the command the message names (the same move again) to finish it, then use this place",
    ),
    "RIVET_STATE_TARGET_NOT_EMPTY": _e(
        "refusal", "refusal", "choose an empty target, or move what is there out of the way first",
    ),
    "RIVET_STATE_CHECKPOINT_MISSING": _e(
        "refusal", "refusal",
        "restore the checkpoint file (or set cdc.checkpoint to where it really is) before the next run; "
        "a run without it re-anchors the stream and loses the changes in between",
    ),
    "RIVET_STATE_CHECKPOINT_NOT_A_FILE": _e(
        "refusal", "refusal",
        "put the checkpoint file back at the path named (a FIFO, a directory or a device stands there, or a symlink "
        "to nothing: mount the volume it points into), or set cdc.checkpoint to where the file really is, then re-run",
    ),
    "RIVET_STATE_CHECKPOINT_ON_POD_DISK": _e(
        "refusal", "refusal",
        "move the position into the state with statetool checkpoints import --export NAME (the pod then needs no "
        "file and no volume for it), then run statetool check --target pods again",
    ),
    "RIVET_STATE_SQLITE_ON_POD": _e(
        "refusal", "refusal",
        "move the state and its CDC positions to PostgreSQL (statetool transfer --to URL --with-checkpoints, run "
        "where the SQLite state is) and give every pod that URL in RIVET_STATE_URL, then run statetool check "
        "--target pods again",
    ),
    "RIVET_STATE_VANISHED": _e(
        "refusal", "refusal",
        "a state lived here before (the message names the evidence): find where it went (statetool info, "
        "the tombstone, the backups) and point RIVET_STATE_URL at it; never start a new state over it",
    ),
    "RIVET_STATE_FOREIGN_WAL": _e(
        "refusal", "refusal",
        "with every run stopped, find out which copy of the state is the right one (statetool info on each), "
        "then move the -wal/-shm that do not belong to this state out of its directory, and re-run",
    ),
    "RIVET_STATE_UNSAFE_FILE": _e(
        "refusal", "refusal",
        "a symlink or a non-regular file stands where statetool keeps one of its own files (named in the "
        "message): find out who put it there, move it away, and re-run",
    ),
    "RIVET_STATE_POSITIONS_IN_STATE": _e(
        "refusal", "refusal",
        "run statetool checkpoints export first (each CDC position back to its checkpoint file, where a release "
        "before revision 0006 reads it), then run the downgrade again; --allow-data-loss never drops a position",
    ),
    "RIVET_STATE_DATA_LOSS": _e(
        "refusal", "refusal",
        "this downgrade drops the data named in the message; add --allow-data-loss if that is intended",
    ),
    "RIVET_STATE_IDENTITY_MISMATCH": _e(
        "refusal", "refusal",
        "read the recorded key with statetool identity show and name it exactly as --old",
    ),
    "RIVET_STATE_COPY_DIVERGED": _e(
        "refusal", "refusal",
        "the copy and the live state went apart at the same serial; compare them (statetool diff COPY sqlite:/dir), "
        "keep the one that holds the progress to keep, and restore it on purpose with --allow-older (audited)",
    ),
    "RIVET_STATE_COPY_OLDER": _e(
        "refusal", "refusal",
        "the copy holds older progress than the live state; compare them (statetool diff), and if going back is "
        "intended restore with --allow-older (audited with both serials)",
    ),
    # fleet pre-flight (issue 16 item 1): check, info and doctor over several configs at once
    "RIVET_CONFIGS_NO_MATCH": _e(
        "usage", "generic",
        "quote the GLOB so that statetool expands it ('pipelines/*/rivet.yaml', relative to the working directory), "
        "and check that it names the configs (ls pipelines/*/rivet.yaml)",
    ),
    "RIVET_STATE_SHARED": _e(
        "refusal", "refusal",
        "give each source's pipeline a state of its own (a config directory of its own for the default state, its "
        "own sqlite:/dir, or its own PostgreSQL ?schema=NAME) before either runs again",
    ),
    "RIVET_STATE_CHECKPOINT_SHARED": _e(
        "refusal", "refusal",
        "give each CDC export a cdc.checkpoint file of its own before either runs again; the file holds the position "
        "of whichever wrote it last",
    ),
    # internal (6)
    "RIVET_INTERNAL": _e(
        "internal", "internal", "this is a bug in statetool; re-run with --debug and report the traceback",
    ),
}

#: Warnings: never change the exit code, except under ``check --strict`` (refusal).
WARNINGS: dict[str, str] = {
    "RIVET_STATE_IDENTITY_ADOPTED":
        "nothing to do if the source is right; otherwise choose another state directory",
    "RIVET_STATE_FOREIGN_BESIDE_CONFIG":
        "check source.url: this state belongs to another source; give each source its own state directory",
    "RIVET_STATE_CHECKPOINT_RELATIVE":
        "move its position into the state with statetool checkpoints import --export NAME, or set cdc.checkpoint "
        "to an absolute path on storage that outlives the worker",
    "RIVET_STATE_CHECKPOINT_BESIDE_CONFIG":
        "move the checkpoint file into the declared state directory",
    "RIVET_STATE_DIR_EPHEMERAL":
        "mount a host path or a named volume at the state directory, or move the state to PostgreSQL",
    "RIVET_STATE_DIR_NETWORK":
        "keep a SQLite state on a local disk, or move it to PostgreSQL (statetool transfer)",
    "RIVET_STATE_ORPHAN_WAL":
        "with every run stopped, move the -wal/-shm files that do not belong to this state out of the directory",
    "RIVET_STATE_HOT_JOURNAL":
        "nothing is lost: the state shown is the one before the interrupted write; leave the -journal where it "
        "is, the next write (statetool migrate, or the pipeline) rolls it back in place",
    "RIVET_STATE_LEFTOVER_TEMP":
        "nothing is lost: with no statetool write running, delete them (none is the state nor a backup); a "
        "migration still to run, and every write that takes a backup, removes them itself",
    "RIVET_STATE_READ_ONLY_DRY_RUN":
        "the plan shown is right; before the real run, remove the reason the message gives at the place it names "
        "(a read-only mount, a user who may not write there), or run it where that place is writable",
    "RIVET_STATE_CREATED":
        "nothing to do for a new pipeline; otherwise stop it and find where its state went",
    "RIVET_STATE_CHECKPOINT_FILE_NEWER":
        "the state's position is the one runs resume from; stop whatever still writes the file (a worker of an "
        "older release), then remove the file or move it aside",
    "RIVET_STATE_CHECKPOINT_FILE_OLDER":
        "the state's position is the one runs resume from; move the file aside (a restored backup or a copy). Only "
        "if the file's position is the right one: move it aside, run statetool checkpoints export --export NAME, "
        "put the file back in its place, then statetool checkpoints import --export NAME",
    "RIVET_STATE_ROLLED_BACK":
        "compare the two (statetool diff COPY sqlite:/dir), then put the newer one back on purpose with statetool "
        "restore NAME; until then the exports resume from the older progress",
    "RIVET_STATE_LEASE_LIVE":
        "nothing to do before a run; a migration or another whole-state write waits for the holders named",
    "RIVET_STATE_PASSWORD_IN_ARGV":
        "pass the URL in an environment variable instead (RIVET_STATE_URL, transfer --to-env NAME), or leave the "
        "password out of the URL and let libpq read PGPASSFILE (~/.pgpass) or PGPASSWORD",
    "RIVET_STATE_PRUNE_SKIPPED":
        "re-run statetool prune when the run named has finished, or prune that export alone (prune --export NAME "
        "waits for its run up to --lock-wait)",
    "RIVET_EXPORT_NO_PROGRESS":
        "nothing to do for a new export; otherwise point the pipeline at the state that holds its progress",
    # fleet pre-flight (issue 16 item 1)
    "RIVET_STATE_SHARED_SAME_SOURCE":
        "nothing to do if the configs are meant to share one state; otherwise give each pipeline a state of its own "
        "(its own config directory, sqlite:/dir or ?schema=NAME)",
    "RIVET_STATE_CHECKPOINT_DIR_SHARED":
        "nothing to do if that is intended; otherwise give each pipeline's checkpoints a directory of its own (an "
        "absolute cdc.checkpoint under the pipeline's state directory)",
}


class StateError(Exception):
    """The one error type of statetool: a registered ``code`` and a message.

    ``message`` and every string of ``details`` are redacted when the error is built, so
    no password reaches any output.
    ``details`` carries machine-readable context (paths, keys, holders) for the library's
    callers and the CLI's own handling (a unit's ``export``); the ``--json-errors`` object
    does not carry it (SPEC §7's keys and ``failures``), so a message says what a CLI user
    needs.
    Raises ``KeyError`` at construction for an unregistered code: a typo is a bug that
    must show in tests, not a silent exit 1.
    """

    def __init__(self, code: str, message: str, details: dict[str, Any] | None = None) -> None:
        # statetool.redact loads with the first error, not at start-up (issue 13 item 5)
        from statetool.redact import redact_text, redact_values

        if code not in REGISTRY:
            raise KeyError(f"unregistered error code {code}")
        self.code = code
        self.message = redact_text(message)
        self.details: dict[str, Any] = redact_values(details if details is not None else {})
        super().__init__(self.message)

    def __repr__(self) -> str:
        return f"StateError(code={self.code!r}, message={self.message!r}, details={self.details!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StateError):
            return NotImplemented
        return (self.code, self.message, self.details) == (other.code, other.message, other.details)

    __hash__ = None  # type: ignore[assignment]  # equal by value, mutable: as the dataclass it was

    @property
    def entry(self) -> Entry:
        """The registry entry of this error's code."""
        return REGISTRY[self.code]

    @property
    def exit_code(self) -> int:
        """The exit code of the code's class (1-6)."""
        return self.entry.exit_code

    def __str__(self) -> str:
        return self.message


def _object(err: StateError) -> dict[str, Any]:
    entry = err.entry
    return {
        "error": err.message,
        "exit_class": entry.exit_code,
        "code": err.code,
        "kind": entry.kind,
        "class": entry.exit_class,
        "exit_code": entry.exit_code,
        "retryable": entry.retryable,
        "action": entry.action,
        "message": err.message,
    }


def _warning(warning: "StateWarning") -> dict[str, Any]:
    exit_class = failure_class(warning.code)
    return {
        "error": warning.message, "exit_class": EXIT_CODES[exit_class], "code": warning.code, "kind": "warning",
        "class": exit_class, "exit_code": EXIT_CODES[exit_class], "retryable": False, "action": warning.action,
        "message": warning.message,
    }


def _failed(code: str, message: str, error: StateError | None) -> dict[str, Any]:
    """The object of a failure: of ``error``, else of the registered ``code``, else of the
    warning ``code`` made to fail (class :func:`failure_class`)."""
    if error is None and code not in REGISTRY:
        return _warning(StateWarning(code, message))
    return _object(error or StateError(code, message))


def unit_failure(export: str, code: str, message: str, error: StateError | None = None) -> dict[str, Any]:
    """One entry of ``failures[]`` (ADR-0039 D2): the object of an export's failure (of
    ``error``, else of the registered ``code``, else of the warning ``code`` that
    ``check --strict`` failed) plus ``export``."""
    return {**_failed(code, message, error), "export": export}


def failure_object(code: str, message: str, error: StateError | None = None,
                   failures: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The ``--json-errors`` object of a failing row or reason: of ``error``, else of the
    registered ``code``, else of the warning ``code`` made to fail (``check --strict``;
    ``doctor``'s first run by a warning alone), with ``failures`` (``[]`` when not given)."""
    return {**_failed(code, message, error), "failures": failures or []}


def error_object(err: StateError, failures: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The ``--json-errors`` object of SPEC §7: every key present, ``exit_class`` an int.

    The top-level keys describe ``err``, the worst failure. ``failures`` (ADR-0039 D2)
    holds each failed unit (an export) as a :func:`unit_failure` entry. When not given,
    an error raised for one export (``details["export"]``) is its own one unit and any
    other error belongs to no unit: ``failures: []``.
    """
    if failures is None:
        export = err.details.get("export")
        failures = [{**_object(err), "export": export}] if isinstance(export, str) else []
    return {**_object(err), "failures": failures}


def internal_error(exc: BaseException) -> StateError:
    """Wrap an unexpected exception as ``RIVET_INTERNAL`` with a one-line message."""
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return StateError("RIVET_INTERNAL", f"{type(exc).__name__}: {first_line}")


#: The class of a registered warning that is made to fail (``check --strict``, or ``doctor``
#: when a warning alone makes an export's next run a first run): a refusal (SPEC §7).
WARNING_FAILURE_CLASS = "refusal"


def interrupted(exc: BaseException) -> bool:
    """True when a KeyboardInterrupt (Ctrl-C) stands anywhere in ``exc``'s chain of causes:
    a driver's cleanup error raised while unwinding one hides it."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def failure_class(code: str) -> str:
    """The exit class ``code`` fails with: a registered error's own class; a registered
    warning made to fail is a refusal (:data:`WARNING_FAILURE_CLASS`, SPEC §7). The one
    place that says so. Raises ``KeyError`` for a code that is neither registered nor a
    warning (a typo is a bug)."""
    if code in REGISTRY:
        return REGISTRY[code].exit_class
    if code in WARNINGS:
        return WARNING_FAILURE_CLASS
    raise KeyError(f"unregistered code {code}")


def failure_exit_code(code: str) -> int:
    """The process exit code of a failure with ``code``: a registered error's own
    (:attr:`Entry.exit_code`), a warning made to fail its class's (:func:`failure_class`)."""
    return REGISTRY[code].exit_code if code in REGISTRY else EXIT_CODES[failure_class(code)]


def worst(codes: list[str]) -> str | None:
    """The code whose failure class (:func:`failure_class`) ranks highest by
    :data:`STOP_RANK`, the last among equals; None for no codes. The one "worst outcome"
    rule of SPEC §7 (``check``'s exit code, ``doctor``'s reason for ``--json-errors``)."""
    best: str | None = None
    for code in codes:
        if best is None or STOP_RANK[failure_class(code)] >= STOP_RANK[failure_class(best)]:
            best = code
    return best


def worst_exit_code(exit_codes: list[int]) -> int:
    """The exit code of the worst outcome among process ``exit_codes`` (0 for success), ranked
    by class as :func:`worst` ranks codes (:data:`STOP_RANK`); 0 when none failed. A code that
    is no class's own (126, 127) ranks as its class, generic. A fleet exits with the worst of
    its pipelines (issue 16 item 1)."""
    classes = {code: name for name, code in EXIT_CODES.items()}
    failed = [code for code in exit_codes if code]
    return max(failed, key=lambda code: STOP_RANK[classes.get(code, "generic")], default=0)


def pipeline_failure(config: str, failure: dict[str, Any], export: str | None = None) -> dict[str, Any]:
    """One entry of a fleet's ``failures[]`` (issue 16 item 1): the failure object of one
    pipeline (:func:`failure_object` or :func:`error_object`, its own ``failures`` dropped)
    plus ``export`` (the export it is about, or None) and ``config``, the pipeline's config
    as given."""
    return {**{k: v for k, v in failure.items() if k != "failures"}, "export": export, "config": config}


def moved_away(place: str, doc: dict[str, Any], details: dict[str, Any]) -> StateError:
    """``RIVET_STATE_RELOCATED`` for the old place ``place`` of a state a relocate or a
    transfer moved away, from what the move left there (``doc``: a SQLite tombstone, or
    the ``retired`` audit row of a PostgreSQL schema: ``to``, ``state_url``, ``at``,
    ``by``, ``kept_as``): where the state went and the ``RIVET_STATE_URL`` every task must
    now run with (SPEC §9). ``details`` names the place (``path`` or ``place``)."""
    from statetool.moments import moment

    url = doc.get("state_url", "?")
    kept = doc.get("kept_as")
    return StateError(
        "RIVET_STATE_RELOCATED",
        f"the state that was at {place} was moved to {doc.get('to', '?')} on {moment(doc.get('at', '?'))} "
        f"by {doc.get('by', '?')}; every task must now run with RIVET_STATE_URL={url} "
        + (f"(the old bytes are kept as {kept})" if kept else
           "(its rows are kept here, refused to every open; nothing starts a new state over them)"),
        {**details, "to": doc.get("to"), "state_url": url},
    )


class StateWarning:
    """A registered warning (SPEC §7): reported, never changes the exit code on its own;
    immutable, equal by code and message.

    ``check --strict`` turns each into a failure of class refusal (exit 5). Raises
    ``KeyError`` at construction for an unregistered code; the message is redacted.
    """

    __slots__ = ("code", "message")
    code: str
    message: str

    def __init__(self, code: str, message: str) -> None:
        from statetool.redact import redact_text

        if code not in WARNINGS:
            raise KeyError(f"unregistered warning code {code}")
        object.__setattr__(self, "code", code)
        object.__setattr__(self, "message", redact_text(message))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"StateWarning is immutable: cannot set {name}")

    def __repr__(self) -> str:
        return f"StateWarning(code={self.code!r}, message={self.message!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StateWarning):
            return NotImplemented
        return (self.code, self.message) == (other.code, other.message)

    def __hash__(self) -> int:
        return hash((self.code, self.message))

    def __reduce__(self) -> tuple[type["StateWarning"], tuple[str, str]]:
        return StateWarning, (self.code, self.message)  # copied and pickled through __init__

    @property
    def action(self) -> str:
        """The registered action of this warning."""
        return WARNINGS[self.code]

    def as_dict(self) -> dict[str, str]:
        """``{"code", "message", "action"}`` for JSON output."""
        return {"code": self.code, "message": self.message, "action": self.action}
