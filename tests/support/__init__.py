"""What the tests share besides fixtures: the CLI runners, the one ``--json-errors``
parser, configs, tree digests and the throwaway PostgreSQL cluster.

Test modules import from here (``from support import run_cli, error_object``; the
``tests`` folder is on ``pythonpath`` in pyproject.toml); ``conftest.py`` holds only fixtures.
"""

from support.cli import CliRun, Output, describe, process_env, run_cli, run_cli_as_needed, run_cli_process
from support.errors import OBJECT_KEYS, error_object
from support.files import CDC_EXPORTS, declare_export, tree_digest, write_config
from support.forked import Forked, fork_call, fork_cli, fork_code, run_cli_forked
from support.pg import PG_PASSWORD, PG_PASSWORD_USER, Cluster, as_postgres, require_pg_bindir, require_psql

__all__ = ["CDC_EXPORTS", "declare_export", "OBJECT_KEYS", "PG_PASSWORD", "PG_PASSWORD_USER", "CliRun", "Cluster", "Forked", "Output", "as_postgres",
           "describe", "error_object", "fork_call", "fork_cli", "fork_code", "process_env", "require_pg_bindir",
           "require_psql", "run_cli", "run_cli_as_needed", "run_cli_forked", "run_cli_process", "tree_digest",
           "write_config"]
