"""The executor without Ray: rank processes on this host (``dloserve generate``).

Process r of the engine uses ``cuda:r`` (or the CPU). An engine of one rank runs in this
very process (the rank loop on its own threads), as ``generate`` always has at DP1; with
more, every rank is a spawned process (never forked: CUDA; and two pipelines must not load
in one process at once: accelerate's empty-weight loading patches torch globally), each
running ``start_rank`` and talking to us over a pipe: we send ``assign``/``cancel``/``serve``,
it sends its events, the end of each serve round, and refusals. A process that dies shows
up as a closed pipe.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import threading
import time
import traceback
from typing import Any

import torch

from service.config import EngineConfig

from .events import Event, EventKind
from .executor import Group, GroupExecutor, GroupState, Reply, log_start, short
from .place import RankPlace
from .rank import RankWorker
from .start import load_facts, probe_mode, start_rank, stop_rank

log = logging.getLogger("dloserve.engine")


def rank_device(device: str, process: int) -> torch.device:
    """Process r uses cuda:r on one host; CPU ranks share the host."""
    return torch.device("cuda", process) if device == "cuda" else torch.device("cpu")


class LocalExecutor(GroupExecutor):
    """Rank groups as threads (one process) or spawned processes (several) of this host."""

    def __init__(self, config: EngineConfig, progress: bool = False) -> None:
        super().__init__(config)
        self.progress = progress  # a loading bar from the first rank (generate)
        self._q: queue.SimpleQueue[tuple[Group, int, int, Reply]] = queue.SimpleQueue()

    def start(self) -> None:
        device = rank_device(self.config.parallel.device, 0)
        self._resolve_auto(lambda: probe_mode(self.config, device) if self.config.parallel.processes == 1
                           else _in_child(probe_mode, self.config, device))
        self._lay_out()
        self._start_all()

    # -- the transport ----------------------------------------------------------------
    def _open(self, g: Group) -> None:
        places = [RankPlace(g.info.id, p, g.world, g.info.first_rank) for p in range(g.world)]
        generation = g.generation
        if self.config.parallel.processes == 1:  # the whole engine is one rank: in here
            handles: list[Any] = [_InProcess(self, g, generation, places[0])]
        else:
            from .ports import free_port

            init = f"tcp://127.0.0.1:{free_port()}"
            handles = [_Child(self, g, generation, pl, init) for pl in places]
        with self._lock:
            g.handles = handles
        t0 = time.monotonic()
        facts = [h.wait_ready(self.config.parallel.setup_timeout_s) for h in handles]
        log_start(g, facts, {"setup_s": time.monotonic() - t0})
        self._take_rank_choice(facts)

    def _kill(self, g: Group) -> None:
        for h in g.handles:
            h.kill()
        g.handles = []

    def _send(self, g: Group, process: int, op: str, *args: Any) -> None:
        g.handles[process].send(op, *args)

    def _replies(self, timeout: float) -> list[tuple[Group, int, int, Reply]]:
        out = []
        try:
            out.append(self._q.get(timeout=timeout) if timeout > 0 else self._q.get_nowait())
            while True:
                out.append(self._q.get_nowait())
        except queue.Empty:
            return out

    def _names(self, g: Group) -> list[str]:
        return [h.name for h in g.handles]

    def _reply(self, g: Group, generation: int, process: int, reply: Reply) -> None:
        self._q.put((g, generation, process, reply))


class _InProcess:
    """The one rank of a one-rank engine, in this process: calls go straight to it."""

    def __init__(self, ex: LocalExecutor, g: Group, generation: int, place: RankPlace) -> None:
        self.ex, self.g, self.generation, self.place = ex, g, generation, place
        self.name = f"local-{g.info.id}-gen{generation}-rank{place.rank}"
        self.worker: RankWorker | None = None
        self._stop = threading.Event()

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        t0 = time.monotonic()
        device = rank_device(self.ex.config.parallel.device, self.place.first + self.place.rank)
        self.worker = start_rank(self.ex.config, self.place, None, device, progress=self.ex.progress)
        threading.Thread(target=self._pump, name=f"{self.name}-events", daemon=True).start()
        return load_facts(self.worker, t0)

    def _pump(self) -> None:
        while not self._stop.is_set() and self.worker is not None:
            evs = self.worker.events(0.5)
            if evs:
                self.ex._reply(self.g, self.generation, self.place.rank, Reply("events", tuple(evs)))

    def send(self, op: str, *args: Any) -> None:
        assert self.worker is not None
        if op == "assign":
            try:
                self.worker.assign(*args)
            except Exception as e:  # noqa: BLE001 - refused: that request only
                self.ex._reply(self.g, self.generation, self.place.rank,
                               Reply("refused", (Event(EventKind.REFUSED, job_id=str(args[0])),), short(e)))
        elif op == "cancel":
            self.worker.cancel(*args)
        elif op == "serve":
            threading.Thread(target=self._serve, name=f"{self.name}-serve", daemon=True).start()

    def _serve(self) -> None:
        assert self.worker is not None
        try:
            self.worker.serve()
            reply = Reply("served")
        except Exception as e:  # noqa: BLE001 - the tick loop broke: the group fails
            reply = Reply("failed", error=short(e))
        self.ex._reply(self.g, self.generation, self.place.rank, reply)

    def kill(self) -> None:
        self._stop.set()
        worker, self.worker = self.worker, None
        if worker is not None:
            stop_rank(worker)


class _Child:
    """A spawned rank process and the pipe to it."""

    def __init__(self, ex: LocalExecutor, g: Group, generation: int, place: RankPlace, init: str) -> None:
        self.ex, self.g, self.generation, self.place = ex, g, generation, place
        self.name = f"local-{g.info.id}-gen{generation}-rank{place.rank}"
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        device = rank_device(ex.config.parallel.device, place.first + place.rank)
        progress = ex.progress and place.first + place.rank == 0
        self.proc = ctx.Process(target=_child_main, name=self.name, daemon=True,
                                args=(child, ex.config, place, init, str(device), progress))
        self.proc.start()
        child.close()
        self._lock = threading.Lock()

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while not self.conn.poll(0.5):
            if self.ex._closed:
                raise RuntimeError("executor closed during set-up")
            if not self.proc.is_alive():
                raise RuntimeError(f"{self.name} exited with code {self.proc.exitcode} during set-up")
            if time.monotonic() > end:
                raise RuntimeError(f"set-up took longer than {timeout:.0f} s")
        msg = self.conn.recv()
        if msg[0] != "ready":
            raise RuntimeError(f"{self.name}: {msg[1]}")
        threading.Thread(target=self._read, name=f"{self.name}-reader", daemon=True).start()
        return msg[1]

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                if self.ex.state(self.g.info.id) is GroupState.READY:
                    self.proc.join(timeout=1)
                    self.ex._reply(self.g, self.generation, self.place.rank,
                                   Reply("lost", error=f"process exited with code {self.proc.exitcode}"))
                return
            op = msg[0]
            if op == "events":
                reply = Reply("events", tuple(msg[1]))
            elif op == "refused":
                reply = Reply("refused", (Event(EventKind.REFUSED, job_id=msg[1]),), msg[2])
            elif op == "failed":
                reply = Reply("failed", error=msg[1])
            else:
                reply = Reply("served")
            self.ex._reply(self.g, self.generation, self.place.rank, reply)

    def send(self, op: str, *args: Any) -> None:
        with self._lock:
            try:
                self.conn.send((op, *args))
            except (BrokenPipeError, OSError):
                pass  # it died: the reader reports it

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()


def _child_main(conn: Any, config: EngineConfig, place: RankPlace, init: str, device: str,
                progress: bool) -> None:
    """A rank process: start the rank, then do what the pipe says until it closes."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // place.world))  # ranks share the host's cores
    t0 = time.monotonic()
    try:
        worker = start_rank(config, place, init, torch.device(device), progress=progress)
    except BaseException:  # noqa: BLE001 - reported to the executor, which fails the start
        conn.send(("setup_failed", traceback.format_exc(limit=3).strip().splitlines()[-1]))
        return
    conn.send(("ready", load_facts(worker, t0)))
    lock, stop = threading.Lock(), threading.Event()

    def send(*msg: Any) -> None:
        with lock:
            conn.send(msg)

    def pump() -> None:
        while not stop.is_set():
            evs = worker.events(0.5)
            if evs:
                send("events", evs)

    def serve() -> None:
        try:
            worker.serve()
            send("served")
        except Exception as e:  # noqa: BLE001 - the tick loop broke: the group fails
            send("failed", short(e))

    threading.Thread(target=pump, daemon=True).start()
    while True:
        try:
            op, *args = conn.recv()
        except (EOFError, OSError):
            break
        if op == "assign":
            try:
                worker.assign(*args)
            except Exception as e:  # noqa: BLE001 - refused: that request only
                send("refused", args[0], short(e))
        elif op == "cancel":
            worker.cancel(*args)
        elif op == "serve":
            threading.Thread(target=serve, daemon=True).start()
    stop.set()
    stop_rank(worker)


def _in_child(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a spawned process (its CUDA context and memory go with it)."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(fn, args)

