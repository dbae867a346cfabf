"""Is a process alive? By pid AND start time, so a reused pid never reads as alive (SPEC §5).

The start time is field 22 of Linux ``/proc/PID/stat``: clock ticks since boot at which
the process started (proc(5)). Two processes that get the same pid one after the other
never share a start time, so a holder record naming (pid, start time) names exactly one
process. Where ``/proc`` cannot be read (not Linux), the start time is None and liveness
falls back to the pid alone.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from statetool.errors import StateError
from statetool.moments import moment

if TYPE_CHECKING:
    from statetool.backends.base import Holder


def host_name() -> str:
    """This host's name as a lease holder records it: the kernel's node name, uname(2),
    which is what gethostname(2) returns (glibc and the BSDs read the same field), so a
    record compares equal whichever of the two wrote it; without ``socket`` to import."""
    return os.uname().nodename


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` from the state on (field 3), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
    return stat[stat.rfind(b")") + 2:].split()


#: The kernel's PF_EXITING task flag (field 9 of ``/proc/PID/stat``): set when a process
#: starts to exit, before it closes its files and long before it is a zombie.
_PF_EXITING = 0x4


def _working(fields: list[bytes]) -> bool:
    """Whether the process whose ``stat`` fields (from field 3) are ``fields`` can still
    work: not a zombie (``Z``/``X``) and not exiting. An exiting process has dropped, or is
    dropping, its files and locks: counting it alive kept a lease live for the instants a
    SIGKILLed command took to exit (a next taker read "live" under load)."""
    if not fields or fields[0] in (b"Z", b"X"):
        return False
    try:
        return not int(fields[6]) & _PF_EXITING
    except (IndexError, ValueError):
        return True


def process_started(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot, or None when it does
    not exist or ``/proc`` cannot be read."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """True when a process ``pid`` exists on this host (signal 0 probe; a zombie counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def alive(pid: int | None, started: int | None) -> bool:
    """True when process ``pid`` runs on this host and, when ``started`` is known, is the
    very process that started then (not a later one that reuses its pid). A zombie (dead,
    not yet reaped: state ``Z``/``X``) and a process that is exiting are dead: they do no
    more work (:func:`_working`)."""
    if pid is None or not pid_alive(pid):
        return False
    fields = _stat_fields(pid)
    if fields is None:
        return True  # no /proc: the pid alone
    if not _working(fields):
        return False
    try:
        return started is None or int(fields[19]) == started
    except (IndexError, ValueError):
        return True


def command_alive(pid: int | None, started: int | None) -> bool:
    """Whether the command a ``leases run`` wrapper started (``pid``, its start time
    ``started``) still works on this host: itself, or any live process of the process group
    it leads (what it started: a shell's next step outlives the command when the wrapper is
    SIGKILLed, SPEC §5). A group id is not reused while a process of the group lives."""
    return alive(pid, started) or (pid is not None and group_alive(pid))


def group_alive(group: int) -> bool:
    """True when a live process (not a zombie, not exiting) of process group ``group`` runs on this host.

    A killpg(2) probe first: a group it finds no process of (not even a zombie) has none
    alive, which is the common answer once a command has ended, and costs one system call
    instead of a read of every process's ``stat``. A group it finds is read from ``/proc``
    (:func:`group_member`): a zombie's group still answers the probe until something reaps
    it, and the reaper of an orphan (pid 1 of a container) may never do so. Without
    ``/proc``, the probe's answer."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # a process of the group runs as another user: it exists
    try:
        return group_member(group) is not None
    except OSError:
        return True


def group_member(group: int) -> int | None:
    """The lowest pid of a live process (not a zombie, not exiting) of process group
    ``group`` on this host, read from ``/proc`` (field 5 of each ``stat`` is the process
    group); None when it has none. Raises ``OSError`` when ``/proc`` cannot be listed."""
    wanted = str(group).encode()
    for pid in sorted(int(name) for name in os.listdir("/proc") if name.isdigit()):
        fields = _stat_fields(pid)
        if fields and len(fields) > 2 and fields[2] == wanted and _working(fields):
            return pid
    return None


def working_pid(pid: int | None, started: int | None, child_pid: int | None, child_started: int | None) -> int | None:
    """The pid of the process on this host that does a lease holder's work: the holder
    (``pid``, started at ``started``) while it is alive, else the command a ``leases run``
    wrapper started (``child_pid``, ``child_started``), else the lowest pid of a live
    process of that command's process group (a shell's step that outlived a SIGKILLed
    wrapper, SPEC §5); None when none of them lives (or ``/proc`` cannot be listed)."""
    if alive(pid, started):
        return pid
    if child_pid is None:
        return None
    if alive(child_pid, child_started):
        return child_pid
    try:
        return group_member(child_pid)
    except OSError:
        return None


def live_lease(key: str, holder: Holder | None) -> StateError:
    """``RIVET_STATE_RUN_IN_PROGRESS`` for lease ``key``, whose holder record is ``holder``
    (None: not written yet), read as live: the refusal of ``leases release`` on either
    backend. It names the process that keeps the lease live on this host
    (:func:`working_pid`): the holder, or, once a ``leases run`` wrapper is gone, the
    process of its command's group that still works, with the command to end that group
    (SPEC §5: a holder's child still alive on this host keeps the lease live)."""
    if holder is None:
        return StateError("RIVET_STATE_RUN_IN_PROGRESS",
                          f"lease {key} is held by a live process: holder record not written yet", {"key": key})
    working = working_pid(holder.pid, holder.started, holder.child_pid, holder.child_started) \
        if holder.host == host_name() else holder.pid
    if working is None or working == holder.pid or holder.child_pid is None:
        return StateError("RIVET_STATE_RUN_IN_PROGRESS",
                          f"lease {key} is held by a live process: {holder.describe()}", {"key": key})
    return StateError("RIVET_STATE_RUN_IN_PROGRESS",
                      f"lease {key} is held by a live process: pid {working} on {holder.host}, of the process "
                      f"group of the command that `leases run` pid {holder.pid} (gone) started as {holder.user} "
                      f"since {moment(holder.acquired_at)}: {holder.command}; it still does that run's work. Wait "
                      f"for it to end, or end the whole group (kill -TERM -- -{holder.child_pid})",
                      {"key": key, "pid": working})
