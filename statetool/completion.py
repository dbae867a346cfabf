"""Shell completion (issue 16 item 4): the scripts ``statetool completion bash|zsh|fish``
prints, and the answers to the requests those scripts make, with typer's own machinery
(its click ``shell_completion`` and its classes of the three shells).

Loaded only by ``statetool completion`` and by a completion request (the script runs
``statetool`` with :data:`COMPLETE_VAR` set; :func:`statetool.cli.main` hands such a run
here first), never by a plain start-up: ``statetool --help`` pays nothing for it.

A request is answered as typer answers one (the instructions ``complete_bash``,
``complete_zsh``, ``complete_fish``), with two rules of statetool's own: the global options
may stand after the command name (:func:`answer`'s ``rearrange``, the CLI's own hoisting),
and export names and lease keys complete from the config and the state the command line
names (:mod:`statetool.operations.names`: read-only, and silent when nothing can be read).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from typer._click.shell_completion import CompletionItem, ShellComplete, add_completion_class, get_completion_class
from typer.completion import completion_init, get_completion_script, shell_complete

from statetool import DEFAULT_CONFIG
from statetool.errors import StateError
from statetool.operations import names
from statetool.operations.context import Context

#: The shells ``statetool completion`` writes a script for.
SHELLS = ("bash", "zsh", "fish")
#: The program the scripts complete, and the variable that makes a run of it a request.
PROG, COMPLETE_VAR = "statetool", "_STATETOOL_COMPLETE"
#: Stands for the word being completed while the global options are hoisted.
_MARK = "\x00"


#: bash's script: typer's request (``COMP_WORDS``/``COMP_CWORD``, ``complete_bash``) with
#: the words bash split at its ``COMP_WORDBREAKS`` (``:`` of every lease key, ``=`` of
#: ``--export=NAME``) joined again where no blank stood between them in ``COMP_LINE``, the
#: last one cut at the cursor; the value of an ``--option=`` word, which typer answers
#: alone, is given its ``--option=`` back; each answer then loses what the word has up to
#: its last break, as readline replaces only the text after it (with no ``=`` among the
#: breaks, the whole ``--export=NAME``). Needs no bash-completion package.
BASH_SCRIPT = r"""_statetool_completion() {
    local IFS=$'\n' line=${COMP_LINE:0:COMP_POINT} words=() word cur prefix= i
    for ((i = 0; i <= COMP_CWORD; i++)); do
        word=${COMP_WORDS[i]}
        if ((i == 0)) || [[ $line == [[:space:]]* ]]; then
            line=${line#"${line%%%%[![:space:]]*}"}
            words+=("")
        fi
        ((i == COMP_CWORD)) && word=${word:0:${#line}}
        words[-1]+=$word
        line=${line:${#word}}
    done
    cur=${words[-1]}
    for ((i = ${#cur}; i > 0; i--)); do
        if [[ $COMP_WORDBREAKS == *"${cur:i-1:1}"* ]]; then
            prefix=${cur:0:i}
            break
        fi
    done
    COMPREPLY=( $( env COMP_WORDS="${words[*]}" COMP_CWORD=$(( ${#words[@]} - 1 )) \
                   %(var)s=complete_bash "$1" ) )
    if [[ $cur == -*=* ]]; then
        word=${cur%%%%=*}=
        for i in "${!COMPREPLY[@]}"; do
            [[ ${COMPREPLY[i]} == "$word"* ]] || COMPREPLY[i]=$word${COMPREPLY[i]}
        done
    fi
    COMPREPLY=( "${COMPREPLY[@]#"$prefix"}" )
    return 0
}

complete -o default -F _statetool_completion %(prog)s
"""


def script(shell: str) -> str:
    """The completion script of ``shell`` (one of :data:`SHELLS`): zsh's and fish's as
    typer writes them for ``--show-completion``, bash's :data:`BASH_SCRIPT` (typer's
    protocol, words with a ``:`` or ``=`` joined again). Raises ``RIVET_CLI_USAGE`` for
    another shell."""
    if shell not in SHELLS:
        raise StateError("RIVET_CLI_USAGE", f"no completion for shell {shell!r}: give one of {', '.join(SHELLS)}")
    if shell == "bash":
        return BASH_SCRIPT % {"var": COMPLETE_VAR, "prog": PROG}
    return get_completion_script(prog_name=PROG, complete_var=COMPLETE_VAR, shell=shell) + "\n"


def _hoisting(base: type[ShellComplete], rearrange: Callable[[list[str]], list[str]]) -> type[ShellComplete]:
    """``base`` (typer's class of one shell) whose words before the one being completed
    are ``rearrange``d first: a global option after the command name is moved before it,
    as :func:`statetool.cli.main` moves it, so ``statetool exports reset -c other.yaml
    <TAB>`` completes from ``other.yaml``. The word being completed is hoisted along (as
    :data:`_MARK`): when it is a global option's value, the words before it are then the
    global options alone, and the option's own completion answers (a path)."""

    class Hoisting(base):  # type: ignore[misc, valid-type]
        def get_completions(self, args: list[str], incomplete: str) -> list[CompletionItem]:
            hoisted = rearrange([*args, _MARK])
            return super().get_completions(hoisted[:hoisted.index(_MARK)], incomplete)

    return Hoisting


def answer(cli: Any, instruction: str, rearrange: Callable[[list[str]], list[str]]) -> int:
    """Answer the completion request ``instruction`` (the value of :data:`COMPLETE_VAR`)
    for the click command tree ``cli``: the completions go to stdout, one per line, in the
    shell's format, and the exit code is returned (1 with typer's message on stderr for an
    instruction or shell it does not know)."""
    completion_init()
    for shell in SHELLS:
        base = get_completion_class(shell)
        assert base is not None, f"typer registers no completion class for {shell}"
        add_completion_class(_hoisting(base, rearrange), shell)
    return shell_complete(cli, {}, PROG, COMPLETE_VAR, instruction)


def _contexts(ctx: Any) -> list[Context]:
    """The operations' contexts of the command line being completed: one per ``--config``
    (as parsed so far; ``./rivet.yaml`` when none is given), with its ``--state-url``,
    this environment, and no wait for a lock (a TAB never waits)."""
    root = ctx.find_root()
    source = root.get_parameter_source("config")
    given = source is not None and source.name == "COMMANDLINE"
    configs = list(root.params.get("config") or ()) or [Path(DEFAULT_CONFIG)]
    return [Context(Path(config), root.params.get("state_url"), lock_wait=0.0, command="statetool completion",
                    config_given=given) for config in configs]


def _merged(found: list[list[tuple[str, str]]]) -> list[tuple[str, str]]:
    """The ``(value, help)`` pairs of every config in turn, each value once (its first)."""
    merged: dict[str, str] = {}
    for pairs in found:
        for value, text in pairs:
            merged.setdefault(value, text)
    return list(merged.items())


def export_names(ctx: Any) -> list[tuple[str, str]]:
    """``[(export name, help)]`` for a NAME or ``--export`` being completed in ``ctx``, of
    every config it names (:func:`statetool.operations.names.export_names`)."""
    return _merged([names.export_names(context) for context in _contexts(ctx)])


def lease_keys(ctx: Any) -> list[tuple[str, str]]:
    """``[(lease key, help)]`` for the KEY of ``leases release`` being completed in ``ctx``
    (:func:`statetool.operations.names.lease_keys`)."""
    return _merged([names.lease_keys(context) for context in _contexts(ctx)])
