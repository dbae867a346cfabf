"""Which filesystem a path lives on, read from Linux ``/proc/mounts``.

A declared state directory on the container's own filesystem (overlay, tmpfs) is lost
with the container; one on a network filesystem makes ``flock`` and SQLite's WAL only as
reliable as that filesystem (https://www.sqlite.org/wal.html: WAL does not work over a
network filesystem).

Facts only: reads the host's mount table, opens no state and changes nothing (``doctor``
reports it for a declared directory, whether or not a state is there yet).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC_MOUNTS = Path("/proc/mounts")
EPHEMERAL = frozenset({"overlay", "overlayfs", "tmpfs", "ramfs", "aufs"})
#: The kernel's own filesystems: views of the kernel whose entries it makes itself, which
#: take no file a program creates (``/proc``, ``/sys`` and those mounted below them).
KERNEL = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs", "pstore",
                    "bpf", "efivarfs", "fusectl", "binfmt_misc", "devpts", "mqueue", "selinuxfs", "autofs"})
NETWORK = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "fuse.sshfs", "ceph", "glusterfs", "fuse.glusterfs",
                     "9p", "afs", "lustre", "fuse.s3fs", "fuse.gcsfuse", "fuse.rclone"})


@dataclass(frozen=True)
class Mount:
    """The mount a path is on: its mount point, filesystem type and source device."""

    point: str
    fstype: str
    source: str

    @property
    def ephemeral(self) -> bool:
        """True for a filesystem that dies with its container (overlay, tmpfs, ...)."""
        return self.fstype in EPHEMERAL

    @property
    def kernel(self) -> bool:
        """True for a kernel filesystem (proc, sysfs, ...: :data:`KERNEL`), which holds no
        file a program creates."""
        return self.fstype in KERNEL

    @property
    def network(self) -> bool:
        """True for a network filesystem (NFS, SMB, FUSE network mounts, ...)."""
        return self.fstype in NETWORK


def _unescape(field: str) -> str:
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def mount_of(path: Path) -> Mount | None:
    """The mount holding ``path`` (the longest mount point that prefixes it), or None
    when ``/proc/mounts`` cannot be read."""
    try:
        lines = PROC_MOUNTS.read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best: Mount | None = None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = _unescape(fields[1])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.point)):
            best = Mount(point, fields[2], _unescape(fields[0]))
    return best
