"""The one interface every backend implements (ARCHITECTURE: storage).

Code above the backends never asks which backend it has: it calls these methods, reads
through the :class:`Reader` a read session yields (SQL text with ``:name`` parameters, on
the backend's own driver: no SQLAlchemy), and uses SQLAlchemy Core on the connections a
write yields.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from statetool.moments import moment

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from statetool.backends.copy_text import Block, Loaded
    from statetool.location import Location
    from statetool.migrations import Revision

#: progress(done, total) in backend-defined units (pages for a SQLite backup).
Progress = Callable[[int, int], None]
#: on_step(name): told each named step of a move as it is passed (the crash tests' points:
#: ``Context.on_step``); a no-op in production.
Step = Callable[[str], None]
#: The UTC time of a backup's name (``%Y%m%dT%H%M%SZ``) as a plan writes it: as long as
#: the time itself, so a long label is cut in the plan where the real run cuts it.
BACKUP_TIME = "YYYYmmddTHHMMSSZ"


class Reader(Protocol):
    """A read session on a state (issue 13 item 1): SQL text whose parameters are
    ``:name`` (``sqlalchemy.text``'s style) with a mapping of values, run by the backend's
    own driver (``sqlite3``, psycopg) or, on a write's connection, by SQLAlchemy
    (:meth:`Backend.reader`). Rows are tuples in the order of the select list. An error of
    the driver is raised as the backend's registered ``StateError`` (``RIVET_STATE_CORRUPT``,
    ``RIVET_STATE_UNREACHABLE``, ``RIVET_INTERNAL`` for an error of statetool's own SQL, ...),
    chained from the driver's error."""

    #: What the open found: ``interrupted_write`` is the sentence of a SQLite hot journal
    #: rolled back in a private copy (warning ``RIVET_STATE_HOT_JOURNAL``).
    info: dict[str, str]

    def rows(self, sql: str, params: Mapping[str, object] | None = None) -> list[tuple[Any, ...]]:
        """Every row of ``sql``."""

    def one(self, sql: str, params: Mapping[str, object] | None = None) -> tuple[Any, ...] | None:
        """The first row of ``sql``, or None."""

    def scalar(self, sql: str, params: Mapping[str, object] | None = None) -> Any:
        """The first value of the first row of ``sql``, or None."""


class Holder(NamedTuple):
    """Who holds (or held) a lease: pid, host, user, command, and times (ISO-8601 UTC).

    ``started`` is the holder's process start time (clock ticks since boot, Linux), so a
    reused pid never reads as alive; ``child_pid``/``child_started`` name the command a
    ``leases run`` wrapper started; ``token`` is the acquisition's fencing token (SPEC §5).
    ``heartbeat_at`` and ``ttl_seconds`` exist on PostgreSQL only.
    """

    pid: int
    host: str
    user: str
    command: str
    acquired_at: str
    heartbeat_at: str | None = None
    ttl_seconds: int | None = None
    token: int | None = None
    started: int | None = None
    child_pid: int | None = None
    child_started: int | None = None

    def describe(self) -> str:
        """``pid 123 on host as user since T: command`` for messages."""
        child = f" (command pid {self.child_pid})" if self.child_pid else ""
        return f"pid {self.pid}{child} on {self.host} as {self.user} since {moment(self.acquired_at)}: {self.command}"


class PageCopy(NamedTuple):
    """A move's copy of a state file (:meth:`FileMoves.copy_pages`): where it is, the page
    digest (sha256, hex) of the bytes it was given, which is the frozen source's digest, and
    the rows of each table of the source, counted under the same lock (``{table: rows}``)."""

    path: Path
    digest: str
    tables: dict[str, int]


class LeaseInfo(NamedTuple):
    """One lease as seen without taking it: ``state`` is ``live``, ``stale`` or ``free``.

    ``heartbeat_age`` and ``ttl_left`` are seconds by the database clock (PostgreSQL).
    """

    key: str
    state: str
    holder: Holder | None
    heartbeat_age: float | None = None
    ttl_left: float | None = None


class HeldLease(Protocol):
    """A lease this process holds until :meth:`release` (SPEC §5)."""

    key: str
    holder: Holder

    @property
    def token(self) -> int | None:
        """The fencing token of this acquisition (None on a PostgreSQL state whose lease
        table predates revision 0004)."""

    @property
    def lost(self) -> bool:
        """True once this process knows another holder took the lease over."""

    def release(self) -> None:
        """Give the lease up (idempotent)."""

    def inheritable_fds(self) -> tuple[int, ...]:
        """File descriptors a child process must inherit to keep holding the lease
        after this process dies (SQLite flock); empty on PostgreSQL."""

    def set_child(self, pid: int, started: int | None) -> None:
        """Record the command this holder started, so that it keeps the lease live on this
        host while it lives (a ``leases run`` wrapper that died)."""

    def fence(self, conn: Connection, *, final: bool = False) -> None:
        """Check, inside the write transaction of ``conn``, that this acquisition still holds
        the lease; raises ``RIVET_STATE_LEASE_LOST`` otherwise. With ``final`` (right before
        the commit) a PostgreSQL row lock keeps a takeover out until the commit ends."""


class StaleClaim(Protocol):
    """A stale lease held still for a release that must be audited atomically."""

    info: LeaseInfo

    def commit(self) -> None:
        """Remove the holder record (after the audit row committed)."""

    def abandon(self) -> None:
        """Leave the record exactly as it was (the audit failed)."""


class LeaseStore(Protocol):
    """The leases of one state (SPEC §5)."""

    def try_acquire(self, key: str, holder: Holder) -> HeldLease | LeaseInfo:
        """Take ``key`` now if it is free or stale (a stale holder is taken over), else
        return the live holder's :class:`LeaseInfo`. Never waits. Raises
        ``RIVET_STATE_UNSAFE_FILE`` where a sidecar is a symlink or not a regular file."""

    def info(self, key: str) -> LeaseInfo:
        """One lease with its state, read without taking any lock."""

    def require_takable(self, keys: Iterable[str]) -> None:
        """Refuse, before any lease is taken, a set of ``keys`` that this user could not
        take all of (SQLite: a sidecar, or the folder, it may not write:
        ``RIVET_STATE_PERMISSION_DENIED`` / ``RIVET_STATE_READ_ONLY``), so that a write
        refused half way leaves no lease file of the leases it took first. Reads only."""

    def require_state(self, *, to_hold: bool = True) -> None:
        """Raise ``RIVET_STATE_MISSING`` / ``RIVET_STATE_RELOCATED`` (and the like) unless a
        state is where this store keeps its leases; cheap, loads no database driver for SQLite.
        ``to_hold`` False (``leases list``, reading only, issue 12 fixB item 1) checks only
        that the state is there; True also that a command run under a lease may use it."""

    def list(self) -> list[LeaseInfo]:
        """Every lease with its state, read without taking any lock."""

    def releasable(self, key: str) -> LeaseInfo:
        """The lease ``key`` as a release would find it, read without taking any lock and
        creating no file (``leases release``'s plan, its dry run's too): the same refusals
        as :meth:`claim_stale`, ``RIVET_STATE_LEASE_UNKNOWN`` for a key that has no record
        and ``RIVET_STATE_RUN_IN_PROGRESS`` for a live holder; a free lease is returned
        with state ``free`` (no holder), a stale one with its holder."""

    def claim_stale(self, key: str, conn: Connection) -> StaleClaim:
        """Hold the stale lease ``key`` for its release: on PostgreSQL its row is deleted in
        ``conn``'s transaction (so the audit row commits with it); on SQLite its sidecar is
        locked until :meth:`StaleClaim.commit` or :meth:`StaleClaim.abandon`. Raises
        ``RIVET_STATE_RUN_IN_PROGRESS`` for a live holder (on SQLite also a dead holder
        whose command's process group still works: :meth:`info` reads it live) and
        ``RIVET_STATE_LEASE_UNKNOWN`` for a key that has no record."""


class Backend(Protocol):
    """A state store at one :class:`~statetool.location.Location`."""

    location: Location
    #: SQLAlchemy dialect name: ``"sqlite"`` or ``"postgresql"``; for the backends and the
    #: alembic glue only: code above asks the capabilities below instead.
    dialect_name: str
    #: The PostgreSQL schema of the state, None for SQLite.
    schema: str | None
    #: True when the state is one file that a move copies page for page and retires in
    #: place with a tombstone (SQLite; its :class:`FileMoves` from
    #: :func:`statetool.backends.file_move`). PostgreSQL has no such file: its state is a
    #: schema on a shared server, which pg_dump moves.
    relocatable: bool

    # -- capabilities: each difference that code above the backends acts on, named once with
    # its reason (alembic's ``DefaultImpl`` attributes); nothing above compares dialect names.

    #: :meth:`offline_sql` can print the DDL of a migration for a DBA to run (alembic's
    #: offline mode). False where the state is one file changed in place after a verified
    #: backup (SQLite): there is no DDL script to hand over.
    supports_offline_sql: bool
    #: :meth:`integrity_problems` runs a real check of the stored pages (SQLite
    #: ``quick_check``). False where the server keeps its pages consistent itself
    #: (PostgreSQL): the pre-flight row then says "server-managed".
    checks_integrity: bool
    #: The state's copies are files beside it that statetool reads and restores: the
    #: backups a write takes and the keep a move leaves (SQLite; :meth:`copies`). False
    #: where no copy is a file of ours (PostgreSQL: the server's own backups, pg_dump).
    keeps_copies: bool
    #: The longest a writer of this release that waits for the write lock sleeps between two
    #: tries of it, in seconds: a write made in batches (``prune``) leaves the lock free this
    #: long between two batches while another writer may be waiting (:meth:`contended`), so
    #: that writer gets it at its next try and is never held off longer than about a batch.
    writer_retry_seconds: float
    #: :meth:`reclaim_space` keeps every writer out while it runs, so it runs only while no
    #: run is live (``prune --vacuum`` then holds every run lease); False where writes go on
    #: beside it.
    reclaim_blocks_writers: bool

    def contended(self, conn: Reader) -> bool:
        """True when another process may be waiting for the state's write lock now (SQLite:
        another process holds a lock on the file; PostgreSQL: another session of the
        database is in a transaction, or cannot be seen), read on ``conn``, a session of
        this process; True also when this cannot be known. Takes no lock."""

    def check_reclaimable(self, conn: Reader, tables: Iterable[str]) -> None:
        """Refuse, before anything is written, a :meth:`reclaim_space` of ``tables`` that this
        user could not run (PostgreSQL: a role that owns neither them nor the database,
        ``RIVET_STATE_PERMISSION_DENIED``); read on ``conn``. Nothing to look at for SQLite,
        whose file's rights :meth:`check_writable` checks."""

    def reclaim_space(self, tables: Iterable[str]) -> tuple[int, int]:
        """Give back the space that removed rows of ``tables`` left (SQLite: ``VACUUM`` of the
        whole file, then its WAL truncated; PostgreSQL: ``VACUUM (ANALYZE)`` of the tables,
        outside any transaction). Returns the bytes on disk before and after (SQLite: the
        file and its WAL; PostgreSQL: the tables with their indexes and TOAST). Waits up to
        ``lock_wait`` for the lock it needs, then raises ``RIVET_STATE_LOCK_TIMEOUT``; and the
        faults of a write (``RIVET_STATE_DISK_FULL``, ...)."""

    def copies(self) -> list[Path]:
        """Every copy of the state beside its real file, oldest name first: the backups
        (``….backup-<label>-<UTC time>``) and the keeps of a move (``….relocated-<UTC
        time>``), without what a killed write left (``….tmp``, a name that is the state
        itself) or journal files; empty where :attr:`keeps_copies` is False. Names only: a
        symlink or other non-regular file is listed as found, never followed (SPEC §8a)."""

    def offline_sql(self, current: str | None, target: str, direction: str, *, stamp: str | None = None) -> str:
        """The SQL that moves the state from ``current`` to ``target`` (``direction`` as
        :func:`statetool.migrations.steps` names it), preceded, when ``stamp`` names a
        revision, by the SQL that creates the version table at it (a legacy state). Only where
        :attr:`supports_offline_sql`; elsewhere raises ``RIVET_STATE_SQL_UNSUPPORTED``."""

    def present(self) -> bool:
        """True when anything is at the location: the file exists (SQLite), or the schema
        holds any table (PostgreSQL). Creates nothing. Raises ``RIVET_STATE_UNREACHABLE``.
        """

    def leftovers(self) -> list[Path]:
        """The temporary files a killed migration or backup left beside the state (SQLite:
        ``….backup-….tmp``, a backup name that is the state itself), which the next
        migration removes before it copies; empty on PostgreSQL. Read-only (SPEC §8a, §9)."""

    def check_writable(self, *, copies: int, replaced_by: str | None = None, room_for: str | None = None) -> None:
        """Refuse, before anything is opened for writing, a write that cannot complete
        here: ``RIVET_STATE_READ_ONLY``, ``RIVET_STATE_PERMISSION_DENIED``,
        ``RIVET_STATE_DISK_FULL`` (SPEC §8a). ``copies``: how many files as large as the
        state the write may add beside it (a backup, a journal, rebuilt tables);
        ``replaced_by``: the name of a write that puts a new file in the state's place (a
        migration, a relocation), which must keep the state's owner (SQLite: refused
        ``RIVET_STATE_PERMISSION_DENIED`` when this user cannot give it); ``room_for``: what
        the ``copies`` are for, in the words of a refusal for want of room (default: a
        migration's or a backup's)."""

    def reading(self) -> AbstractContextManager[Reader]:
        """A read-only session that creates no file and changes no byte of the state, on the
        backend's own driver (no SQLAlchemy is imported for it).

        Raises ``RIVET_STATE_MISSING`` (nothing there), ``RIVET_STATE_NOT_A_STATE`` (not a
        SQLite file), ``RIVET_STATE_CORRUPT`` (truncated), ``RIVET_STATE_INTERRUPTED_WRITE``
        (hot journal of a killed writer), ``RIVET_STATE_UNREACHABLE`` /
        ``RIVET_STATE_AUTH_FAILED`` (server).
        """

    def scanning(self) -> AbstractContextManager[Reader]:
        """A read session for a write that reads much before it writes little (``prune``'s
        batches find their rows here, then hold the write lock only for lookups by key): one
        read transaction that takes no write lock and waits for none, beside live writers.
        SQLite: the live file opened as a writer opens it (its ``-wal``/``-shm`` may be
        created, as any write does; ``RIVET_STATE_FOREIGN_WAL`` first, as :meth:`writing`);
        PostgreSQL: a read-only session, as :meth:`reading`. Errors as :meth:`reading`'s."""

    def reader(self, conn: Connection) -> Reader:
        """The :class:`Reader` over ``conn``, a connection of :meth:`writing` (or of a
        transfer's :meth:`TransferDestination.receiving`): the read queries in the write's
        own transaction."""

    def table_names(self, conn: Reader) -> set[str]:
        """The tables of the state (PostgreSQL: of its schema only)."""

    def integrity_problems(self, conn: Reader, *, full: bool = False) -> list[str]:
        """Problems ``quick_check`` finds (SQLite; ``integrity_check`` with ``full``); always
        empty for PostgreSQL."""

    def size_bytes(self, conn: Reader) -> int:
        """The state's size on disk in bytes, read on the read session ``conn``: its real file
        and its ``-wal`` (SQLite), or its schema's tables with their indexes and TOAST
        (PostgreSQL, ``pg_total_relation_size``). Reads only (``statetool metrics``, issue 16
        item 3)."""

    def rebuilt_tables(self, conn: Reader, revision: Revision) -> tuple[str, ...]:
        """The tables of ``revision.rebuilds`` its upgrade copies row by row here, for the
        migrate plan: all of them on PostgreSQL (the server rewrites a table whose column
        type changes); on SQLite those whose ``revision.retypes`` it cannot make in place
        (statetool/backends/sqlite_schema.py)."""

    def writing(self, lock_code: str) -> AbstractContextManager[Connection]:
        """One writing transaction, exclusive among statetool writers, committed on a clean exit.

        Waits up to ``lock_wait`` seconds for the write lock, then raises ``lock_code``.
        """

    def create(self, build: Callable[[Connection], None], start_from: Path | None = None,
               on_step: Step | None = None) -> None:
        """Create a new state atomically: ``build`` runs in one transaction; on SQLite on a
        temporary file linked into place only when complete, which starts as a copy of the
        state file ``start_from`` when given (a restore where no state is; only where
        :attr:`keeps_copies`), its steps told to ``on_step`` (``copied``, ``built``,
        ``linked``). Refuses nothing itself."""

    def backup(self, conn: Connection, label: str, progress: Progress | None = None) -> Path | None:
        """A verified copy of the state beside it (SQLite), named with ``label``; None on
        PostgreSQL, whose writes run in one transaction instead."""

    def planned_backup(self, label: str) -> str | None:
        """The path :meth:`backup` would give a copy named with ``label`` (SQLite), its UTC
        time written as the placeholder :data:`BACKUP_TIME` (a plan's: the time is the real
        run's own); None on PostgreSQL, which keeps no backup file. Looks at no file."""

    def hold_off_writers(self) -> None:
        """Before the write lock of a write that replaces the state whole (a migration):
        wait up to ``lock_wait`` until no other process holds the state open, then fold its
        WAL into the file (SQLite: ``RIVET_STATE_RUN_IN_PROGRESS``,
        ``RIVET_STATE_FOREIGN_WAL``); nothing on PostgreSQL, whose writers queue on the
        transaction's own locks."""

    def require_frozen(self) -> None:
        """Under the write lock: ``RIVET_STATE_RUN_IN_PROGRESS`` when a writer added to the
        state since :meth:`hold_off_writers` (SQLite WAL frames); nothing on PostgreSQL."""

    def restoration(self, conn: Connection, source: Path, progress: Progress, on_step: Step) -> Migration:
        """Where a restore's last steps run (its serial, its audit row), for the write
        transaction ``conn`` that froze the live state: a copy of the state file ``source``
        that replaces the live state whole, the live state kept as the backup labelled
        ``restore`` (SQLite, as :meth:`migration`); only where :attr:`keeps_copies`."""

    def migration(self, conn: Connection, label: str, progress: Progress, on_step: Step) -> Migration:
        """Where a migration's steps run, for the write transaction ``conn`` (which froze
        the state): on SQLite a verified copy that replaces the state at the end, the
        original kept as the backup named with ``label``; on PostgreSQL ``conn`` itself
        (:class:`Migration`)."""

    def vanished_evidence(self) -> list[str]:
        """Where a state is missing: what shows that one lived here before (a relocation's
        keep, backups, lease records), one line each; empty for a new place (SPEC §5a)."""

    def leases(self, ttl: int = 30) -> LeaseStore:
        """The lease store of this state (flock sidecars, or the PostgreSQL lease table whose
        leases get a TTL of ``ttl`` seconds)."""

    # -- a transfer's two ends (SPEC §9; statetool/operations/transfer.py) ---------------
    #: True when ``statetool transfer`` may move this state out (then the backend is a
    #: :class:`TransferSource`); each backend gives its reason beside its value.
    sends_transfer: bool
    #: True when this store may receive a transfer (then the backend is a
    #: :class:`TransferDestination`); each backend gives its reason beside its value.
    accepts_transfer: bool


class Migration(Protocol):
    """The place a migration builds the new revision in (SPEC §9; decisions.md,
    "Revisions and migrations"): the write transaction itself where the DDL is
    transactional (PostgreSQL), or a copy of the frozen state that is switched in whole
    (SQLite: the original, renamed aside, is the backup)."""

    #: Where the state as it was before the migration is kept afterwards (None: nowhere,
    #: PostgreSQL rolls back instead).
    backup: Path | None

    def connection(self) -> AbstractContextManager[Connection]:
        """The writing connection the migration's steps, its verification, the identity
        claim and the audit row run on; committed (and, for a copy, fsynced) on a clean
        exit, discarded on an error. Errors as :meth:`Backend.writing`'s."""

    def switch(self) -> None:
        """Once the write transaction of the state has ended, under every lease: put the
        migrated state in place (a no-op when it is in place already). Raises
        ``RIVET_STATE_RUN_IN_PROGRESS`` (the state was opened or changed meanwhile; nothing
        replaced) and ``RIVET_STATE_UNSAFE_FILE``."""

    def discard(self) -> None:
        """Drop what the migration built (idempotent): the state stays as it was."""


class TransferSource(Backend, Protocol):
    """A state ``statetool transfer`` can move out (:attr:`Backend.sends_transfer`)."""

    def copy_blocks(self, conn: Connection, table: str, columns: list[str]) -> Iterator[Block]:
        """``table``'s ``columns`` read on ``conn`` (the source's write transaction) as
        blocks of COPY text with their checksums (:mod:`statetool.backends.copy_text`), in
        the order of its primary key (the append-only tables' rows keep their order where
        the destination numbers them anew); memory stays flat."""


class Retirement(Protocol):
    """A transfer's source as the place it retires (SPEC §9; decisions.md, "Moves: one live
    place" and "Retiring a PostgreSQL source"): a SQLite file gets relocate's tombstone; a
    PostgreSQL schema keeps its rows and gets a marker in its version table
    (:data:`~statetool.tables.RELOCATED_REVISION`), with a ``retired`` audit row saying where
    the state went. Handed out by :func:`statetool.backends.retirement`; each step is called
    by statetool/operations/transfer.py in this order."""

    #: The source as the transfer's result, its audit row and the tombstone name it: the
    #: real file of a SQLite state, the display (password masked) of a PostgreSQL schema.
    place: str

    def moved_to(self) -> dict[str, Any] | None:
        """What an earlier move left at the source (``to``, ``state_url``, ``kept_as``, ...),
        or None while the source is a live state."""

    def size_bytes(self) -> int:
        """The source's size on disk (bytes): its file, or its tables with their indexes."""

    def require_retirable(self) -> None:
        """Before any lease or write: refuse a source that cannot be retired
        (``RIVET_STATE_READ_ONLY``, ``RIVET_STATE_PERMISSION_DENIED``,
        ``RIVET_STATE_UNSAFE_FILE``). Reads only."""

    def remove_stale(self) -> None:
        """Remove what a killed transfer left beside the source (temporary tombstones)."""

    def hold_off_writers(self) -> None:
        """Before the source's write lock: no other opener, journals folded in
        (``RIVET_STATE_RUN_IN_PROGRESS``, ``RIVET_STATE_FOREIGN_WAL``)."""

    def require_frozen(self) -> None:
        """Under the write lock: nothing was written since :meth:`hold_off_writers`."""

    def digest(self, conn: Connection) -> str:
        """The source's content digest (sha256, hex) read on ``conn``, its write transaction:
        equal for equal content, so a re-run knows whether the source changed."""

    def wait_for_openers(self) -> None:
        """Right before the switch: no other process holds the source open
        (``RIVET_STATE_RUN_IN_PROGRESS`` after ``lock_wait``)."""

    def retire(self, conn: Connection, doc: dict[str, Any], audit: Callable[[str, dict[str, object]], None],
               on_step: Step) -> str | None:
        """The switch, inside the source's write transaction ``conn``: afterwards every open
        of the old place refuses ``RIVET_STATE_RELOCATED`` naming ``doc`` (``to``,
        ``state_url``, ``at``, ``by``, ``source_digest``, ``how``). A SQLite file is
        renamed aside under a tombstone at once; a PostgreSQL schema is marked in ``conn``
        and its ``retired`` row written with ``audit`` (the guarded write's one audit
        writer), both committed with the write. Returns where the old bytes are kept (None:
        in place). ``on_step`` is told the switch's steps."""

    def finish_retired(self) -> None:
        """After the switch, and again on the re-run of a completed transfer: remove what
        the retired source leaves (its old inode's ``-wal``/``-shm``, temporary tombstones)."""


class TransferDestination(Backend, Protocol):
    """A store ``statetool transfer`` can move a state into (:attr:`Backend.accepts_transfer`).

    Its version table marks a copy that is not live yet: :meth:`mark_in_flight` in the
    transaction that fills it, :meth:`make_live` once the source is retired."""

    def inspecting(self) -> AbstractContextManager[Reader]:
        """A read-only session (psycopg, no SQLAlchemy) on whatever is at the location, which may hold no table at
        all (a schema that is empty or does not exist yet). Checks no rights: the caller
        asks :meth:`check_rights` for what it is about to do. Raises
        ``RIVET_STATE_UNREACHABLE`` / ``RIVET_STATE_AUTH_FAILED``."""

    def check_rights(self, purpose: str, conn: Reader) -> None:
        """Raise ``RIVET_STATE_PERMISSION_DENIED`` unless the session of ``conn`` has every
        right ``purpose`` (``read``, ``write``, ``migrate``, ``create``, ``lease``) needs."""

    def receiving(self) -> AbstractContextManager[Connection]:
        """One writing transaction on the location, which may hold no table yet, under the
        writers' lock; committed on a clean exit, nothing of it visible before."""

    def copy_into(self, conn: Connection, table: str, columns: list[str], blocks: Iterable[Block], rows: int,
                  progress: Callable[[int], None]) -> Loaded:
        """Append ``blocks`` to ``table`` in ``conn``'s transaction (``rows``: how many the
        source holds; ``progress(n)`` after each block of ``n`` rows) and return what was
        sent and what the table gained, by the destination's own count and checksum."""

    def drop_tables(self, conn: Connection) -> None:
        """Drop every table at the location in ``conn``'s transaction (a copy that never
        went live, made again)."""

    def in_flight(self, conn: Connection) -> bool:
        """True when the version table says the state here is a move's copy, not live yet."""

    def mark_in_flight(self, conn: Connection) -> None:
        """Mark the state in ``conn``'s transaction as a move's copy: every open of it then
        refuses with ``RIVET_STATE_MOVE_IN_FLIGHT`` until :meth:`make_live`."""

    def make_live(self) -> None:
        """Turn an in-flight copy into the live state (its version back to head), in a
        transaction of its own; nothing to do when it is live already or nothing is there."""


class FileMoves(Protocol):
    """The steps that move a state file into another directory and retire it at its old
    place (SPEC §9; decisions.md, "Moves: one live place"): what ``relocate`` and
    ``transfer`` call, in the order of their docstrings, on the object
    :func:`statetool.backends.file_move` returns for a :attr:`Backend.relocatable` backend.
    Each raises what its implementation (statetool/backends/moves.py) documents."""

    #: The file the move copies and retires: the real file of a symlinked state.
    source: Path

    # -- the source, before and at the switch

    def tombstone(self) -> dict[str, Any] | None:
        """What the source's tombstone says (``to``, ``state_url``, ``kept_as``, ...), or
        None while a state is there."""

    def stale_tombstones(self) -> list[Path]:
        """The temporary tombstones a killed move left beside the source."""

    def refuse_unsafe(self, *paths: Path) -> None:
        """``RIVET_STATE_UNSAFE_FILE`` for a symlink or a non-regular file among ``paths``."""

    def require_retirable(self) -> None:
        """Refuse a source whose directory cannot take the tombstone (``RIVET_STATE_READ_ONLY``,
        ``RIVET_STATE_PERMISSION_DENIED``)."""

    def wait_for_openers(self) -> None:
        """Return once no other process holds the source open (``RIVET_STATE_RUN_IN_PROGRESS``
        after ``lock_wait``)."""

    def hold_off_writers(self) -> None:
        """Before the write lock: no other opener, and the source's WAL checkpointed."""

    def require_frozen(self) -> None:
        """Under the write lock: no WAL frame was added since the checkpoint."""

    def digest(self) -> str:
        """The page digest (sha256, hex) of the frozen source."""

    def retire(self, doc: dict[str, Any], on_step: Step) -> Path:
        """The switch: the source's bytes kept, a tombstone holding ``doc`` at its path;
        returns where the bytes are kept."""

    def remove_companions(self) -> None:
        """Remove the ``-wal``/``-shm`` of the retired source."""

    # -- the copy and the target

    def own_files(self, target: Location) -> list[Path]:
        """The files the move creates beside ``target`` besides the state itself."""

    def remove_leftovers(self, target: Location, side_copies: list[Path]) -> None:
        """Remove what a killed run left on either side (and ``side_copies``)."""

    def discard_target(self, target: Location) -> None:
        """Remove an in-flight target that was never live, to make it again."""

    def copy_pages(self, conn: Connection, target: Location, progress: Progress, full_verify: bool) -> PageCopy:
        """The copy of the source (frozen by ``conn``) beside ``target``, made in one pass
        over the source that also digests it and, in parallel, checks its pages
        (``quick_check``; ``integrity_check`` with ``full_verify``); not fsynced yet."""

    def verify_pages(self, copy: Path, source_digest: str) -> None:
        """fsync ``copy`` and read it back: ``RIVET_STATE_VERIFY_FAILED`` unless it has the
        source's page digest."""

    def in_flight(self, copy: Path) -> AbstractContextManager[Connection]:
        """A writing transaction on ``copy`` that leaves it marked in flight."""

    def link_into_place(self, copy: Path, target: Location, on_step: Step) -> None:
        """Link ``copy`` to ``target``'s path, never replacing anything."""

    def removed_when_full(self, target: Location, files: list[Path]) -> AbstractContextManager[None]:
        """Around the copy: on a full target filesystem, what it created goes
        (``RIVET_STATE_DISK_FULL``)."""

    def relocation_detail(self, target: Location) -> dict[str, object] | None:
        """The detail of the last ``relocate`` audit row of the state at ``target``, or None."""

    def finish_target(self, target: Location) -> None:
        """Make the copy at ``target`` live: its version back to head."""
