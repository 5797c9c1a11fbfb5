"""The benchmarks' harness: the machine's facts, a timer, the workload shapes, and the JSON
result every benchmark writes (its command, machine and date first), with the ``--tokens``
list and the machine's kind in a result's name.

Importing it imports no torch, and ``machine()`` imports none either (a start-up benchmark
must not warm torch's files for the process it times): torch's facts are there when the
benchmark imported torch itself; the GPUs come from ``nvidia-smi`` (no CUDA context here).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from service.api.startup import bytecode_facts

RESULTS = Path(__file__).resolve().parent / "results"

# tokens -> latent (frames, height, width) for Wan's patch (1, 2, 2)
SHAPES = {
    64: (1, 16, 16),
    4096: (1, 128, 128),  # 1024x1024 image
    32760: (21, 60, 104),  # 480x832, 81 frames
    75600: (21, 90, 160),  # 720x1280, 81 frames
}
TEXT_TOKENS = 512


def machine(device: str | None = None, **extra: Any) -> dict[str, Any]:
    """The host: CPU model, CPUs (and this process's share), load, memory, Python; torch and
    CUDA where the benchmark imported torch; the GPUs and their driver where nvidia-smi runs.
    ``device``: the benchmark's (recorded); ``extra``: its own facts (library versions, ...)."""
    out: dict[str, Any] = {"host": platform.node(), "cpu": _cpu_model(), "cpus": os.cpu_count(),
                           "affinity": len(os.sched_getaffinity(0)), "loadavg": list(os.getloadavg()),
                           "python": platform.python_version()}
    try:
        out["mem_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    if device:
        out["device"] = device
    out["bytecode"] = bytecode_facts()  # an import-bound start-up reads slower without it
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = torch.__version__
        if torch.version.cuda:
            out["cuda"] = torch.version.cuda
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20, check=True)
        gpus = [line.split(",")[0].strip() for line in q.stdout.splitlines() if line.strip()]
        if gpus:
            out.update(gpu=gpus[0], gpus=gpus, driver=q.stdout.splitlines()[0].split(",")[1].strip())
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return {**out, **extra}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def header(device: str | None = None, **extra: Any) -> dict[str, Any]:
    """A result's first keys: the command that made it, the date (UTC) and the machine."""
    return {"command": shlex.join([Path(sys.executable).name, *sys.argv]),
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "machine": machine(device, **extra)}


class Timer:
    """Milliseconds of the block: CUDA events on the current stream, or the wall clock."""

    def __init__(self, device: Any) -> None:
        self.cuda = getattr(device, "type", device) == "cuda"

    def __enter__(self) -> Timer:
        if self.cuda:
            import torch

            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            self.b.record()
            self.b.synchronize()
            self.ms = self.a.elapsed_time(self.b)
        else:
            self.ms = (time.perf_counter() - self.t0) * 1000


def host_memory() -> dict[str, int]:
    """This process's resident and proportional set sizes (bytes)."""
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("Rss", "Pss"):
            out[key.lower() + "_bytes"] = int(line.split()[1]) * 1024
    return out


def inputs(tokens: int, text_dim: int, device: Any, dtype: Any) -> dict[str, Any]:
    """A Wan transformer's inputs at ``tokens`` (one of SHAPES), seeded by the count."""
    import torch

    f, h, w = SHAPES[tokens]
    g = torch.Generator().manual_seed(tokens)
    return {
        "hidden_states": torch.randn(1, 16, f, h, w, generator=g).to(device, dtype),
        "timestep": torch.tensor([500], device=device),
        "encoder_hidden_states": torch.randn(1, TEXT_TOKENS, text_dim, generator=g).to(device, dtype),
    }


def h2d_probe(nbytes: int = 2**30, reps: int = 10) -> float:
    """Pinned host -> device copy bandwidth (GB/s), median of ``reps``."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(reps + 2):
        with Timer("cuda") as t:
            dst.copy_(src, non_blocking=True)
        times.append(t.ms)
    return nbytes / (statistics.median(times[2:]) / 1000) / 1e9


def h2d_probe_in_subprocess() -> float:
    """``h2d_probe`` in a process of its own (its pinned GiB and CUDA context not in this one)."""
    code = "import sys; sys.path.insert(0, %r); import reporting; print(reporting.h2d_probe())"
    out = subprocess.run([sys.executable, "-c", code % str(Path(__file__).parent)], text=True,
                         capture_output=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def token_list(text: str) -> list[int]:
    """``--tokens 4096,32760`` -> [4096, 32760]; argparse exits 2 naming a count not in SHAPES."""
    tokens = [int(t) for t in text.split(",")]
    if bad := [t for t in tokens if t not in SHAPES]:
        raise argparse.ArgumentTypeError(f"{bad} not one of {sorted(SHAPES)}")
    return tokens


def frame_psnr(a: Any, b: Any) -> float:
    """PSNR in dB of uint8 frames ``a`` against ``b`` (peak 255); 99.0 where they are identical
    (a finite figure, so the JSON stays strict)."""
    import numpy as np

    mse = float(np.mean((np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)) ** 2))
    return 99.0 if mse == 0 else float(10 * np.log10(255.0 ** 2 / mse))


def machine_kind(report: dict[str, Any], device: str) -> str:
    """``h200`` on an H200, else the device (the prefix of a result's file name)."""
    return "h200" if "H200" in report["machine"].get("gpu", "") else device


def write_report(report: dict[str, Any], out: str | Path) -> Path:
    """The report as indented JSON at ``out`` (its folder made)."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


def result_path(report: dict[str, Any], kind: str, name: str = "") -> Path:
    """Where a result goes when ``--out`` is not given: ``$OUT`` on a lent machine (what it
    writes there comes back), else ``loadtest/results/``; named ``<kind>[-name]-<date>.json``
    (``kind``: ``machine_kind``'s, or the benchmark's own, ``h200x2``)."""
    folder = Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS
    stem = "-".join(x for x in (kind, name, report["date"][:10]) if x)
    return folder / f"{stem}.json"


def preset_model(preset: str, layers: int, device: str = "cpu") -> Path:
    """A ``dloserve demo-model --preset`` pipeline folder in the temp dir, written once and
    reused by every benchmark that asks for the same preset and depth."""
    import tempfile

    from service.models.demo import write_demo_model

    folder = Path(tempfile.gettempdir()) / f"dloserve-bench-{preset}-L{layers}"
    if not (folder / "model_index.json").is_file():
        t0 = time.perf_counter()
        write_demo_model(folder, preset, layers, init_device=device, progress=True)
        print(f"wrote {folder} in {time.perf_counter() - t0:.0f} s", flush=True)
    return folder
