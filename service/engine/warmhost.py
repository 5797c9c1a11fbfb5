"""Rank processes that start and import beside Ray's own start: warm hosts.

A pre-started rank (engine.standby.prestart) is a Ray actor, so it could start only once
Ray was up (13-14 s of an H200's start) and then imported for 11-16 s more before it could
load. ``dloserve serve`` on a cluster of its own now starts one *warm host* per rank process
before Ray: a plain Python process that imports what a rank needs (torch, diffusers, the
model's classes; not Ray, below) and waits on a Unix socket. The pre-started actor's worker
command is engine.warmshim, which hands the worker's command line, environment and streams
to the host; Ray's worker then runs in the host's interpreter, its imports done. A host
takes one worker. It ends with its parent (the launcher), before and after it became a
worker; a shim that finds no host runs the plain worker instead. A host is started on the
GPU its rank will take (an import may load CUDA's driver, which reads the GPUs visible once:
it did on the H200), so the launcher starts hosts only where each rank has a whole GPU or
none (measured figures: docs/operate.md, "Start-up time"). The Serve app's replica gets a
host too (``ingress``): it imports what the app's module imports (torch among them), less Ray.
"""

from __future__ import annotations

import array
import ast
import importlib
import importlib.abc
import importlib.util
import json
import os
import runpy
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

SHIM = Path(__file__).with_name("warmshim.py")
HOSTED: dict[str, float] = {}  # in a host's worker: when it started, its imports' seconds


def hosted() -> dict[str, float] | None:
    """This process's warm-host facts (``started``, ``import_s``, ``imported_at``), or None
    for a process Ray started itself."""
    return dict(HOSTED) or None


def gpu_per_process(count: int, visible: str | None) -> list[str]:
    """The GPU that rank process i of a node takes before any placement exists: the node's
    i-th as Ray names them (the launcher's ``CUDA_VISIBLE_DEVICES``, else 0..count-1)."""
    ids = [d.strip() for d in (visible or "").split(",") if d.strip()]
    return (ids or [str(i) for i in range(count)])[:count]


FOLDER_PREFIX = "dloserve-hosts-"
OWNER = "owner.pid"  # the launcher's pid, in its hosts' folder


def sweep_stale(parent: str | None = None) -> int:
    """Remove hosts' folders (this user's, in ``parent``: the temp folder) whose launcher is
    gone: a SIGKILLed ``serve`` never ran ``close``. A folder whose owner still lives, or
    that names none, is left. Returns how many went."""
    parent = parent or tempfile.gettempdir()
    n = 0
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return 0
    for entry in entries:
        try:
            if not entry.name.startswith(FOLDER_PREFIX) or not entry.is_dir(follow_symlinks=False) \
                    or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            with open(os.path.join(entry.path, OWNER)) as f:
                pid = int(f.read().strip())
            os.kill(pid, 0)  # alive (or another user's by now: left)
        except ProcessLookupError:
            shutil.rmtree(entry.path, ignore_errors=True)
            n += 1
        except (OSError, ValueError):
            continue
    return n


class WarmHosts:
    """The launcher's warm hosts: one per rank process, by index. ``gpus``: host i's GPU
    (engine.standby.prestart_gpus gives its rank the same), set before torch is imported, in
    case an import already asks CUDA for its devices; None: leave CUDA's view alone."""

    def __init__(self, count: int, model_dir: str | None, sp_size: int,
                 gpus: list[str] | None = None, ingress: str | None = None) -> None:
        sweep_stale()  # those of a launcher that was SIGKILLed
        self.folder = tempfile.mkdtemp(prefix=FOLDER_PREFIX)  # 0700: only this user connects
        with open(os.path.join(self.folder, OWNER), "w") as f:
            f.write(str(os.getpid()))
        self.started_at = time.time()
        self.procs: list[subprocess.Popen[bytes]] = []
        for i in range(count):
            env = {**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}  # is_available() without CUDA's init
            if gpus and i < len(gpus):
                env["CUDA_VISIBLE_DEVICES"] = gpus[i]
            self.procs.append(self._start(f"rank{i}", [model_dir or "", str(sp_size)], env))
        self.ingress = (None if ingress is None
                        else self._start("ingress", ["", "1", ingress], dict(os.environ)))

    def _start(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = open(os.path.join(self.folder, f"{name}.log"), "wb")  # noqa: SIM115 - the child owns it
        command = [sys.executable, "-m", "service.engine.warmhost", self._socket(name), args[0], args[1],
                   str(os.getpid()), *args[2:]]
        try:
            return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT,
                                    start_new_session=True)  # the terminal's Ctrl-C is the launcher's
        finally:
            log.close()

    def _socket(self, name: str) -> str:
        return os.path.join(self.folder, f"{name}.sock")

    def socket(self, i: int) -> str:
        return self._socket(f"rank{i}")

    def _shim(self, name: str) -> str:
        return " ".join(shlex.quote(p) for p in (sys.executable, "-S", "-I", str(SHIM), self._socket(name)))

    def executable(self, i: int) -> str | None:
        """Ray's ``py_executable`` for the worker of rank process ``i``: the shim, pointed at
        host ``i``; None past the hosts."""
        return self._shim(f"rank{i}") if i < len(self.procs) else None

    def ingress_executable(self) -> str | None:
        """``py_executable`` for the Serve app's replica: the shim, pointed at the ingress host."""
        return None if self.ingress is None else self._shim("ingress")

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self, keep: int = 0) -> None:
        """Stop the rank hosts from index ``keep`` on (those no worker will come to); with 0,
        all, the ingress host and the folder. A host that became a worker is Ray's until then."""
        stop = self.procs[keep:] + ([self.ingress] if keep == 0 and self.ingress is not None else [])
        for p in stop:
            if p.poll() is None:
                p.terminate()
        for p in stop:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
        if keep == 0:
            shutil.rmtree(self.folder, ignore_errors=True)


def import_for(model_dir: str | None, sp_size: int) -> None:
    """What a rank process imports before it can load: the model's classes where the folder
    is there, else the families' common ones. Not Ray: its C++ side reads the environment
    (the job, token authentication) once, and the worker's environment comes later."""
    import service.engine.start  # noqa: F401 - torch, the offload library, the model code

    if model_dir and (Path(model_dir) / "model_index.json").is_file():
        warm_model_imports(model_dir, sp_size)
    else:  # the demo model is written while this imports: the common classes
        import diffusers.models.transformers  # noqa: F401
        import transformers  # noqa: F401

        import service.models.registry  # noqa: F401


class _NoRay(importlib.abc.MetaPathFinder):
    """Refuses Ray's import (see ``import_for``) while a host imports another module's imports."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"{name}: not in a warm host")


def imports_of(module: str) -> list[str]:
    """What ``module`` imports at its top level (absolute names), read from its source
    without running it: the ingress host imports these, so the list follows the module."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return []
    names: list[str] = []
    for node in ast.parse(Path(spec.origin).read_text()).body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return names


def import_imports_of(module: str) -> list[str]:
    """Import what ``module`` imports, less Ray and whatever needs it (refused, skipped); the
    names imported."""
    done: list[str] = []
    blocker = _NoRay()
    sys.meta_path.insert(0, blocker)
    try:
        for name in imports_of(module):
            try:
                importlib.import_module(name)
                done.append(name)
            except ImportError:  # Ray, or a module that imports it: the worker imports those
                continue
    finally:
        sys.meta_path.remove(blocker)
    return done


def warm_model_imports(model_dir: str, sp_size: int) -> None:
    """``warm_imports`` by the model's folder (a warm host has no config yet)."""
    from service.models.registry import load_adapter

    adapter = load_adapter(model_dir, sequence_parallel=sp_size)
    adapter.build_transformer()
    for name, entry in adapter.index.items():
        if not name.startswith("_") and isinstance(entry, list) and entry[0]:
            try:
                adapter.component_class(name)
            except Exception:  # noqa: BLE001 - the load names a bad component; this only warms
                pass


def _cuda_driver_loaded() -> bool:
    """Whether an import loaded CUDA's driver (it reads ``CUDA_VISIBLE_DEVICES`` once, then);
    shown in the rank's start facts."""
    try:
        with open("/proc/self/maps") as f:
            return "libcuda.so" in f.read()
    except OSError:
        return False


def _watch_parent(parent: int) -> None:
    """End this process when its launcher (pid ``parent``, given: it may have ended before
    this process asked) does; it would wait for a worker forever."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """The shim's message (command line, environment, folder) and its three streams."""
    fds = array.array("i")
    chunks: list[bytes] = []
    while True:
        data, ancillary, _flags, _addr = conn.recvmsg(1 << 16, socket.CMSG_SPACE(3 * fds.itemsize))
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        if not data:
            break
        chunks.append(data)
        try:
            return json.loads(b"".join(chunks)), list(fds)
        except ValueError:  # more to come
            continue
    raise ConnectionError("the shim closed before its message was whole")


def _become_worker(conn: socket.socket, facts: dict[str, float]) -> None:
    """Run Ray's worker here, as the shim was asked to: its environment, folder, streams and
    arguments; the shim's pid is replaced by this one in Ray's registration (the worker
    reports its own). When the shim ends, so does this process."""
    message, fds = _receive(conn)
    os.environ.clear()
    os.environ.update(message["env"])
    os.chdir(message["cwd"])
    sys.stdout.flush()
    sys.stderr.flush()
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
        os.close(fd)
    conn.sendall(str(os.getpid()).encode())

    def watch_shim() -> None:
        conn.recv(1)
        os._exit(1)

    threading.Thread(target=watch_shim, name="watch-shim", daemon=True).start()
    from service.engine import warmhost  # this file runs as __main__: the importable module holds the facts

    warmhost.HOSTED.update(facts)
    sys.argv = list(message["argv"])
    runpy.run_path(sys.argv[0], run_name="__main__")


def main(argv: list[str]) -> None:
    path, model_dir, sp_size, parent = argv[1], argv[2] or None, int(argv[3]), int(argv[4])
    started = time.time()
    _watch_parent(parent)
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)  # before the imports: a shim that comes early waits in the backlog
    server.listen(1)
    t0 = time.monotonic()
    if len(argv) > 5:  # the Serve app's replica: the imports of its module
        import_imports_of(argv[5])
    else:
        import_for(model_dir, sp_size)
    facts = {"started": started, "import_s": time.monotonic() - t0, "imported_at": time.time(),
             "cuda_loaded": float(_cuda_driver_loaded())}
    print(f"warm host {os.getpid()}: imported in {facts['import_s']:.1f} s; waiting for its worker",
          flush=True)
    conn, _ = server.accept()
    server.close()
    os.unlink(path)  # one worker per host: a later shim runs the plain worker
    _become_worker(conn, facts)


if __name__ == "__main__":
    main(sys.argv)
