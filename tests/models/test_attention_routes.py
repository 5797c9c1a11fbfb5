"""Which kernel may run here and which exact one serves a shape: the rules, with the facts
(device, compute capability, the import's outcome, timings) given, as the GPU would give them."""

from __future__ import annotations

import pytest
import torch

from service.models import attention_routes as ar
from service.models.attention_routes import Routes, Shape


def test_why_a_kernel_cannot_run_names_the_device_the_arch_and_the_extra() -> None:
    cpu = "flash-attn-4 needs a CUDA GPU (this server computes on cpu)"
    assert ar.why_not("fa4", "cpu", None, None) == cpu
    assert ar.why_not("cudnn_fp8", "cuda", (8, 0), None) == (
        "cuDNN's FP8 attention (nvidia-cudnn-frontend) is served on Hopper GPUs only (sm90, compute "
        "capability 9.x; this one is sm80)")
    assert "this one is sm100" in ar.why_not("fa4", "cuda", (10, 0), None)
    missing = ar.why_not("fa4", "cuda", (9, 0), "ModuleNotFoundError: No module named 'flash_attn'")
    assert missing == ("flash-attn-4 is not importable (ModuleNotFoundError: No module named 'flash_attn'); "
                       "install the gpu extra: pip install -e '.[gpu]' (requirements-gpu.lock)")
    assert ar.why_not("cudnn_fp8", "cuda", (9, 0), None) is None


@pytest.mark.usefixtures("no_fa4_cache_env")  # the fa4 check sets flash-attn-4's cache variables
def test_the_wheels_are_not_installed_on_this_cpu_install() -> None:
    """A CPU install stays as it was: no gpu extra, so the import really fails here (what a GPU
    server without the extra would report), and a CPU device never tries it."""
    for kernel in ("fa4", "cudnn_fp8"):
        assert ar.import_error(kernel) is not None
        why = ar.available(kernel, torch.device("cpu"))
        assert why.endswith("needs a CUDA GPU (this server computes on cpu)")


def test_sdpa_keeps_a_shape_unless_another_is_clearly_faster_and_exact() -> None:
    assert ar.choose({"sdpa": 38.7}, {}) == ("sdpa", "sdpa 38.70 ms")
    kernel, why = ar.choose({"sdpa": 38.7, "fa4": 33.1}, {"fa4": 0.0023})  # issue 46's H200 figures
    assert kernel == "fa4" and why == "sdpa 38.70 ms, fa4 33.10 ms (1.17x)"
    assert ar.choose({"sdpa": 38.7, "fa4": 38.3}, {"fa4": 0.002}) == (
        "sdpa", "sdpa 38.70 ms; fa4 38.30 ms, not 2% faster")
    assert ar.choose({"sdpa": 38.7, "fa4": 20.0}, {"fa4": 0.05}) == (
        "sdpa", "sdpa 38.70 ms; fa4 not exact (error 0.05 > 0.01)")
    assert ar.choose({"sdpa": 38.7, "fa4": "RuntimeError: no sm90 kernel"}, {}) == (
        "sdpa", "sdpa 38.70 ms; fa4 failed (RuntimeError: no sm90 kernel)")
    assert ar.choose({"sdpa": 38.7, "fa4": 20.0}, {})[0] == "sdpa"  # no error measured: not trusted
    with pytest.raises(ValueError, match="SDPA must have a time"):
        ar.choose({"sdpa": "failed"}, {})


def test_a_call_takes_the_nearest_measured_shape_of_its_kind() -> None:
    def s(kind: str, t: int) -> Shape:
        return Shape(kind, t, t if kind == "self" else 512, 40, 128)

    mixed = Routes(((s("self", 4096), "sdpa"), (s("self", 32760), "fa4"), (s("self", 75600), "fa4"),
                    (s("cross", 4096), "sdpa"), (s("cross", 32760), "sdpa")))
    assert mixed.kernel("self", 5000, 5000, 40, 128) == "sdpa"
    assert mixed.kernel("self", 30000, 30000, 40, 128) == "fa4"
    assert mixed.kernel("self", 200000, 200000, 40, 128) == "fa4"
    assert mixed.kernel("self", 32760, 32760, 20, 128) == "sdpa"  # other heads (an SP rank's): the default
    # every cross shape chose SDPA: the route reads no token count (a compiled block gets no guard)
    assert mixed.kernel("cross", 0, 0, 40, 128) == "sdpa"
    assert mixed.kernels() == {"sdpa", "fa4"}
    assert Routes(default="fa4").kernel("self", 0, 0, 1, 1) == "fa4"
    d = Routes(((s("self", 32760), "fa4"),), source="measured",
               details=(("self:2x32760->32760:40x128", "x"),))
    assert d.as_dict()["routes"] == [{"kind": "self", "q_tokens": 32760, "kv_tokens": 32760, "heads": 40,
                                      "head_dim": 128, "batch": 2, "kernel": "fa4", "why": "x"}]


def test_the_measured_shapes_are_wans_with_cfg() -> None:
    got = ar.shapes(40, 128)
    assert [(x.kind, x.q_tokens, x.kv_tokens, x.batch) for x in got] == [
        ("self", 4096, 4096, 2), ("cross", 4096, 512, 2), ("self", 32760, 32760, 2),
        ("cross", 32760, 512, 2), ("self", 75600, 75600, 2), ("cross", 75600, 512, 2)]
    assert hash(Routes(tuple((x, "sdpa") for x in got))) == hash(Routes(tuple((x, "sdpa") for x in got)))


def test_a_mixed_table_is_read_inside_a_compiled_block() -> None:
    """Where the table's shapes chose different kernels the route is read per call inside the
    compiled block: dynamo must trace it (a min(key=...) there failed on the H200, 2026-12-05,
    'invalid call to builtin op handler', and the exact step did not run)."""
    table = ar.Routes(entries=((ar.Shape("self", 4096, 4096, 2, 8), "sdpa"),
                               (ar.Shape("self", 32760, 32760, 2, 8), "fa4")))

    @torch.compile(fullgraph=True, backend="eager")
    def block(x: torch.Tensor) -> torch.Tensor:
        return x + (1 if table.kernel("self", x.shape[1], x.shape[1], 2, 8) == "fa4" else 0)

    assert block(torch.zeros(1, 30000)).sum().item() == 30000
    assert block(torch.zeros(1, 5000)).sum().item() == 0
