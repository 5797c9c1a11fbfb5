"""Where job records and MP4s live: a storage URL read and written through fsspec.

A plain path or ``file://`` URL is a local folder (the default); any other fsspec URL
(``s3://bucket/prefix``, ``gs://...``, a shared mount) works the same way, so every
replica on every node reads the same bytes. Credentials and endpoints come from
``storage_options`` or fsspec's own configuration (e.g. ``FSSPEC_S3_ENDPOINT_URL``).

Layout under the URL: ``<id>.json`` (a job record), ``<id>.mp4`` (its video), and while it
is unfinished ``<id>.req`` and ``<id>.state`` (what a restart needs to run it again:
durable.py). A local
write goes to ``.<name>.<hex>.tmp`` first and is moved into place; the temp file is removed on
every failure, and the job store sweeps those left by a killed process (``sweep_tmp``). A write
that fails (a full disk, a read-only mount, an object store that refuses) raises
``StorageError``: the API answers 507 with Retry-After and ``/readyz`` turns not-ready.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fsspec.core import url_to_fs

CHUNK = 1 << 20
TMP = re.compile(r"^\..+\.[0-9a-f]{8}\.tmp$")  # put_bytes' temp names
STALE_TMP_S = 600.0  # a temp file this old is no write in progress: a killed writer's
MAX_RECORD_BYTES = 1 << 20  # a job record is a few KiB: a larger <id>.json is not one of ours
log = logging.getLogger("dloserve.results")


class UnusableFile(ValueError):
    """A file in the results storage that no writer of ours left (its message names it)."""


class StorageError(OSError):
    """A write to the results storage failed (``errno`` as the OS said: ENOSPC, EROFS, ...).

    Plain OSError arguments, so it survives pickling (from the job-store actor to a replica).
    """


def storage_error(e: OSError, name: str) -> StorageError:
    code = e.errno if isinstance(e.errno, int) else errno.EIO
    why = "the results storage is full" if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else \
        "the results storage refused a write"
    return StorageError(code, f"{why} ({os.strerror(code)}) writing {name}")


def safe_id(job_id: str) -> bool:
    """Ids become object names: never build one from arbitrary input."""
    return 0 < len(job_id) <= 64 and job_id.replace("_", "").replace("-", "").isalnum()


class ResultStorage:
    """Atomic-enough writes (temp name, then move on local disks; object stores put whole
    objects), reads by id, deletes that tolerate a missing file."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.fs, root = url_to_fs(os.path.expanduser(url), **(storage_options or {}))
        self.root = root.rstrip("/")
        self.local_path: Path | None = Path(root) if self.is_local else None
        if self.local_path is not None and not self.local_path.exists():
            self.local_path.mkdir(mode=0o700, parents=True)  # other users see no names either
        self.fs.makedirs(self.root, exist_ok=True)

    @property
    def is_local(self) -> bool:
        return "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def put_bytes(self, name: str, data: bytes) -> None:
        """Write ``name`` whole; StorageError when the storage refuses (no temp file left)."""
        if not self.is_local:
            try:
                self.fs.pipe_file(self._path(name), data)
            except OSError as e:
                raise storage_error(e, name) from e
            return
        tmp = self._path(f".{name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            self.fs.pipe_file(tmp, data)
            os.chmod(tmp, 0o600)  # records and MP4s are their owners' only
            self.fs.mv(tmp, self._path(name))
        except BaseException as e:
            try:
                self.fs.rm_file(tmp)
            except OSError:
                pass  # never written, or moved already
            if isinstance(e, OSError):
                raise storage_error(e, name) from e
            raise

    def sweep_tmp(self, older_than_s: float = STALE_TMP_S) -> int:
        """Remove the temp files of writes that never finished (a killed writer's), older than
        ``older_than_s`` (younger ones may be another replica's write in progress)."""
        if self.local_path is None:
            return 0
        now, n = time.time(), 0
        try:
            entries = list(os.scandir(self.local_path))
        except OSError:
            return 0
        for entry in entries:
            try:
                if TMP.match(entry.name) and entry.is_file(follow_symlinks=False) \
                        and now - entry.stat(follow_symlinks=False).st_mtime > older_than_s:
                    os.unlink(entry.path)
                    n += 1
            except OSError:
                continue
        return n

    def probe(self, nbytes: int) -> None:
        """Write and remove ``nbytes`` (StorageError if that fails): is there room again?"""
        name = f".probe-{uuid.uuid4().hex[:8]}"
        self.put_bytes(name, b"\0" * nbytes)
        self.remove(name)

    def get_bytes(self, name: str) -> bytes | None:
        try:
            return self.fs.cat_file(self._path(name))
        except (FileNotFoundError, OSError):
            return None

    def read_capped(self, name: str, max_bytes: int) -> bytes | None:
        """``name``'s bytes, None if it does not exist; UnusableFile (naming it) for what a
        writer of ours never leaves: a link, a FIFO or a device (opened without blocking
        and without following links, then refused), or more than ``max_bytes`` (refused
        before a byte is read). A results folder is data another process may have touched."""
        if self.local_path is None:
            try:
                if int(self.fs.size(self._path(name))) > max_bytes:
                    raise UnusableFile(f"{self._path(name)} is over {max_bytes} bytes")
                return self.fs.cat_file(self._path(name))
            except FileNotFoundError:
                return None
        path = self.local_path / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return None
        except OSError as e:  # ELOOP: a symlink
            why = os.strerror(e.errno or 0)
            raise UnusableFile(f"{path} cannot be opened as a plain file ({why})") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UnusableFile(f"{path} is not a regular file")
            if st.st_size > max_bytes:
                raise UnusableFile(f"{path} is {st.st_size} bytes, over {max_bytes}")
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:  # grew meanwhile
            raise UnusableFile(f"{path} is over {max_bytes} bytes")
        return data

    def exists(self, name: str) -> bool:
        return bool(self.fs.exists(self._path(name)))

    def size(self, name: str) -> int:
        return int(self.fs.size(self._path(name)))

    def remove(self, name: str) -> None:
        try:
            self.fs.rm_file(self._path(name))
        except FileNotFoundError:
            pass

    def names(self, suffix: str) -> list[str]:
        try:
            found = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        out = []
        for p in found:
            name = str(p).rstrip("/").rsplit("/", 1)[-1]
            if name.endswith(suffix) and not name.startswith("."):
                out.append(name)
        return out

    def chunks(self, name: str) -> Iterator[bytes]:
        """The object in 1 MiB pieces (for a streaming HTTP response)."""
        with self.fs.open(self._path(name), "rb") as f:
            while True:
                b = f.read(CHUNK)
                if not b:
                    return
                yield b

    # -- job records and videos --------------------------------------------------------
    def write_record(self, rec: dict[str, Any]) -> None:
        self.put_bytes(f"{rec['id']}.json", json.dumps(rec).encode())

    def read_records(self) -> list[dict[str, Any]]:
        """Every record that reads back as one; any other ``.json`` (torn by a killed process,
        a link, a FIFO, oversize, nested past the parser's depth) is logged and skipped."""
        recs = []
        for name in self.names(".json"):
            try:
                rec = json.loads(self.read_capped(name, MAX_RECORD_BYTES) or b"")
                if isinstance(rec, dict) and "id" in rec:
                    recs.append(rec)
            except Exception as e:  # noqa: BLE001 - RecursionError too: one file never stops a start
                log.warning("job record %s skipped: %s", self._path(name), str(e)[:200] or type(e).__name__)
        return recs

    def write_video(self, job_id: str, mp4: bytes) -> None:
        self.put_bytes(f"{job_id}.mp4", mp4)

    def video_path(self, job_id: str) -> Path | None:
        """The local file, when the storage is a local folder and the video exists."""
        if self.local_path is None or not safe_id(job_id):
            return None
        p = self.local_path / f"{job_id}.mp4"
        return p if p.is_file() else None

    def has_video(self, job_id: str) -> bool:
        return safe_id(job_id) and self.exists(f"{job_id}.mp4")

    def drop(self, job_id: str) -> None:
        if safe_id(job_id):
            for ext in ("json", "mp4", "req", "state"):
                self.remove(f"{job_id}.{ext}")


def open_storage(url: str, storage_options: dict[str, Any] | None = None) -> ResultStorage:
    """A ResultStorage; raises ValueError naming the URL when fsspec cannot reach it."""
    try:
        return ResultStorage(url, storage_options)
    except (ImportError, ValueError, OSError) as e:
        raise ValueError(f"results URL {url!r}: {e}") from e
