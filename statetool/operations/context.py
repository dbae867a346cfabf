"""What every operation is given: the config path, the state URL setting, the environment,
``--lock-wait``, and how to show progress."""

from __future__ import annotations

import contextlib
import getpass
import os
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from statetool.backends.processes import host_name
from statetool.errors import StateError
from statetool.location import DEFAULT_CONFIG, ENV_VAR, Location, resolve_location
from statetool.numbers import require_within

if TYPE_CHECKING:
    from statetool.backends.base import Backend, LeaseStore
    from statetool.config import PipelineConfig

#: The longest --lock-wait, in seconds (7 days): SQLite's busy timeout is a C int of
#: milliseconds, which a larger wait would overflow into a wait of almost nothing.
MAX_LOCK_WAIT = 604800.0

#: progress(description) -> a context yielding update(done, total) (units of the caller's choosing).
ProgressFactory = Callable[[str], contextlib.AbstractContextManager[Callable[[int, int], None]]]


def now_iso() -> str:
    """The current UTC time as ISO-8601 text with microseconds and a ``Z``."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@contextlib.contextmanager
def no_progress(_description: str) -> Iterator[Callable[[int, int], None]]:
    """The silent progress display (library use, ``--json``, no terminal)."""
    yield lambda _done, _total: None


def _ignore(_text: str) -> None:
    """The silent ``log`` and ``on_step``."""


class Context(SimpleNamespace):
    """The inputs of one statetool invocation.

    ``config_path`` defaults to ``./rivet.yaml``; ``state_url`` is ``--state-url`` (None
    when not given: ``RIVET_STATE_URL`` from ``env`` applies); ``env`` defaults to a copy of
    ``os.environ``; ``lock_wait`` is in seconds, 0 to :data:`MAX_LOCK_WAIT` (else
    ``RIVET_CLI_USAGE``); ``config_given`` says that the caller named the config
    (``--config/-c``), which then must exist (:meth:`config_or_none`).

    A namespace (equal by value, unhashable, as the dataclass it was): building a dataclass
    costs about a millisecond at every start-up of ``leases run`` (docs/decisions.md,
    "leases run: what start-up does not pay for").
    """

    config_path: Path
    state_url: str | None
    env: Mapping[str, str]
    lock_wait: float
    command: str
    progress: ProgressFactory
    #: Where progress messages go (waiting for a lease, ...): silent by default.
    log: Callable[[str], None]
    #: TTL of the PostgreSQL leases this invocation takes, in seconds (SPEC §5, ``--lease-ttl``).
    lease_ttl: int
    #: Told the name of each step a move passes (``relocate.CRASH_POINTS``; a relocation's
    #: ``copy-page-<n>`` after n pages): a no-op but for the crash tests, whose driver
    #: (tests/support/crash_driver.py) SIGKILLs its own process at one of them.
    on_step: Callable[[str], None]
    #: Whether the caller named ``config_path`` (``--config/-c``) rather than taking the default.
    config_given: bool

    def __init__(self, config_path: Path = Path(DEFAULT_CONFIG), state_url: str | None = None,
                 env: Mapping[str, str] | None = None, lock_wait: float = 600.0, command: str = "statetool",
                 progress: ProgressFactory = no_progress, log: Callable[[str], None] = _ignore, lease_ttl: int = 30,
                 on_step: Callable[[str], None] = _ignore, config_given: bool = False) -> None:
        require_within("--lock-wait", lock_wait, 0, MAX_LOCK_WAIT, "seconds (7 days)")
        super().__init__(config_path=config_path, state_url=state_url, env=dict(os.environ) if env is None else env,
                         lock_wait=lock_wait, command=command, progress=progress, log=log, lease_ttl=lease_ttl,
                         on_step=on_step, config_given=config_given)

    @cached_property
    def location(self) -> Location:
        """The resolved state location (SPEC §1). Raises the resolver's codes."""
        return resolve_location(self.env.get(ENV_VAR), self.state_url, self.config_path)

    @cached_property
    def config(self) -> PipelineConfig:
        """The parsed pipeline config (SPEC §2). Raises ``RIVET_CONFIG_*``."""
        from statetool.config import load_config  # YAML loads only for commands that read the config

        return load_config(self.config_path)

    def config_or_none(self) -> PipelineConfig | None:
        """The pipeline config, or None for an operation that can do without one (the
        ``leases`` commands, issue 12 item 7) when there is none to read: no file at
        ``config_path``, the default path was not overridden (``config_given`` False),
        and the state's place does not depend on the config (``RIVET_STATE_URL`` or
        ``--state-url`` names a declared directory or PostgreSQL). A config that is there
        is always read, so its faults (``RIVET_CONFIG_INVALID``, a permission) still
        refuse; otherwise raises as :attr:`config` does, and the resolver's codes first.
        """
        if (self.location.scope != "beside_config" and not self.config_given
                and not os.path.lexists(self.config_path)):
            return None
        return self.config

    @cached_property
    def computed_key(self) -> str:
        """The ``state_key`` of the config's source, ``""`` when it cannot be computed."""
        from statetool.identity import state_key

        return state_key(self.config.resolved_source_url(self.env))

    def backend(self) -> Backend:
        """The backend of the resolved location."""
        from statetool.backends import open_backend

        return open_backend(self.location, self.lock_wait)

    @cached_property
    def lease_store(self) -> LeaseStore:
        """The lease store of the resolved location, one per invocation (so one heartbeat
        thread serves every PostgreSQL lease it holds)."""
        from statetool.backends import open_leases

        return open_leases(self.location, self.lock_wait, self.lease_ttl)

    @property
    def actor(self) -> str:
        """``user@host`` of this process, for audit rows."""
        try:
            user = getpass.getuser()
        except (KeyError, OSError):
            user = str(os.getuid())
        return f"{user}@{host_name()}"
