"""Results folders that stopped instances left behind: the next ``dloserve serve`` removes them.

Without ``--results-url`` each instance keeps its jobs in ``~/.cache/dloserve/results/port-PORT``
(locked while it runs). The rule, applied at every start:

- the folder of this start's port is reused: the job store reloads its records, and they
  expire as usual (``--retention-s``, ``--max-jobs``);
- any other ``port-N`` folder whose lock is free (no instance runs there) and in which
  nothing changed for longer than ``--retention-s`` is removed, records and MP4s with it:
  every job in it has expired by then anyway;
- a folder holding anything but dloserve's own files (records, MP4s, the lock, temporary
  files of a write) is left alone, and so is anything not named ``port-N``.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import time
from pathlib import Path

FOLDER = re.compile(r"port-\d+")
OWN_FILE = re.compile(r"\.lock|[A-Za-z0-9_-]{1,64}\.(json|mp4)|\..+\.tmp")


def newest_change(folder: Path) -> float:
    """The latest mtime of the folder and its files (a running instance touches them)."""
    times = [folder.stat().st_mtime]
    for p in folder.iterdir():
        try:
            times.append(p.lstat().st_mtime)
        except FileNotFoundError:
            continue
    return max(times)


def only_ours(folder: Path) -> bool:
    return all(p.is_file() and not p.is_symlink() and OWN_FILE.fullmatch(p.name) for p in folder.iterdir())


def clean_results(root: Path, keep: Path, retention_s: float, now: float | None = None) -> list[Path]:
    """Remove the stale instance folders under ``root`` (the rule above); returns them."""
    now = time.time() if now is None else now
    if not root.is_dir():
        return []
    removed = []
    for folder in sorted(root.iterdir()):
        if (not FOLDER.fullmatch(folder.name) or folder.is_symlink() or not folder.is_dir()
                or folder.resolve() == keep.resolve()):
            continue
        try:
            if now - newest_change(folder) <= retention_s or not only_ours(folder):
                continue
            with open(folder / ".lock", "a+") as lock:  # held while removing: nobody starts there
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # an instance runs there, however old its files look
                for p in folder.iterdir():
                    if p.name != ".lock":
                        p.unlink(missing_ok=True)
                os.unlink(folder / ".lock")
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        except OSError:
            continue  # not ours to remove (permissions), or it changed meanwhile
    return removed
