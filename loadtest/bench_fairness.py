"""Fair share between API keys, before and after, side by side in one run (CPU, no Ray).

    python loadtest/bench_fairness.py --out loadtest/results/cpu-fairness-DATE.json

Three keys on one rank group: key-a floods (``--flood`` clients, each submitting a job,
retrying on 429 after Retry-After, and submitting the next as soon as one ends); key-b and
key-c each send one job at a random time in ``[0, --horizon-s]`` (retrying on 429 the
same way). What is measured is the others' wait: from their first attempt until a rank
takes their job. Every job holds a rank for ``--job-s`` seconds.

The real dispatcher and schedulers run on the tests' fake executor and a simulated clock
(the fairness rule is the scheduler's, not the ranks'), so a run of hours of simulated
traffic takes seconds and is exactly reproducible from ``--seed``. The two policies:

- before: one queue for every key, no quota (``fair=False``: the scheduler of before);
- after: whose turn it is first, and each key's own queue quota (the service's defaults:
  ``--max-queued-per-key`` 16, no running limit).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for tests.fakes (the in-memory executor); service is installed

from loadtest.reporting import header, write_report  # noqa: E402
from service.engine.outcome import Outcome  # noqa: E402
from service.models.request import GenerationRequest  # noqa: E402
from service.router.dispatcher import Dispatcher  # noqa: E402
from service.router.policy import DeadlinePolicy  # noqa: E402
from service.router.queue import QueueFull, Ticket  # noqa: E402
from service.router.scheduler import make_scheduler  # noqa: E402
from service.router.tenants import Quota, QuotaExceeded, Tenants  # noqa: E402
from tests.fakes import Clock, FakeExecutor  # noqa: E402

REQ = GenerationRequest(prompt="p", num_inference_steps=2)


@dataclass
class Sim:
    """One run: the dispatcher, its fake group, and a heap of timed events."""

    scheduler: str
    fair: bool
    args: argparse.Namespace
    rng: random.Random
    clock: Clock = field(default_factory=lambda: Clock(0.0))
    events: list[tuple[float, int, str, Any]] = field(default_factory=list)
    seq: itertools.count = field(default_factory=itertools.count)
    first_try: dict[str, float] = field(default_factory=dict)  # job -> its client's first attempt
    refused: dict[str, int] = field(default_factory=dict)
    waits: dict[str, float] = field(default_factory=dict)  # job -> first attempt to a rank
    done: int = 0  # jobs ended within the horizon

    def __post_init__(self) -> None:
        a = self.args
        tenants = Tenants(Quota(max_queued=a.max_queued_per_key)) if self.fair else Tenants()
        sched = make_scheduler(self.scheduler, a.ranks, a.queue_size, a.starve_s, 0.05, tenants, self.fair)
        self.ex = FakeExecutor((a.ranks,))
        self.d = Dispatcher(self.ex, self, sched, deadlines=DeadlinePolicy(base_s=1e9),
                            max_queue_wait_s=1e9, clock=self.clock)
        self.d.open()
        self.d.step(0)

    def at(self, t: float, kind: str, data: Any) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, data))

    # -- Sink ------------------------------------------------------------------------
    def on_start(self, ticket: Ticket, info: dict[str, Any]) -> None:
        self.waits[ticket.id] = self.clock.now - self.first_try[ticket.id]
        self.at(self.clock.now + self.args.job_s, "run", ticket.id)

    def on_progress(self, ticket_id: str, step: int, total: int) -> None:
        pass

    def on_requeue(self, ticket: Ticket, why: str) -> None:
        pass  # no rank dies in this simulation

    def on_finish(self, ticket: Ticket, outcome: Outcome, info: dict[str, Any]) -> None:
        self.done += self.clock.now <= self.args.horizon_s  # throughput over the same span for both
        if ticket.tenant == "key-a" and self.clock.now < self.args.horizon_s:
            self.client("key-a", self.clock.now)  # the flooding client sends its next job at once

    # -- clients ---------------------------------------------------------------------
    def client(self, tenant: str, t: float) -> None:
        job = f"{tenant}-{next(self.seq)}"
        self.first_try[job] = t
        self.refused[job] = 0
        self.at(t, "try", (tenant, job))

    def attempt(self, tenant: str, job: str) -> None:
        try:
            self.d.submit(job, REQ.compat_key(), REQ, tenant=tenant)
        except (QuotaExceeded, QueueFull) as e:
            self.refused[job] += 1
            self.at(self.clock.now + e.retry_after_s, "try", (tenant, job))

    def run(self) -> dict[str, Any]:
        for _ in range(self.args.flood):
            self.client("key-a", 0.0)
        others = {tenant: self.rng.uniform(0, self.args.horizon_s) for tenant in ("key-b", "key-c")}
        for tenant, t in others.items():
            self.client(tenant, t)
        watched = [j for j in self.first_try if not j.startswith("key-a")]
        # Until both others' jobs started and the horizon passed (so throughput is over the
        # same span, whichever policy let them in sooner).
        while self.events:
            t, _, kind, data = heapq.heappop(self.events)
            self.clock.now = t
            if kind == "try":
                self.attempt(*data)
            elif kind == "run":
                self.ex.run(data)
            self.d.step(0)  # assignments, then the events they caused
            self.d.step(0)
            if self.d.depth and not self.events:
                self.at(t + 0.05, "tick", None)  # waves: a partial wave leaves after max_wait
            if all(j in self.waits for j in watched) and t > self.args.horizon_s:
                break
        return {"waits_s": [self.waits[j] for j in watched], "refused": [self.refused[j] for j in watched],
                "done": self.done}


def summary(waits: list[float], refused: list[int]) -> dict[str, Any]:
    s = sorted(waits)
    return {"n": len(s), "mean_s": round(statistics.fmean(s), 2), "p50_s": round(s[len(s) // 2], 2),
            "p95_s": round(s[min(len(s) - 1, int(0.95 * len(s)))], 2), "max_s": round(s[-1], 2),
            "refused_429_mean": round(statistics.fmean(refused), 2),
            "refused_at_least_once": sum(r > 0 for r in refused)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ranks", type=int, default=2, help="ranks of the one (AllGather) group")
    p.add_argument("--job-s", type=float, default=10.0, help="rank time of every job")
    p.add_argument("--flood", type=int, default=70, help="key-a's clients, each always sending")
    p.add_argument("--horizon-s", type=float, default=600.0, help="key-b and key-c send within this")
    p.add_argument("--queue-size", type=int, default=64)
    p.add_argument("--max-queued-per-key", type=int, default=16)
    p.add_argument("--starve-s", type=float, default=30.0)
    args = p.parse_args()
    t0 = time.monotonic()
    results: dict[str, Any] = {}
    for scheduler in ("continuous", "waves"):
        results[scheduler] = {}
        for name, fair in (("before", False), ("after", True)):
            waits: list[float] = []
            refused: list[int] = []
            done = 0.0
            for run in range(args.runs):
                out = Sim(scheduler, fair, args, random.Random(args.seed * 1000 + run)).run()
                waits += out["waits_s"]
                refused += out["refused"]
                done += out["done"] / args.horizon_s * 3600
            results[scheduler][name] = {**summary(waits, refused),
                                        "jobs_per_hour": round(done / args.runs, 1)}
            print(scheduler, name, results[scheduler][name], flush=True)
        before, after = results[scheduler]["before"], results[scheduler]["after"]
        results[scheduler]["before_over_after"] = {
            k: round(before[k] / after[k], 1) if after[k] else None for k in ("mean_s", "p95_s", "max_s")}
        results[scheduler]["after_within_bound"] = after["max_s"] <= args.job_s
    doc = {
        **header(),
        "params": {k: v for k, v in vars(args).items() if k != "out"},
        "bound_s": args.job_s,  # the target: another key's first job waits at most one job's time
        "what": "wait of key-b's and key-c's one job (first attempt to a rank) while key-a floods; "
                "simulated time on the real dispatcher and schedulers (fake executor)",
        "results": results,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    write_report(doc, args.out)
    print(f"wrote {args.out} in {doc['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
