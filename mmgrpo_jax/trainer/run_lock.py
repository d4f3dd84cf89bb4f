"""One run per run directory: an advisory lock file naming its holder.

`<run_dir>/run.lock` is held with `flock` for the life of the run and names the holder (pid,
host, start time). The kernel drops the lock when its process dies, however it dies, so a file
left behind by a killed run is taken over (with a warning naming the dead holder) instead of
blocking the directory for good.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import IO, Any

from mmgrpo_jax.errors import UserError

logger = logging.getLogger(__name__)

LOCK_NAME = "run.lock"


class RunLock:
    """`with RunLock(run_dir):` the body runs only while no other process uses run_dir.
    `role` is how errors name the folder to the user (a sweep's is its `out`)."""

    def __init__(self, run_dir: str | Path, role: str = "run_dir") -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.role = role
        self._file: IO[str] | None = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        while True:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                file = self.path.open("a+")
            except OSError as err:
                raise UserError(f"{self.role} {str(self.path.parent)!r}: {err.strerror}") from None
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _describe(_read(file))
                file.close()
                raise UserError(
                    f"{self.role} {str(self.path.parent)!r} is in use by another run ({holder}); "
                    f"wait for it to finish, stop it, or choose another {self.role}"
                ) from None
            except OSError as err:  # a filesystem without locks (some network mounts)
                file.close()
                raise UserError(
                    f"{self.role} {str(self.path.parent)!r} cannot be locked ({err.strerror}): "
                    "put it on a local filesystem"
                ) from None
            if _same_file(file, self.path):
                break
            file.close()  # its holder released and removed it between our open and our lock
        previous = _read(file)
        if previous:  # the holder died without releasing: the kernel already dropped its lock
            logger.warning(
                "taking over the lock of %s from a run that did not exit cleanly (%s)",
                self.path.parent,
                _describe(previous),
            )
        file.seek(0)
        file.truncate()
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        file.write(json.dumps(holder))
        file.flush()
        self._file = file

    def release(self) -> None:
        if self._file is None:
            return
        self.path.unlink(missing_ok=True)  # before unlocking: a waiter must not see our record
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()
        self._file = None


def _same_file(file: IO[str], path: Path) -> bool:
    try:
        return os.fstat(file.fileno()).st_ino == path.stat().st_ino
    except FileNotFoundError:
        return False


def _read(file: IO[str]) -> dict[str, Any]:
    file.seek(0)
    text = file.read()
    try:
        return json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return {"unreadable": text[:80]}


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "holder unknown"
    if "pid" not in holder:
        return f"lock file content {holder!r}"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return f"pid {holder['pid']} on {holder.get('host', '?')}, since {since}"
