"""Who made a temporary file, and whether it is still running: the host name as it appears in temporary
names, and a process liveness check. Checkpoints, the feature store and the remote cache name their
temporary files with both, so that a leftover of a dead process on this host is cleaned up and another
host's file on a shared filesystem is never touched."""
from __future__ import annotations

import os
import re
import shutil
import socket

__all__ = ["drop_dead_stages", "host_name", "pid_alive"]


def host_name() -> str:
    """This host's name as it appears in temporary names (letters, digits and ``_``), with its PID
    namespace where Linux tells it: containers of one machine that share a host name but not their
    process ids (a node-local cache or checkpoint folder mounted into several) are different hosts, so a
    pid is only ever checked where it names the same process."""
    name = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:40] or "host"
    try:
        return f"{name}_n{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return name


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (a zombie its parent has not reaped counts as gone)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def drop_dead_stages(folder: str, pattern: str) -> None:
    """Remove the entries of ``folder`` whose whole name matches ``pattern`` and whose process, the
    pattern's first group (a pid of this host), is gone: what writers killed midway left (their ``finally``
    never ran)."""
    own = re.compile(pattern)
    for name in os.listdir(folder):
        m = own.fullmatch(name)
        if m and not pid_alive(int(m.group(1))):
            path = os.path.join(folder, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)
