"""What one lock-step tick runs when the model has two experts (Wan2.2 A14B).

In AllGather mode every rank of a group makes the same gathers, and a tick is one forward.
With two experts the ranks of a group can need different ones at the same tick (different
requests at different progress). The rule, agreed in the tick's one all-reduce:

- **One expert per tick: the one most ranks at the gate need; on a tie the earlier one**
  (0, high-noise). Ranks that need the other expert *hold*: they replay this tick's gathers
  idle, like a rank with no work, and keep their forward for a later tick. So every tick
  gathers exactly one expert's blocks (no more bytes than a single-expert model), and the
  ring always knows what it fills.
- **Why this rule.** Measured by ``service.models.experts.simulate`` (forwards and ticks only, continuous
  scheduling, Wan2.2's expert plans; docs/models.md has the table): with requests of equal
  step counts every rule keeps a busy group in step (efficiency 1.0); with mixed step
  counts the majority rule with ties to expert 0 computed the most forwards per tick at
  N = 2, 4 and 8, ahead of gathering both experts in one tick (the union: a tick costs a
  forward per expert, each rank computes in its expert's half) and far ahead of "the later
  expert first" (a rank that reaches expert 1 alone would then run its whole low-noise
  stretch alone). The tie rule runs a new request's high-noise forwards at once; it joins
  the others at expert 1. No starvation: a held minority becomes the majority as soon as
  the others reach its expert, and expert runs are finite.
- **The next tick's expert is agreed too**, so the ring prefetches across the switch: each
  rank reports what it will need after a tick of expert 0 and after a tick of expert 1 (its
  request's next forward if it runs, its held forward if it holds, the first forward of the
  request it is about to start; nothing from a rank decoding its last request's video, which
  will not be at the next tick); the same rule over those gives the prefetch. A request's
  own switch is therefore always prefetched. A guess can only be wrong when a rank arrives
  at the gate that was not expected (a new request after a decode, a cancel): that costs one
  dropped fill, the same on every rank, never a wrong weight.

The all-reduce is a SUM of small integer counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from service.models.experts import NONE, choose


@dataclass(frozen=True)
class Tick:
    """What the group agreed for one tick."""

    any_gate: bool  # someone has a forward to run: the tick gathers
    any_busy: bool  # someone has work (else the group stops ticking)
    all_gate: bool
    expert: int  # the expert this tick runs (NONE when nobody is at the gate)
    upcoming: int  # the expert the ring prefetches for the next tick


def after(plan: Sequence[int], done: int, next_first: int) -> int:
    """The expert a rank needs once forward ``done`` of its request (``plan``) has run:
    the next forward's, else the first forward of the request it takes next (NONE: none)."""
    return plan[done + 1] if done + 1 < len(plan) else next_first


def needs(gate: int, plan: Sequence[int], done: int, starting: int) -> tuple[int, int, int]:
    """A rank's (expert at the gate, expert after running it, expert if it does not run this
    tick). ``gate``: the expert its forward at the gate uses (NONE: not at the gate); ``plan``
    and ``done``: its request's experts and forwards done (after its last forward it decodes:
    nothing next); ``starting``: the first expert of the request it is about to start (text
    encoding, or queued while it is free), NONE if none or if it is decoding."""
    if gate != NONE:
        return gate, after(plan, done, NONE), gate  # held: the same forward waits
    return NONE, NONE, starting


def agree(experts: int, at_gate: bool, busy: bool, mine: tuple[int, int, int],
          control: dist.ProcessGroup | None) -> Tick:
    """This tick, agreed over ``control`` (a gloo group of the ranks; None: one rank)."""
    v = encode(experts, at_gate, busy, *mine)
    if control is not None:
        t = torch.tensor(v, dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=control)
        v = t.tolist()
    return decide(v, experts)


def encode(experts: int, at_gate: bool, busy: bool, need: int, ran: int, waiting: int) -> list[int]:
    """This rank's vector for the SUM all-reduce.

    ``need``: the expert of the forward at the gate (NONE if not at the gate); ``ran``: what
    it needs after running that forward; ``waiting``: what it needs if it does not run this
    tick (its held forward's expert, or the first of the request it is starting).
    Layout: [at_gate, busy, not at_gate, ranks needing e (per e), then per tick expert E the
    ranks needing e after a tick of E].
    """
    v = [int(at_gate), int(busy), int(not at_gate)] + [0] * (experts + experts * experts)
    if need != NONE:
        v[3 + need] = 1
    for tick in range(experts):
        nxt = ran if need == tick else waiting
        if nxt != NONE:
            v[3 + experts + tick * experts + nxt] = 1
    return v


def decide(v: Sequence[int], experts: int) -> Tick:
    """The tick from the summed vector: ``choose`` over who needs what now, and over who
    needs what after a tick of that expert for the prefetch (expert 0 when nobody does)."""
    expert = choose(v[3 : 3 + experts])
    upcoming = NONE
    if expert != NONE:
        base = 3 + experts + expert * experts
        upcoming = choose(v[base : base + experts])
    return Tick(bool(v[0]), bool(v[1]), not bool(v[2]), expert, upcoming if upcoming != NONE else 0)
