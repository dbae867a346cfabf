"""Where a contract test keeps its state: the one description of a backend the suite runs
on, so the same test body runs against SQLite and PostgreSQL (litestream's
``RunWithReplicaClient``, terraform's ``TestBackendStateLocks``).

The ``state_backend`` fixture in ``conftest.py`` yields one :class:`StateBackend` per
backend; a test that is about one backend only builds its own with
:meth:`StateBackend.sqlite` or :meth:`StateBackend.postgres`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: The backends every contract test runs on, as ``state_backend`` parametrizes them.
BACKENDS = ("sqlite", "postgres")


@dataclass(frozen=True)
class StateBackend:
    """A state location with nothing there yet.

    ``kind`` is ``"sqlite"`` or ``"postgres"``; ``pipeline`` is the directory the test
    writes its config into (``tmp_path/pipeline``, not yet created); ``url`` is the
    ``RIVET_STATE_URL`` to run with: None for a SQLite state beside the config,
    ``sqlite:<dir>`` for a declared directory, a fresh schema's URL for PostgreSQL.
    """

    kind: str
    pipeline: Path
    url: str | None = None

    @classmethod
    def sqlite(cls, tmp_path: Path, declared: Path | None = None) -> StateBackend:
        """A SQLite state beside the config in ``tmp_path/pipeline``, or in ``declared``."""
        return cls("sqlite", tmp_path / "pipeline", f"sqlite:{declared}" if declared else None)

    @classmethod
    def postgres(cls, tmp_path: Path, pg_url: str) -> StateBackend:
        """A PostgreSQL state at ``pg_url`` (a schema of its own), config in ``tmp_path/pipeline``."""
        return cls("postgres", tmp_path / "pipeline", pg_url)

    @property
    def env(self) -> dict[str, str]:
        """The environment that points statetool at this state (``RIVET_STATE_URL`` when set)."""
        return {"RIVET_STATE_URL": self.url} if self.url else {}

    @property
    def state_dir(self) -> Path | None:
        """The directory the SQLite state file lives in; None on PostgreSQL."""
        if self.kind != "sqlite":
            return None
        return Path(self.url.removeprefix("sqlite:")) if self.url else self.pipeline
