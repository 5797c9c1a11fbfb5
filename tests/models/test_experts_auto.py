"""Auto mode and the device budget with two experts (Wan2.2 A14B, tiny, on CPU).

The lock-step cost of two experts comes from simulating the group's own rule over request
plans; auto mode charges AllGather that much, and a real probe of a two-expert model (one
expert measured, both served) carries it into the choice. The device budget of a two-expert
pipeline counts both experts' blocks and non-block tensors.
"""

from __future__ import annotations

import pytest
import torch

from service.config import EngineConfig, LoraConfig, OffloadConfig, OffloadMode
from service.models.automode import decide_auto, expert_mix
from service.models.demo import ensure_demo_model
from service.models.experts import lockstep_expert_cost, simulate
from service.models.pipeline import PipelineRunner
from service.models.registry import load_adapter
from service.offload.auto import ProbeTimings, choose_mode
from service.offload.checkpoint import Checkpoint


def _plan(steps: int, high: float = 0.35) -> list[int]:
    h = round(high * steps)
    return [e for e in [0] * h + [1] * (steps - h) for _ in range(2)]  # CFG: two forwards a step


@pytest.fixture(scope="module")
def two() -> str:
    return str(ensure_demo_model("wan22-t2v-tiny"))


def test_expert_cost_is_zero_when_the_group_stays_in_step() -> None:
    mixed = [_plan(s) for s in (20, 50, 30, 40) * 5]
    assert lockstep_expert_cost(mixed, 1) == 0.0  # one rank waits for nobody
    assert lockstep_expert_cost([_plan(40)] * 12, 4) == 0.0  # equal requests stay in step
    assert lockstep_expert_cost([[0] * 80] * 12, 4) == 0.0  # one expert
    costs = [lockstep_expert_cost(mixed, w) for w in (2, 4, 8)]
    assert 0 < costs[0] < costs[1] < costs[2], costs
    # the cost is the experts' alone: the queue's tail (one expert, mixed lengths) is not in it
    tail = simulate([[0] * len(p) for p in mixed], 4)["efficiency"]
    assert tail < 1.0 and costs[1] == pytest.approx(tail / simulate(mixed, 4)["efficiency"] - 1)


def test_expert_cost_can_turn_auto_to_rank_local() -> None:
    """Transfer-bound enough that AllGather wins with one expert, not once two experts'
    extra ticks are charged to it (rank-local ranks do not wait for each other)."""
    t = ProbeTimings(2, 703_000_000, 0.030, 55e9, 20e9, 500e9)
    assert choose_mode(t, shape_spread=1.0).mode == "allgather"
    c = choose_mode(t, shape_spread=1.0, expert_mix=0.4)
    assert c.mode == "rank-local", c.reason
    assert "different experts cost AllGather an estimated 40% more ticks" in c.reason
    one = ProbeTimings(1, *list(vars(t).values())[1:])  # one rank: no lock-step to pay for
    assert choose_mode(one, shape_spread=1.0, expert_mix=0.4) == choose_mode(one, shape_spread=1.0)


def test_auto_on_a_two_expert_model_charges_the_experts(two: str, demo_model: str) -> None:
    settings = EngineConfig(offload=OffloadConfig(OffloadMode.AUTO, probe_shape=(16, 16, 5)))
    a2, a1 = load_adapter(two), load_adapter(demo_model)
    assert expert_mix(a1, settings, 2) == 0.0 and expert_mix(a2, settings, 1) == 0.0
    mix = expert_mix(a2, settings, 2)
    assert 0 < mix < 1, mix
    choice = decide_auto(a2, torch.device("cpu"), settings, None, world=2)
    assert choice.timings is not None and choice.timings.world == 2
    assert f"{mix:.0%} more ticks" in choice.reason, choice
    choice1 = decide_auto(a1, torch.device("cpu"), settings, None, world=2)
    assert "different experts" not in choice1.reason, choice1


def test_device_budget_counts_both_experts(two: str) -> None:
    """A budget that holds every block and non-block tensor of both experts keeps them all
    resident; one byte less streams some (a budget counting one expert would keep all)."""
    adapter = load_adapter(two)
    streamed = PipelineRunner.load(two, "cpu",
                                   config=EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER)))
    try:
        blocks = sum(lay.total_bytes for lay in streamed.handle.layouts)
        n_blocks = len(streamed.handle.layouts)
        prefixes = {lay.prefix.split(".")[0] for lay in streamed.handle.layouts}
    finally:
        streamed.close()
    assert prefixes == set(adapter.experts)  # one ring over both experts' blocks
    non_block = 0
    for name in adapter.experts:
        ckpt = Checkpoint(adapter.transformer_checkpoint(name))
        non_block += sum(r.nbytes for k, r in ckpt.records.items() if not k.startswith("blocks."))
    everything = blocks + non_block
    for budget, all_resident in ((everything, True), (everything - 1, False)):
        # no adapter LRU in the budget (it reserves --lora-cache-gb): only the experts' bytes.
        # A budget runs the load-time probe; at a tiny shape (its default is 480x832x81, ~25 s
        # a load on CPU), as on CPU it measures no activation bytes at any shape.
        off = OffloadConfig(OffloadMode.ALLGATHER, device_memory_gb=budget / 2**30, probe_shape=(16, 16, 5))
        settings = EngineConfig(offload=off, lora=LoraConfig(cache_gb=0))
        runner = PipelineRunner.load(two, "cpu", config=settings)
        try:
            plan = runner.handle.plan
            assert plan.fixed_bytes == non_block, (plan, non_block)
            assert (len(plan.resident) == n_blocks) is all_resident, plan
            assert plan.total_bytes <= budget
        finally:
            runner.close()
