"""Shell completion (issue 16 item 4): ``statetool completion bash|zsh|fish`` prints the
script of each shell, and the requests those scripts make are answered by the real CLI:
commands, export names from the config and the state, lease keys with their holder.

Two ways in: the protocol as a script speaks it (``_STATETOOL_COMPLETE`` and the words in
the environment, the CLI run in this process), and the generated script itself, sourced
in a real bash (zsh and fish where they are installed) that runs the installed
``statetool``. Completing reads only: on a missing or unreadable state it completes what
the config has, says nothing, and creates no file.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import pytest

from support import describe, error_object, process_env, run_cli, write_config
from support.backends import StateBackend
from support.states import build_state
from statetool.cli import command_tree

#: Where pip put the ``statetool`` script of this interpreter's environment.
BIN = Path(sys.executable).parent
#: The config's exports: the first two are in the built state too, ``refunds`` is not;
#: ``order_events`` is in the built state only.
EXPORTS = ("exports:\n  - {name: orders, mode: incremental}\n  - {name: order_lines, mode: chunked}\n"
           "  - {name: refunds, mode: full}\n")
CONFIG_NAMES = ["orders", "order_lines", "refunds"]
ALL_NAMES = [*CONFIG_NAMES, "order_events"]
#: Every argument that takes an export name (the ``--export`` options are found in the tree).
NAME_ARGUMENTS = (("exports", "show"), ("exports", "set-cursor"), ("exports", "reset"))


def _pipeline(backend: StateBackend) -> Path:
    """A built state (orders, order_lines, order_events) under a config that declares
    orders, order_lines and refunds; returns the config."""
    config = write_config(backend.pipeline)
    build_state(config, backend.url, checkpoint_dir=config.parent, env=backend.env)
    config.write_text(config.read_text().split("exports:")[0] + EXPORTS)
    return config


def everything(directory: Path) -> dict[str, str]:
    """Every path below ``directory`` (``directory`` itself when it is missing), each with
    its content's sha256 or ``dir``: a created folder shows, as a changed file does."""
    if not directory.exists():
        return {}
    return {str(p.relative_to(directory)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*"))}


def complete(*words: str, cwd: Path, env: dict[str, str] | None = None, shell: str = "bash") -> list[str]:
    """What the real CLI answers a ``shell`` script that asks for the completions of the
    last of ``words`` (``""``: a new word after a space), one line each, as bash's script
    asks (``COMP_WORDS``/``COMP_CWORD``) or fish's (``_TYPER_COMPLETE_ARGS``, with the
    help after a tab); none is one empty line, as bash reads it. Asserts exit 0 and
    nothing on stderr."""
    line = " ".join(["statetool", *words])
    request = {"bash": {"_STATETOOL_COMPLETE": "complete_bash", "COMP_WORDS": line, "COMP_CWORD": str(len(words))},
               "fish": {"_STATETOOL_COMPLETE": "complete_fish", "_TYPER_COMPLETE_FISH_ACTION": "get-args",
                        "_TYPER_COMPLETE_ARGS": line}}[shell]
    proc = run_cli(cwd=cwd, env={**(env or {}), **request})
    assert proc.returncode == 0 and not proc.stderr, describe(proc)
    lines = proc.stdout.splitlines()
    return [] if lines == [""] else lines


def _shell_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a real shell: the installed ``statetool`` first on PATH."""
    env = process_env(extra)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def _needs(shell: str) -> str:
    found = shutil.which(shell)
    if found is None:
        pytest.skip(f"{shell} is not installed (command -v {shell} finds nothing)")
    return found


# -- the scripts ------------------------------------------------------------------------

#: How each shell checks a script's syntax without running it.
SYNTAX_CHECK = {"bash": ["-n"], "zsh": ["-n"], "fish": ["--no-execute"]}


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_prints_the_script_of_each_shell(tmp_path: Path, shell: str) -> None:
    proc = run_cli("completion", shell, cwd=tmp_path)
    assert proc.returncode == 0 and not proc.stderr, describe(proc)
    assert f"_STATETOOL_COMPLETE=complete_{shell}" in proc.stdout and "statetool" in proc.stdout, proc.stdout
    assert run_cli("--json", "completion", shell, cwd=tmp_path).stdout == proc.stdout  # a script, never JSON
    assert everything(tmp_path) == {}, "printing a script created a file"
    if shutil.which(shell):
        script = tmp_path / f"statetool.{shell}"
        script.write_text(proc.stdout)
        checked = subprocess.run([shell, *SYNTAX_CHECK[shell], str(script)], capture_output=True, text=True,
                                 timeout=60)
        assert checked.returncode == 0, describe(checked)


def test_an_unknown_shell_is_a_usage_error_that_prints_no_script(tmp_path: Path) -> None:
    proc = run_cli("--json-errors", "completion", "tcsh", cwd=tmp_path)
    obj = error_object(proc)
    assert obj["code"] == "RIVET_CLI_USAGE" and "bash, zsh, fish" in obj["message"], obj
    assert "Usage: statetool completion [OPTIONS] SHELL" in obj["message"] and proc.stdout == "", describe(proc)


# -- the protocol, through the real CLI --------------------------------------------------


def test_commands_groups_and_shells_complete(tmp_path: Path) -> None:
    assert complete("ex", cwd=tmp_path) == ["export", "exports"]
    assert complete("exports", "", cwd=tmp_path) == ["list", "show", "set-cursor", "reset"]
    assert complete("completion", "", cwd=tmp_path) == ["bash", "zsh", "fish"]


def _export_parameters() -> list[tuple[str, ...]]:
    """The words before an export name: every ``--export`` option in the command tree, and
    :data:`NAME_ARGUMENTS`."""
    found: list[tuple[str, ...]] = list(NAME_ARGUMENTS)

    def walk(command: Any, path: tuple[str, ...]) -> None:
        for param in command.params:
            if "--export" in getattr(param, "opts", ()):
                found.append((*path, *(["state.json"] if path == ("import",) else []), "--export"))
        for name, sub in (getattr(command, "commands", None) or {}).items():
            walk(sub, (*path, name))

    walk(command_tree(), ())
    return found


EXPORT_PARAMETERS = _export_parameters()


@pytest.mark.parametrize("words", EXPORT_PARAMETERS, ids=" ".join)
def test_every_export_name_completes_from_the_config_and_the_state(tmp_path: Path, words: tuple[str, ...]) -> None:
    config = _pipeline(StateBackend.sqlite(tmp_path))
    before = everything(tmp_path)
    assert complete(*words, "", cwd=config.parent) == ALL_NAMES
    assert complete(*words, "order_", cwd=config.parent) == ["order_lines", "order_events"]
    assert everything(tmp_path) == before, "completing changed or created a file"


def test_the_export_names_come_with_their_mode_or_where_they_are(state_backend: StateBackend) -> None:
    config = _pipeline(state_backend)
    got = complete("exports", "reset", "", cwd=config.parent, env=state_backend.env, shell="fish")
    assert got == ["orders\tincremental", "order_lines\tchunked", "refunds\tfull", "order_events\tin the state only"]


def test_global_options_after_the_command_name_say_which_config_and_state(tmp_path: Path) -> None:
    config = _pipeline(StateBackend.sqlite(tmp_path))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert complete("exports", "reset", "", cwd=elsewhere) == []  # no config, no state here
    assert complete("exports", "reset", "-c", str(config), "", cwd=elsewhere) == ALL_NAMES
    assert complete("-c", str(config), "doctor", "--export", "", cwd=elsewhere) == ALL_NAMES
    other = write_config(tmp_path / "other", exports="exports:\n  - name: audit_log\n    mode: full\n")
    assert complete("exports", "reset", "-c", str(other), "--state-url", f"sqlite:{config.parent}", "",
                    cwd=elsewhere) == ["audit_log", "order_events", "order_lines", "orders"]
    assert complete("-c", str(config), "-c", str(other), "doctor", "--export", "", cwd=elsewhere) == \
        [*ALL_NAMES, "audit_log"]  # a fleet's doctor: every config's names, each once


def test_lease_keys_complete_with_their_holder(state_backend: StateBackend) -> None:
    config = _pipeline(state_backend)
    holder = subprocess.Popen([sys.executable, "-m", "statetool", "-c", str(config), "leases", "run", "--export",
                               "orders", "--", "sleep", "60"], cwd=config.parent, env=process_env(state_backend.env),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            leases = run_cli("--json", "leases", cwd=config.parent, env=state_backend.env)
            if any(row["state"] == "live" for row in json.loads(leases.stdout or '{"leases": []}')["leases"]):
                break
            assert holder.poll() is None and time.monotonic() < deadline, describe(leases)
            time.sleep(0.05)
        got = complete("leases", "release", "", cwd=config.parent, env=state_backend.env, shell="fish")
        assert f"chunk-run:orders\tlive: pid {holder.pid} on " in "\n".join(got), got
        keys = [row["key"] for row in json.loads(leases.stdout)["leases"]]
        assert [line.split("\t")[0] for line in got] == keys  # every lease the list shows, in its order
        assert complete("leases", "release", "chunk-run:ord", cwd=config.parent, env=state_backend.env) == \
            [key for key in keys if key.startswith("chunk-run:ord")]
    finally:
        holder.kill()
        holder.wait(timeout=60)


# -- read-only, and silent where nothing can be read --------------------------------------


def test_completing_on_a_missing_state_creates_no_file(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline", exports=EXPORTS)
    absent = tmp_path / "declared"  # a declared directory that is not there (an unmounted volume)
    before = everything(tmp_path)
    assert complete("exports", "reset", "", cwd=config.parent) == CONFIG_NAMES
    assert complete("leases", "release", "", cwd=config.parent) == []
    assert complete("exports", "reset", "", cwd=config.parent, env={"RIVET_STATE_URL": f"sqlite:{absent}"}) == \
        CONFIG_NAMES
    assert complete("leases", "release", "", cwd=config.parent, env={"RIVET_STATE_URL": f"sqlite:{absent}"}) == []
    assert complete("init", "", cwd=config.parent) == []  # a request never runs the command it completes
    assert everything(tmp_path) == before, "completing on a missing state created or changed a file"


@pytest.mark.parametrize("damage", ["not a database", "another application", "broken config"])
def test_what_cannot_be_read_completes_nothing_silently(tmp_path: Path, damage: str) -> None:
    backend = StateBackend.sqlite(tmp_path)
    config = _pipeline(backend)
    state = config.parent / ".rivet_state.db"
    expected = CONFIG_NAMES
    if damage == "not a database":
        state.write_bytes(b"this is no SQLite file\n" * 200)
    elif damage == "another application":
        state.unlink()
        import sqlite3

        other = sqlite3.connect(state)
        other.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
        other.commit()
        other.close()
    else:
        config.write_text("exports: [unclosed\n")
        expected = ["order_events", "order_lines", "orders"]  # the state's, as the state knows them
    before = everything(tmp_path)
    assert complete("exports", "reset", "", cwd=config.parent) == expected
    assert complete("doctor", "--export", "", cwd=config.parent) == expected
    assert everything(tmp_path) == before, f"completing beside {damage} changed or created a file"


# -- the generated scripts in real shells --------------------------------------------------


def _bash_completions(line: list[str], cwd: Path, env: dict[str, str], typed: str | None = None) -> list[str]:
    """COMPREPLY of the sourced ``statetool completion bash`` for the words ``line``, in a
    real bash, after checking that ``complete -p`` registered it: the function is called
    as bash calls it, with ``COMP_WORDS``, ``COMP_CWORD``, and the command line ``typed``
    (the words with a space between each when not given) as ``COMP_LINE``, the cursor at
    its end (``COMP_POINT``)."""
    typed = " ".join(["statetool", *line]) if typed is None else typed
    program = ('source <(statetool completion bash) && complete -p statetool && '
               'COMP_LINE=$1 && COMP_POINT=${#1} && shift && '
               'COMP_WORDS=("$@") && COMP_CWORD=$(( $# - 1 )) && _statetool_completion statetool && '
               'printf "REPLY %s\\n" "${COMPREPLY[@]}"')
    proc = subprocess.run(["bash", "--norc", "--noprofile", "-c", program, "bash", typed, "statetool", *line],
                          cwd=cwd, env=_shell_env(env), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and not proc.stderr, describe(proc)
    assert "complete -o default -F _statetool_completion statetool" in proc.stdout, describe(proc)
    return [line.removeprefix("REPLY ") for line in proc.stdout.splitlines() if line.startswith("REPLY ")]


def test_the_bash_script_completes_export_names_in_a_real_bash(state_backend: StateBackend) -> None:
    _needs("bash")
    config = _pipeline(state_backend)
    before = everything(state_backend.pipeline)
    assert _bash_completions(["exports", "set-cursor", ""], config.parent, state_backend.env) == ALL_NAMES
    assert _bash_completions(["doctor", "--export", "ref"], config.parent, state_backend.env) == ["refunds"]
    assert _bash_completions(["lea"], config.parent, state_backend.env) == ["leases"]
    assert everything(state_backend.pipeline) == before


def test_the_fish_script_completes_export_names_in_a_real_fish(tmp_path: Path) -> None:
    fish = _needs("fish")
    config = _pipeline(StateBackend.sqlite(tmp_path))
    proc = subprocess.run([fish, "--no-config", "-c", "statetool completion fish | source; "
                           "complete -C 'statetool exports reset '"], cwd=config.parent, env=_shell_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and not proc.stderr, describe(proc)
    assert sorted(proc.stdout.splitlines()) == sorted(["orders\tincremental", "order_lines\tchunked",
                                                       "refunds\tfull", "order_events\tin the state only"])


def test_the_zsh_script_hands_export_names_to_zsh_completion(tmp_path: Path) -> None:
    """The zsh script's function, run in a real zsh with the words of a command line, hands
    its answer to ``_arguments`` (stood in for: it prints what it is given, as zle is not
    there to draw a menu)."""
    zsh = _needs("zsh")
    config = _pipeline(StateBackend.sqlite(tmp_path))
    program = ('compdef() { : }; _arguments() { print -rl -- "$@" }; eval "$(statetool completion zsh)"; '
               'words=(statetool exports reset ord); CURRENT=4; _statetool_completion')
    proc = subprocess.run([zsh, "-f", "-c", program], cwd=config.parent, env=_shell_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and not proc.stderr, describe(proc)
    assert proc.stdout.strip() == ('*: :(("orders":"incremental" "order_lines":"chunked" '
                                   '"order_events":"in the state only"))'), describe(proc)


# -- words with a colon (a lease key) or an `=` in bash ----------------------------------

#: The lease keys of the state :func:`_pipeline` builds, as ``statetool leases`` lists them.
KEYS = ["chunk-run:order_events", "chunk-run:order_lines", "chunk-run:orders"]


def _leased(tmp_path: Path) -> Path:
    """The pipeline of :func:`_pipeline` on SQLite, its leases checked to be :data:`KEYS`."""
    config = _pipeline(StateBackend.sqlite(tmp_path))
    leases = json.loads(run_cli("--json", "leases", cwd=config.parent).stdout)["leases"]
    assert [row["key"] for row in leases] == KEYS, leases
    return config


#: The prompt of the interactive bash (readline draws it again as it redisplays a line).
PROMPT = "@@ready@@ "


def _typed_in_bash(keys: str, cwd: Path, setup: str = "") -> tuple[str, str]:
    """Type ``keys`` (TABs among them) into a real interactive bash on a pseudo-terminal
    that has sourced ``statetool completion bash`` (after ``setup``), then make the line
    the quoted argument of an ``echo`` (Ctrl-A, Ctrl-E) and run it: returns what the
    terminal showed while the keys were typed (a listing of completions shows there) and
    the command line as bash had it at the end (the echo's output)."""
    env = _shell_env({"PS1": PROMPT, "TERM": "dumb", "INPUTRC": "/dev/null", "HISTFILE": "/dev/null"})
    pid, fd = pty.fork()
    if pid == 0:  # the child: an interactive bash on the terminal, or gone
        try:
            os.chdir(cwd)
            os.execve(shutil.which("bash") or "/bin/bash", ["bash", "--norc", "--noprofile", "-i"], env)
        finally:
            os._exit(127)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 250, 0, 0))
    shown = b""

    def until(pattern: bytes) -> None:
        nonlocal shown
        deadline = time.monotonic() + 120
        while not re.search(pattern, shown, re.DOTALL):
            assert time.monotonic() < deadline, f"bash never showed {pattern!r}: {shown!r}"
            if select.select([fd], [], [], 0.2)[0]:
                shown += os.read(fd, 65536)

    prompt = re.escape(PROMPT.encode())
    try:
        until(prompt)
        os.write(fd, f"{setup}\nsource <(statetool completion bash)\n".encode())
        until(b"completion bash\\)\r\n" + prompt)
        start = len(shown)
        os.write(fd, keys.encode() + b"\x01echo 'L''INE:\x05'\n")  # prints LINE: and the line, shows L''INE:
        until(b"\nLINE:[^\r\n]*\r\n" + prompt)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(fd)
    text = shown[start:].decode().replace("\r", "")
    typed, _, echoed = text.rpartition("\nLINE:")
    return typed, echoed.split("\n")[0]


#: ``COMP_WORDBREAKS`` as a test sets it: bash's own, without ``:`` (as bash-completion
#: users often set it), and without ``:`` nor ``=`` (as npm's completion script leaves it).
WORD_BREAKS = {"bash's own word breaks": "", "no ':' among the word breaks": "COMP_WORDBREAKS=${COMP_WORDBREAKS//:}",
               "neither ':' nor '=' among the word breaks": "COMP_WORDBREAKS=${COMP_WORDBREAKS//[:=]}"}


@pytest.mark.parametrize("breaks", list(WORD_BREAKS))
def test_a_lease_key_completes_across_its_colon_in_an_interactive_bash(tmp_path: Path, breaks: str) -> None:
    _needs("bash")
    config = _leased(tmp_path)
    setup = WORD_BREAKS[breaks]
    before = everything(tmp_path)
    assert _typed_in_bash("statetool leases release ch\t", config.parent, setup)[1] == \
        "statetool leases release chunk-run:order"
    assert _typed_in_bash("statetool leases release chunk-run:o\t", config.parent, setup)[1] == \
        "statetool leases release chunk-run:order"
    typed, line = _typed_in_bash("statetool leases release chunk-run:order\t\t", config.parent, setup)
    assert line == "statetool leases release chunk-run:order", typed
    listed = {word.rpartition(":")[2] for word in typed.split()}  # whole keys, or after the colon
    assert {key.rpartition(":")[2] for key in KEYS} <= listed, typed  # the second TAB lists them
    assert _typed_in_bash("statetool leases release chunk-run:order_l\t", config.parent, setup)[1] == \
        "statetool leases release chunk-run:order_lines "
    assert _typed_in_bash("statetool doctor --export=order_l\t", config.parent, setup)[1] == \
        "statetool doctor --export=order_lines "
    assert everything(tmp_path) == before, "completing changed or created a file"


@pytest.mark.parametrize(("words", "expected"), [
    (["leases", "release", "chunk-run", ":", "order_"], ["order_events", "order_lines"]),
    (["leases", "release", "chunk-run", ":"], ["order_events", "order_lines", "orders"]),
    (["leases", "release", "chunk"], KEYS),
    (["leases", "release", ""], KEYS),
    (["doctor", "--export", "=", "order_"], ["order_lines", "order_events"]),
], ids=" ".join)
def test_the_bash_function_rejoins_the_words_bash_split_at_its_word_breaks(tmp_path: Path, words: list[str],
                                                                          expected: list[str]) -> None:
    """The words as bash hands them to the function after splitting at ``:`` and ``=``
    (``COMP_WORDS``, ``COMP_CWORD``, ``COMP_LINE``, ``COMP_POINT``): the replies are what
    readline puts in place of the text after the last break, in the order of the list."""
    _needs("bash")
    config = _leased(tmp_path)
    typed = "statetool " + " ".join(words).replace(" : ", ":").replace(" :", ":").replace(" = ", "=")
    assert _bash_completions(words, config.parent, {}, typed) == expected
