"""``statetool`` on the guides' PATH without the interpreter's start-up: a zygote and its client.

The setup guides' ```sh blocks run as written, in bash, each ``statetool`` a command of
its own: about 160 of them, 0.8 s of CPU each to start Python and import statetool. Here
the ``statetool`` bash finds on PATH is a client of a zygote: a process that imported
statetool once (:func:`support.forked.preload`) and, for each client, forks a child that
takes over the client's stdin, stdout and stderr (passed as descriptors over a Unix
socket), its arguments, environment, working directory and umask, runs
``statetool.cli.main`` and exits; the client exits with the child's code, or dies of the
child's signal. A signal sent to the client is relayed to the child; a client that is
SIGKILLed takes its child with it. Redirections, pipes, ``$?`` and ``&``/``wait`` behave
as with the installed script, which ``tests/test_cli_basics.py`` still runs itself.

Run as a module, this file is the zygote: ``python -m support.zygote SOCKET``.
"""

from __future__ import annotations

import json
import os
import pwd
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: The variable that tells the client where the zygote listens (removed before the run).
SOCKET_VAR = "STATETOOL_TEST_ZYGOTE"
_TESTS = Path(__file__).resolve().parents[1]
_MAX_REQUEST = 1 << 20
_RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

#: The client, run with the tests' interpreter in isolated mode without site (``-IS``):
#: the standard library only, a few milliseconds to start.
CLIENT = f"""#!{sys.executable} -IS
import json, os, signal, socket, sys
env = dict(os.environ)
where = env.pop({SOCKET_VAR!r})
umask = os.umask(0)
os.umask(umask)
sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
sock.connect(where)
request = json.dumps({{"argv": sys.argv[1:], "env": env, "cwd": os.getcwd(), "umask": umask}}).encode()
socket.send_fds(sock, [request], [0, 1, 2])
pid = int(sock.recv(64))
for signum in {[int(s) for s in _RELAYED]!r}:
    signal.signal(signum, lambda signum, frame: os.kill(pid, signum))
code = int(sock.recv(64))
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


def _run_child(request: dict[str, object], fds: list[int]) -> int:
    """In the forked child: take the client's descriptors and settings, run the CLI."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    env = request["env"]
    assert isinstance(env, dict)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(str(request["cwd"]))
    os.umask(int(str(request["umask"])))
    argv = [str(a) for a in request["argv"]]  # type: ignore[attr-defined]
    from statetool.cli import main
    from support.cli import exit_code

    sys.argv = ["statetool", *argv]
    try:
        main(argv)
    except SystemExit as done:
        return exit_code(done)
    return 0


def serve(path: str, parent: int) -> None:
    """The zygote: import everything, then fork one child per client until the pipe
    ``parent`` (its read end) reaches its end: the process that started it is gone."""
    from support.forked import preload

    for name in preload():
        __import__(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)  # the socket appears once the zygote is ready
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(wake_w)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    selector.register(parent, selectors.EVENT_READ)
    clients: dict[int, socket.socket] = {}  # child pid -> its client's connection
    clients_alive: set[int] = set()  # the children whose client is still connected
    while True:
        for key, _events in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                message, fds, _flags, _address = socket.recv_fds(conn, _MAX_REQUEST, 3)
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        listener.close()
                        os.close(parent)
                        signal.set_wakeup_fd(-1)
                        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                        code = _run_child(json.loads(message), fds)
                    except BaseException:  # noqa: BLE001 - a child never returns into the zygote's loop
                        traceback.print_exc()
                    finally:
                        sys.stdout.flush()
                        sys.stderr.flush()
                        os._exit(code)
                for fd in fds:
                    os.close(fd)
                conn.sendall(str(pid).encode())
                clients[pid] = conn
                clients_alive.add(pid)
                selector.register(conn, selectors.EVENT_READ, pid)
            elif key.fileobj == parent:
                if not os.read(parent, 64):  # the process that started the zygote is gone
                    for pid in clients:
                        os.kill(pid, signal.SIGKILL)
                    os.unlink(path)
                    os._exit(0)
            elif key.fileobj == wake_r:
                os.read(wake_r, 4096)
                while True:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    conn = clients.pop(pid)
                    if pid in clients_alive:
                        clients_alive.discard(pid)
                        selector.unregister(conn)
                    try:
                        conn.sendall(str(os.waitstatus_to_exitcode(status)).encode())
                    except OSError:
                        pass  # the client is gone
                    conn.close()
            else:  # a client's end closed before its child ended: the client was killed
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                if not conn.recv(64):
                    selector.unregister(conn)
                    clients_alive.discard(key.data)
                    os.kill(key.data, signal.SIGKILL)


@contextmanager
def zygote(user: str | None = None, python: str = sys.executable, path: list[str] | None = None,
           environment: dict[str, str] | None = None) -> Iterator[dict[str, str]]:
    """Start a zygote; yields the environment a shell needs to use it (``PATH`` with the
    client named ``statetool`` first, then the interpreter's directory and the rest, and
    :data:`SOCKET_VAR`); stops it afterwards.

    The zygote is the interpreter ``python`` with ``environment`` (default: this
    process's) and ``path`` as ``PYTHONPATH`` (default: the package and ``tests``, then
    this process's; it must hold this ``support`` package). With ``user``, it runs as that
    user (its group, no other groups): its children are that user's processes.

    The zygote ends when this process does, even killed: it watches a pipe whose
    write end only this process holds."""
    home = Path(tempfile.mkdtemp(prefix="statetool-zygote-"))
    where = home / "socket"
    bindir = home / "bin"
    bindir.mkdir()
    client = bindir / "statetool"
    client.write_text(CLIENT)
    client.chmod(0o755)
    from support.forked import PACKAGE_ROOT

    if path is None:
        path = [str(PACKAGE_ROOT), str(_TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
    if environment is None:
        environment = dict(os.environ)
    credentials: dict[str, object] = {}
    if user is not None:
        home.chmod(0o755)
        shutil.chown(home, user)  # the zygote creates its socket here
        credentials = {"user": user, "group": pwd.getpwnam(user).pw_gid, "extra_groups": []}
    watched, held = os.pipe()
    try:
        server = subprocess.Popen([python, "-m", "support.zygote", str(where), str(watched)], cwd="/",
                                  env={**environment, "PYTHONPATH": os.pathsep.join(path)}, stdin=subprocess.DEVNULL,
                                  pass_fds=(watched,), **credentials)  # type: ignore[call-overload]
    finally:
        os.close(watched)
    try:
        deadline = time.monotonic() + 120
        while not where.exists():
            assert server.poll() is None, f"the zygote ended with {server.returncode}"
            assert time.monotonic() < deadline, "the zygote did not start in 120 s"
            time.sleep(0.02)
        shell_path = os.pathsep.join([str(bindir), str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        yield {"PATH": shell_path, SOCKET_VAR: str(where)}
    finally:
        os.close(held)
        server.kill()
        server.wait()
        shutil.rmtree(home)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
