"""statetool: inspect, guard and migrate the state store of rivet data pipelines."""

__version__ = "0.1.0"

#: The pipeline config read when ``--config/-c`` is not given (SPEC §2). Defined here, with
#: the version, because ``statetool --help`` shows it and loads nothing else of statetool
#: but the CLI and the error registry (issue 13 item 5); :mod:`statetool.location`, the
#: home of the contract's names, re-exports it.
DEFAULT_CONFIG = "rivet.yaml"
