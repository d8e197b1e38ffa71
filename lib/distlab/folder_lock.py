"""One run per folder: a lock file that a second run into the same folder finds held.

Two launches into one output folder would both train and append to one step log, and one would delete the
other's half-written checkpoint. `FolderLock(folder)` takes an exclusive `flock` on `<folder>/.distlab.lock`
and writes who holds it (pid, host, command, time) into the file. A second holder is refused with one line
naming them. The kernel drops a flock when its process dies, however it dies (SIGKILL, a lost node's
NFS lease ending), so a lock left by a dead run is never "held": the next run takes it over and says whose it
was, read from the file the dead run could not clear.

flock works across the hosts of a shared NFSv4 file system (Linux maps it to a byte-range lock there); on
a file system that has no locks at all, taking it fails with one line saying so rather than running unlocked.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from distlab.jsonio import strict_json

LOCK_NAME = ".distlab.lock"


class FolderInUse(ValueError):
    """Another live process holds the folder (a user error: one line, exit 2, from the CLI)."""


class FolderLock:
    """`with FolderLock(folder, what="training run"):` ... the folder is this process's until the block ends.

    `took_over` says whose stale lock was taken over (None if the file was clear), for the caller to print."""

    def __init__(self, folder: str | Path, what: str = "run"):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.what = what
        self.took_over: dict | None = None
        self._fd: int | None = None

    def acquire(self) -> FolderLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise FolderInUse(f"{self.folder}: in use by another {self.what} ({_describe(holder)}); wait for "
                                  f"it to end, or use another folder") from None
            raise OSError(e.errno, f"{self.path}: cannot lock it ({e.strerror}): this file system has no file "
                                   f"locks; use a folder on one that has") from None
        previous = _read_holder(fd)
        self.took_over = previous or None  # the file says who had it, yet nobody holds it: that process died
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": " ".join(sys.argv)[:300]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (strict_json(me) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        # Cleared, not deleted: deleting would let a waiting run lock the old file while a third locks a new one.
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def describe_takeover(self) -> str | None:
        """The line to print when a dead run's lock was taken over."""
        if not self.took_over:
            return None
        return (f"{self.folder}: took over the lock of a {self.what} that is no longer running "
                f"({_describe(self.took_over)})")

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> dict:
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        return json.loads(text) if text else {}
    except (OSError, ValueError):
        return {"unreadable": True}


def _describe(holder: dict) -> str:
    if not holder or holder.get("unreadable"):
        return "holder not recorded"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, since {holder.get('since')}"
