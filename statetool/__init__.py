"""statetool: inspect, guard and migrate the state store of rivet data pipelines."""

__version__ = "0.1.0"
