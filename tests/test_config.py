"""SPEC §2: the pipeline config, and its refusals with the file, line and column."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from support import describe, error_object, run_cli, run_cli_process, write_config
from statetool.config import load_config
from statetool.errors import StateError
from statetool.identity import state_key
from statetool.runtime import StateStore


def position(text: str, needle: str, occurrence: int = 1) -> tuple[int, int]:
    """1-based (line, column) of the ``occurrence``-th ``needle`` in ``text``."""
    index = -1
    for _ in range(occurrence):
        index = text.index(needle, index + 1)
    line = text.count("\n", 0, index) + 1
    column = index - (text.rfind("\n", 0, index) + 1) + 1
    return line, column


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "rivet.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def refusal(path: Path) -> StateError:
    with pytest.raises(StateError) as caught:
        load_config(path)
    return caught.value


def assert_at(err: StateError, path: Path, line: int, column: int) -> None:
    assert err.code == "RIVET_CONFIG_INVALID", err.message
    assert err.exit_code == 1
    assert err.message.startswith(f"{path}:{line}:{column}: "), err.message


# -- reading ---------------------------------------------------------------------------


def test_missing_config_is_refused_naming_the_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    err = refusal(Path("nowhere/rivet.yaml"))
    assert err.code == "RIVET_CONFIG_NOT_FOUND"
    assert err.exit_code == 1
    assert str(tmp_path / "nowhere" / "rivet.yaml") in err.message


def test_a_directory_given_as_config_is_refused(tmp_path: Path) -> None:
    err = refusal(tmp_path)
    assert err.code == "RIVET_CONFIG_NOT_FOUND"
    assert str(tmp_path) in err.message
    assert err.message.endswith("cannot be read: Is a directory"), err.message  # no descriptor number (a tester saw ": 3")


def test_fields_statetool_reads_are_parsed(tmp_path: Path) -> None:
    path = write(tmp_path, """\
        source:
          url: postgresql://reader@db.internal:5432/sales
        exports:
          - name: orders
            mode: incremental
          - name: order_lines
            mode: chunked
          - name: snapshot
            mode: full
          - name: order_events
            mode: cdc
            cdc:
              engine: mysql
              checkpoint: checkpoints/order_events.json
        """)
    config = load_config(path)
    assert config.path == path and config.directory == tmp_path
    assert [(e.name, e.mode) for e in config.exports] == [
        ("orders", "incremental"), ("order_lines", "chunked"), ("snapshot", "full"), ("order_events", "cdc")]
    cdc = config.export("order_events").cdc
    assert (cdc.engine, cdc.checkpoint) == ("mysql", "checkpoints/order_events.json")
    assert config.export("orders").cdc is None
    assert config.export("nope") is None
    assert config.resolved_source_url({}) == "postgresql://reader@db.internal:5432/sales"


def test_unknown_keys_are_ignored_everywhere(tmp_path: Path) -> None:
    path = write(tmp_path, """\
        version: 7
        runtime: {threads: 8, spill_dir: /tmp/spill}
        source:
          url_env: SALES_DB_URL
          retries: 3
          tls: {verify: true}
        exports:
          - name: orders
            mode: incremental
            query: SELECT * FROM orders
            tuning: {batch_rows: 10000}
          - name: order_events
            mode: cdc
            cdc:
              engine: postgres
              slot: rivet_orders
        destinations: [s3]
        """)
    config = load_config(path)
    assert [(e.name, e.mode) for e in config.exports] == [("orders", "incremental"), ("order_events", "cdc")]
    assert config.export("order_events").cdc.engine == "postgres"
    assert config.export("order_events").cdc.checkpoint is None
    assert config.source_url_env == "SALES_DB_URL"


def test_every_value_is_read_as_the_text_the_file_holds_and_only_a_plain_null_is_null(tmp_path: Path) -> None:
    """What looks like a number, a boolean or a date is the text written; ``~``, ``null``,
    ``Null``, ``NULL`` and an empty value, unquoted, are null (an absent mode is ``full``);
    quoted, they are text."""
    path = write(tmp_path, """\
        source:
          url: ~
          url_env: NULL
        exports:
          - name: 0x1F
            mode: full
          - name: yes
            mode: incremental
          - name: 2026-01-04
          - name: "null"
            mode: Null
          - name: !!str 12
            mode: cdc
            cdc: {engine: mysql, checkpoint: ''}
          - name: 1.50
            mode: cdc
            cdc:
              engine: mysql
              checkpoint:
        """)
    config = load_config(path)
    assert (config.source_url, config.source_url_env) == (None, None)
    assert [(e.name, e.mode) for e in config.exports] == [
        ("0x1F", "full"), ("yes", "incremental"), ("2026-01-04", "full"), ("null", "full"), ("12", "cdc"),
        ("1.50", "cdc")]
    assert [e.cdc.checkpoint for e in config.exports if e.cdc] == ["", None]


def test_the_loader_tells_null_from_text_as_pyyaml_s_full_resolver_does() -> None:
    """The config's loader resolves no tag but null (issue 13): on every scalar, plain,
    quoted or tagged, as a key or a value, it says null exactly where PyYAML's does."""
    import yaml

    from statetool.config import _Loader

    scalars = ["", "~", "null", "Null", "NULL", "nULL", "nul", "'null'", '"~"', "''", "1", "yes", "No", "0x1F",
               "1.5e3", ".inf", "2026-01-04", "!!null ''", "!!str null", "! null", "null # a comment", "~x", "<<"]
    text = "".join(f"k{i}: {v}\n? {v}\n: {i}\n" + ("" if "#" in v else f"l{i}: [{v}]\n")
                   for i, v in enumerate(scalars))

    def nulls(root: yaml.Node) -> list[tuple[str, bool, int, int]]:
        out, todo = [], [root]
        while todo:
            node = todo.pop()
            if isinstance(node, yaml.ScalarNode):
                out.append((node.value, node.tag.endswith(":null"), node.start_mark.line, node.start_mark.column))
            else:
                todo += [x for pair in node.value for x in (pair if isinstance(pair, tuple) else (pair,))]
        return out

    full = nulls(yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))
    assert nulls(yaml.compose(text, Loader=_Loader)) == full
    assert sum(is_null for _, is_null, _, _ in full) >= 10, full


# -- url_env ---------------------------------------------------------------------------


def test_url_env_is_resolved_from_the_environment(tmp_path: Path) -> None:
    path = write(tmp_path, """\
        source:
          url_env: SALES_DB_URL
        exports: []
        """)
    config = load_config(path)
    assert config.source_url is None and config.source_url_env == "SALES_DB_URL"
    env = {"SALES_DB_URL": "postgres://etl:pw@DB.Internal/sales"}
    assert config.resolved_source_url(env) == env["SALES_DB_URL"]
    assert state_key(config.resolved_source_url(env)) == "postgresql://db.internal:5432/sales"


@pytest.mark.parametrize("env", [{}, {"SALES_DB_URL": ""}, {"OTHER": "postgresql://h/db"}])
def test_url_env_unset_or_empty_gives_no_source_url_and_an_empty_key(tmp_path: Path, env: dict[str, str]) -> None:
    path = write(tmp_path, """\
        source:
          url_env: SALES_DB_URL
        exports: []
        """)
    config = load_config(path)
    assert config.resolved_source_url(env) is None
    assert state_key(config.resolved_source_url(env)) == ""


def test_url_wins_over_url_env(tmp_path: Path) -> None:
    path = write(tmp_path, """\
        source:
          url: mysql://reader@mysql.internal/shop
          url_env: SALES_DB_URL
        exports: []
        """)
    config = load_config(path)
    assert config.resolved_source_url({"SALES_DB_URL": "postgresql://pg/other"}) == "mysql://reader@mysql.internal/shop"


@pytest.mark.parametrize("source", ["", "source:\n", "source: ~\n"])
def test_no_source_gives_no_source_url(tmp_path: Path, source: str) -> None:
    path = tmp_path / "rivet.yaml"
    path.write_text(source + "exports:\n  - name: orders\n    mode: full\n")
    config = load_config(path)
    assert config.resolved_source_url({"SALES_DB_URL": "postgresql://h/db"}) is None


# -- refusals with their position ------------------------------------------------------


@pytest.mark.parametrize("text, needle", [
    ("exports:\n\t- name: orders\n", "\t"),
    ("exports:\n  - name: orders\n   mode: full\n", "mode"),
    ("source:\n  url: x\n  url_env Y\nexports: []\n", "url_env Y"),
    ("exports:\n  - name: orders\n    mode: full\n  -name: x\n    mode: full\n", "-name"),
    ("exports:\n  - name: orders\n    mode: [full, incremental\n  - name: x\n", "[full"),
], ids=["tab", "indentation", "missing-colon", "dash-without-space", "unclosed-bracket"])
def test_yaml_syntax_error_names_file_line_and_column(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "rivet.yaml"
    path.write_text(text)
    err = refusal(path)
    assert err.code == "RIVET_CONFIG_INVALID"
    line, column = position(text, needle)
    # The offending token, or the construct it left open, is named by its real position.
    assert f"{path}:{line}:{column}" in err.message, err.message
    assert err.message.startswith(f"{path}:{err.details['line']}:{err.details['column']}: "), err.message


def test_unclosed_quote_names_where_it_opened(tmp_path: Path) -> None:
    text = 'source:\n  url: postgresql://h/db\nexports:\n  - name: "orders\n    mode: full\n\n# the end\n'
    path = tmp_path / "rivet.yaml"
    path.write_text(text)
    err = refusal(path)
    assert err.code == "RIVET_CONFIG_INVALID"
    line, column = position(text, '"orders')
    assert f"{path}:{line}:{column}" in err.message, err.message


def test_missing_exports_is_refused_at_the_top_of_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, """\
        source:
          url: postgresql://reader@db.internal/sales
        export:
          - name: orders
        """)
    err = refusal(path)
    assert_at(err, path, 1, 1)
    assert "exports" in err.message


@pytest.mark.parametrize("text", ["", "# only a comment\n", "- name: orders\n", "just a string\n"])
def test_a_config_that_is_not_a_mapping_is_refused(tmp_path: Path, text: str) -> None:
    path = tmp_path / "rivet.yaml"
    path.write_text(text)
    err = refusal(path)
    assert err.code == "RIVET_CONFIG_INVALID"
    assert err.message.startswith(f"{path}:1:1: "), err.message


@pytest.mark.parametrize("value", ["", " {orders: full}", " orders"])
def test_exports_that_is_not_a_list_is_refused_at_its_value(tmp_path: Path, value: str) -> None:
    text = f"source:\n  url: postgresql://h/db\nexports:{value}\n"
    path = tmp_path / "rivet.yaml"
    path.write_text(text)
    err = refusal(path)
    assert err.code == "RIVET_CONFIG_INVALID"
    assert "'exports' must be a list" in err.message
    assert err.message.startswith(f"{path}:3:"), err.message


def test_unknown_mode_is_refused_at_the_mode_value(tmp_path: Path) -> None:
    text = textwrap.dedent("""\
        exports:
          - name: orders
            mode: incremental
          - name: order_lines
            mode: streaming
        """)
    path = tmp_path / "rivet.yaml"
    path.write_text(text)
    err = refusal(path)
    assert_at(err, path, *position(text, "streaming"))
    assert "order_lines" in err.message and "streaming" in err.message
    assert all(mode in err.message for mode in ("full", "incremental", "chunked", "cdc"))


def test_duplicate_export_name_is_refused_at_the_second_declaration(tmp_path: Path) -> None:
    text = textwrap.dedent("""\
        exports:
          - name: orders
            mode: full
          - name: order_lines
            mode: chunked
          - name: orders
            mode: incremental
        """)
    path = tmp_path / "rivet.yaml"
    path.write_text(text)
    err = refusal(path)
    assert_at(err, path, *position(text, "name: orders", occurrence=2))
    assert "'orders'" in err.message and "twice" in err.message


def test_unknown_cdc_engine_is_refused_at_the_engine_value(tmp_path: Path) -> None:
    text = textwrap.dedent("""\
        exports:
          - name: orders
            mode: full
          - name: order_events
            mode: cdc
            cdc:
              engine: kafka
              checkpoint: checkpoints/order_events.json
        """)
    path = tmp_path / "rivet.yaml"
    path.write_text(text)
    err = refusal(path)
    assert_at(err, path, *position(text, "kafka"))
    assert "order_events" in err.message
    assert all(engine in err.message for engine in ("postgres", "mysql", "mongodb", "oracle"))


def test_cdc_export_without_an_engine_is_refused_at_the_export(tmp_path: Path) -> None:
    text = textwrap.dedent("""\
        exports:
          - name: order_events
            mode: cdc
        """)
    path = tmp_path / "rivet.yaml"
    path.write_text(text)
    err = refusal(path)
    assert_at(err, path, *position(text, "name: order_events"))


def test_export_without_a_name_is_refused_at_the_export(tmp_path: Path) -> None:
    text = "exports:\n  - name: orders\n    mode: full\n  - mode: full\n"
    path = tmp_path / "rivet.yaml"
    path.write_text(text)
    err = refusal(path)
    assert_at(err, path, *position(text, "mode: full", occurrence=2))
    assert "name" in err.message


# -- through the CLI -------------------------------------------------------------------


def test_cli_without_a_config_in_the_working_directory_fails_config_not_found(tmp_path: Path) -> None:
    proc = run_cli("info", "--json-errors", cwd=tmp_path)
    assert proc.returncode == 1, describe(proc)
    error = error_object(proc)
    assert error["code"] == "RIVET_CONFIG_NOT_FOUND", describe(proc)
    assert str(tmp_path / "rivet.yaml") in error["message"], describe(proc)
    assert list(tmp_path.iterdir()) == [], describe(proc)


def test_cli_check_reports_an_invalid_config_with_its_position(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    StateStore.open(config, env={}, create=True)  # a good state, so the config is the only failure
    write_config(tmp_path / "pipeline", exports="exports:\n  - name: orders\n    mode: sometimes\n")
    line, column = position(config.read_text(), "sometimes")
    proc = run_cli("-c", str(config), "check", "--json")
    assert proc.returncode == 1, describe(proc)
    row = next(c for c in json.loads(proc.stdout)["checks"] if c["id"] == "config")
    assert (row["status"], row["code"]) == ("fail", "RIVET_CONFIG_INVALID"), describe(proc)
    assert row["message"].startswith(f"{config}:{line}:{column}: "), describe(proc)


def test_cli_check_of_a_config_that_does_not_parse_and_has_no_state_exits_with_the_config_s_class(
        tmp_path: Path) -> None:
    """Bad YAML, or a wrong type, in a config that exists, with no state beside it yet:
    ``check`` exits 1 with ``RIVET_CONFIG_INVALID`` (the config decides), not 5 for the
    state that is missing; the state's row still says so."""
    for name, text in (("yaml", "source: [unclosed\n"), ("types", "exports: 5\n")):
        (tmp_path / name).mkdir()
        config = tmp_path / name / "rivet.yaml"
        config.write_text(text)
        proc = run_cli_process("-c", str(config), "--json", "--json-errors", "check")
        assert proc.returncode == 1, describe(proc)
        assert error_object(proc)["code"] == "RIVET_CONFIG_INVALID", describe(proc)
        rows = {c["id"]: (c["status"], c["code"]) for c in json.loads(proc.stdout)["checks"]}
        assert rows["config"] == ("fail", "RIVET_CONFIG_INVALID") and rows["state"] == ("fail", "RIVET_STATE_MISSING")
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == ["rivet.yaml"], "check created a file"
