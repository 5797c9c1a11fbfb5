"""LoRA side branches against PEFT's own ``lora.Linear``, and the device LRU of adapters.

The branch is a forward hook on the plain Linear; PEFT wraps the Linear instead. Both must
give the same bytes (same ops, same order, same dtypes), and the base weight must come out
of any number of forwards unchanged.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora.layer import Linear as PeftLinear
from torch import nn

from service.offload.lora import AdapterCache, DeviceAdapter, LoraFactors, SideBranches


def _factors(n_in: int, n_out: int, r: int, seed: int, bias: bool = False, alpha: float = 8.0,
             dtype: torch.dtype = torch.float32) -> LoraFactors:
    g = torch.Generator().manual_seed(seed)
    down, up = torch.randn(r, n_in, generator=g).to(dtype), torch.randn(n_out, r, generator=g).to(dtype)
    b = torch.randn(n_out, generator=g).to(dtype) if bias else None
    return LoraFactors(down, up, b, alpha=alpha, rank=r)


def _peft(base: nn.Linear, adapters: dict[str, tuple[LoraFactors, float]]) -> nn.Module:
    """PEFT's own lora.Linear around ``base`` (injected as diffusers does), ``adapters`` active."""
    host = nn.Module()
    host.proj = base
    for name, (f, _) in adapters.items():
        inject_adapter_in_model(LoraConfig(r=f.rank, lora_alpha=f.alpha, target_modules=["proj"],
                                           lora_bias=f.bias is not None), host, adapter_name=name)
    layer = host.proj
    assert isinstance(layer, PeftLinear)
    with torch.no_grad():
        for name, (f, scale) in adapters.items():
            layer.lora_A[name].weight.copy_(f.down)
            layer.lora_B[name].weight.copy_(f.up)
            if f.bias is not None:
                layer.lora_B[name].bias.copy_(f.bias)
            layer.set_scale(name, scale)
    layer.set_adapter(list(adapters))
    return layer.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_side_branch_equals_peft_linear(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    base = nn.Linear(24, 40).to(dtype).eval()
    before = base.weight.detach().clone()
    x = torch.randn(3, 7, 24).to(dtype)
    plain = base(x)
    a, b = _factors(24, 40, 4, 1, dtype=dtype), _factors(24, 40, 8, 2, bias=True, alpha=3.0, dtype=dtype)
    host = nn.Module()
    host.proj = base
    sides = SideBranches(host, {"proj": base})
    with torch.inference_mode():
        sides.attach([(DeviceAdapter("a", {"proj": a}), 0.7), (DeviceAdapter("b", {"proj": b}), -1.25)])
        ours = base(x)
        sides.detach()
        after = base(x)
        want = _peft(nn.Linear(24, 40).to(dtype), {"a": (a, 0.7), "b": (b, -1.25)})
        want.base_layer.load_state_dict(base.state_dict())
        theirs = want(x)
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, plain)  # the adapters changed something
    assert torch.equal(after, plain) and torch.equal(base.weight, before)  # detached: the plain Linear
    assert ours.dtype == dtype


def test_attach_only_named_linears_and_refuses_unknown() -> None:
    host = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    linears = {"0": host[0], "1": host[1]}
    sides = SideBranches(host, linears)
    sides.attach([(DeviceAdapter("k", {"1": _factors(4, 4, 2, 0)}), 1.0)])
    assert sides.attached == 1 and not host[0]._forward_hooks and len(host[1]._forward_hooks) == 1
    with pytest.raises(KeyError, match="no Linear 'x'"):
        sides.attach([(DeviceAdapter("k", {"x": _factors(4, 4, 2, 0)}), 1.0)])
    sides.detach()
    assert sides.attached == 0 and not host[1]._forward_hooks


def _adapter(key: str, n: int = 50) -> DeviceAdapter:
    """An adapter of one [1, n] + [n, 1] fp32 factor pair: 8n bytes."""
    return DeviceAdapter(key, {"m": LoraFactors(torch.zeros(1, n), torch.zeros(n, 1), None, 1.0, 1)})


def test_adapter_cache_lru_under_budget() -> None:
    size = _adapter("x").nbytes
    cache = AdapterCache(budget=3 * size)
    loads: list[str] = []

    def want(*keys: str) -> list[tuple[str, int, object]]:
        return [(k, size, lambda k=k: loads.append(k) or _adapter(k)) for k in keys]

    cache.acquire(want("a", "b"))
    cache.acquire(want("c"))
    assert cache.keys() == ["a", "b", "c"] and loads == ["a", "b", "c"]
    cache.acquire(want("a"))  # a hit: a becomes most recent
    assert cache.keys() == ["b", "c", "a"] and loads == ["a", "b", "c"]
    cache.acquire(want("d"))  # evicts b, the least recently used
    assert cache.keys() == ["c", "a", "d"] and cache.evictions == 1
    # the request's own adapters are never evicted to make room for each other
    got = cache.acquire(want("c", "e", "f"))
    assert [g.key for g in got] == ["c", "e", "f"] and sorted(cache.keys()) == ["c", "e", "f"]
    assert cache.used <= cache.budget
    assert cache.stats()["hits"] == 2 and cache.stats()["misses"] == 6
    with pytest.raises(ValueError, match="over the LoRA cache"):
        cache.acquire(want("p", "q", "r", "s"))
    assert sorted(cache.keys()) == ["c", "e", "f"]  # a refused set changes nothing
