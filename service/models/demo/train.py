"""Train the "shapes" demo model (shapes.py) on drawn clips (clips.py), as Wan is trained.

Three phases, each bounded by a time budget (so a run fits a lent GPU's call):

1. the VAE (``AutoencoderKLWan``) learns to reconstruct the clips (L1 + MSE, a small KL term);
   the latents' per-channel mean and std, measured on the clips, go into its config as Wan's
   ``latents_mean`` / ``latents_std``;
2. the transformer (``WanTransformer3DModel``) learns flow matching on the normalised latents:
   x_t = (1 - s) x_0 + s e, target e - x_0, timestep 1000 s, s drawn with the scheduler's shift,
   conditioned on the frozen text encoder's prompt embeddings (10% empty: CFG's negative);
   an EMA of its weights is what is saved;
3. a LoRA (rank 8 on every block Linear) learns to swap red and blue: the demo adapter.

    python -m service.models.demo.train prepare --base out/shapes-base        # CPU: parts + prompts
    python -m service.models.demo.train fit --base out/shapes-base --out out/shapes-fit   # GPU
    python -m service.models.demo.train assemble --base out/shapes-base --fit out/shapes-fit

``assemble`` writes the pipeline folder (``WanPipeline.save_pretrained``), the LoRA file and
the log (loss curves, steps, seconds, seed, and a check of a few samples) into
``service/models/demo/weights``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from multiprocessing import Pool
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from . import shapes
from .clips import ClipSpec, all_specs, draw_clip
from .score import score_clip, summarise

SHIFT = 3.0  # the scheduler's flow_shift: training draws sigmas the way inference spends its steps
LORA_TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
                "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")
SWAP = {"red": "blue", "blue": "red"}  # the demo adapter's effect
LORA_RANK = 8
LORA_FILE = "red-blue-swap.safetensors"


# ----- prepare (CPU): the untrained parts and every prompt's embedding, as the pipeline makes it -----

def prepare(base: Path) -> None:
    from diffusers import WanPipeline

    shapes.write_untrained(base)
    write_defaults(base)
    pipe = WanPipeline.from_pretrained(base)
    prompts = [s.prompt for s in all_specs()] + [""]
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=512,
                                       device=torch.device("cpu"))
    lengths = (embeds.abs().sum(-1) > 0).sum(-1)
    longest = int(lengths.max())
    from safetensors.torch import save_file

    save_file({"embeds": embeds[:, :longest].contiguous(), "lengths": lengths}, base / "prompts.safetensors")
    (base / "prompts.json").write_text(json.dumps(prompts, indent=1) + "\n")


# ----- fit (GPU) -----

def _draw(args: tuple[ClipSpec, int]) -> np.ndarray:
    return draw_clip(args[0], args[1])


def _clips(specs: list[ClipSpec], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    jobs = [(s, int(rng.integers(2**31))) for s in specs]
    with Pool(min(16, os.cpu_count() or 1)) as pool:
        return np.stack(pool.map(_draw, jobs, chunksize=64))


def _video(clips: torch.Tensor) -> torch.Tensor:
    """[N, F, H, W, 3] uint8 -> [N, 3, F, H, W] in [-1, 1]."""
    return clips.permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0


def _timed(budget_s: float, steps: int, body: Callable[[int], torch.Tensor], log: list[list[float]],
           every: int = 100) -> int:
    """Run ``body(step)`` until ``steps`` or ``budget_s``; log the mean loss every ``every`` steps
    (the only place the loss is read back: no sync per step)."""
    t0, acc, n, step = time.perf_counter(), None, 0, 0
    while step < steps and time.perf_counter() - t0 < budget_s:
        loss = body(step)
        acc = loss if acc is None else acc + loss
        n += 1
        step += 1
        if n == every:
            mean = float(acc) / n
            log.append([step, round(mean, 6), round(time.perf_counter() - t0, 1)])
            print(f"  step {step} loss {mean:.5f} ({time.perf_counter() - t0:.0f} s)", flush=True)
            acc, n = None, 0
    return step


def _lr(step: int, total: int, peak: float, warm: int = 200) -> float:
    if step < warm:
        return peak * (step + 1) / warm
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))


def fit_vae(vae: Any, clips: torch.Tensor, budget_s: float, steps: int, log: list, batch: int = 32) -> int:
    """Reconstruction from the posterior's mean plus a little noise (sampling at the initial unit
    variance drowns the mean and the decoder learns to ignore it); the object's pixels weigh 10x
    (it covers ~5% of a frame: plain MSE learns the background first and stops there)."""
    opt = torch.optim.AdamW(vae.parameters(), lr=1e-3, weight_decay=0.0)
    vae.train()
    gen = torch.Generator(clips.device).manual_seed(1)

    def body(step: int) -> torch.Tensor:
        for g in opt.param_groups:
            g["lr"] = _lr(step, steps, 1e-3, warm=100)
        x = _video(clips[torch.randint(len(clips), (batch,), device=clips.device, generator=gen)])
        corner = x[:, :, :, :1, :1]
        weight = 1.0 + 9.0 * ((x - corner).abs().amax(dim=1, keepdim=True) > 0.1).float()
        with torch.autocast("cuda", torch.bfloat16, enabled=x.is_cuda):
            post = vae.encode(x).latent_dist
            z = post.mean + 0.05 * torch.randn(post.mean.shape, device=x.device, generator=gen)
            rec = vae.decode(z).sample.float()
        err = (rec - x).abs()
        loss = (weight * (err + err * err)).mean() + 1e-4 * post.mean.float().pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        return loss.detach()

    done = _timed(budget_s, steps, body, log)
    vae.eval()
    return done


@torch.no_grad()
def vae_check(vae: Any, specs: list[ClipSpec], strip: Path | None = None) -> dict[str, Any]:
    """Score the VAE's reconstructions of drawn clips of ``specs`` (its ceiling for the model)."""
    dev = next(vae.parameters()).device
    clips = torch.from_numpy(np.stack([draw_clip(s, i) for i, s in enumerate(specs)])).to(dev)
    with torch.autocast("cuda", torch.bfloat16, enabled=clips.is_cuda):
        rec = vae.decode(vae.encode(_video(clips)).latent_dist.mode()).sample.float().clamp(-1, 1)
    frames = ((rec + 1) * 127.5).round().byte().permute(0, 2, 3, 4, 1).cpu().numpy()
    if strip is not None:
        from PIL import Image

        rows = [np.concatenate(list(c[::4]), axis=1) for c in frames[:10]]
        Image.fromarray(np.concatenate(rows)).save(strip)
    return summarise([score_clip(c, s) for c, s in zip(frames, specs, strict=True)])


@torch.no_grad()
def encode_all(vae: Any, clips: torch.Tensor, batch: int = 64) -> torch.Tensor:
    out = []
    for i in range(0, len(clips), batch):
        with torch.autocast("cuda", torch.bfloat16, enabled=clips.is_cuda):
            out.append(vae.encode(_video(clips[i:i + batch])).latent_dist.mode().float())
    return torch.cat(out)


def _padded(embeds: torch.Tensor) -> torch.Tensor:
    """Zero-pad to the 512 tokens the pipeline passes (it pads every prompt to max_sequence_length)."""
    return F.pad(embeds, (0, 0, 0, 512 - embeds.shape[1]))


def fit_flow(model: Any, latents: torch.Tensor, cond: torch.Tensor, embeds: torch.Tensor, budget_s: float,
             steps: int, lr: float, log: list, params: list[torch.Tensor] | None = None,
             ema: Any = None, batch: int = 128) -> int:
    """Flow matching on normalised ``latents`` [N, C, T, H, W]; ``cond`` [N] indexes ``embeds``
    (its last row: the empty prompt)."""
    dev = latents.device
    params = params if params is not None else [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    gen = torch.Generator(dev).manual_seed(2)
    empty = len(embeds) - 1
    model.train()

    def body(step: int) -> torch.Tensor:
        for g in opt.param_groups:
            g["lr"] = _lr(step, steps, lr)
        idx = torch.randint(len(latents), (batch,), device=dev, generator=gen)
        x0 = latents[idx]
        c = cond[idx].clone()
        c[torch.rand(len(idx), device=dev, generator=gen) < 0.1] = empty
        u = torch.rand(len(idx), device=dev, generator=gen)
        s = SHIFT * u / (1 + (SHIFT - 1) * u)
        e = torch.randn(x0.shape, device=dev, generator=gen)
        sv = s.view(-1, 1, 1, 1, 1)
        xt = (1 - sv) * x0 + sv * e
        with torch.autocast("cuda", torch.bfloat16, enabled=latents.is_cuda):
            pred = model(xt, timestep=s * 1000, encoder_hidden_states=_padded(embeds[c])).sample.float()
        loss = F.mse_loss(pred, e - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if ema is not None:
            ema.update(model, step)
        return loss.detach()

    done = _timed(budget_s, steps, body, log)
    model.eval()
    return done


class Ema:
    """An exponential moving average of a model's parameters (what is saved and sampled)."""

    def __init__(self, model: Any, decay: float = 0.999) -> None:
        self.decay = decay
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: Any, step: int) -> None:
        d = min(self.decay, (1 + step) / (10 + step))
        for n, p in model.named_parameters():
            self.shadow[n].lerp_(p.detach(), 1 - d)

    @torch.no_grad()
    def copy_to(self, model: Any) -> None:
        for n, p in model.named_parameters():
            p.copy_(self.shadow[n])


class Lora:
    """Rank-r factors beside every targeted Linear of the blocks, applied by forward hooks."""

    def __init__(self, model: Any, rank: int = LORA_RANK) -> None:
        self.rank = rank
        self.factors: dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}
        self.hooks = []
        for name, mod in model.named_modules():
            parts = name.split(".", 2)
            if parts[0] == "blocks" and len(parts) == 3 and parts[2] in LORA_TARGETS:
                dev = mod.weight.device
                a = torch.nn.Parameter(torch.randn(rank, mod.in_features, device=dev) / mod.in_features**0.5)
                b = torch.nn.Parameter(torch.zeros(mod.out_features, rank, device=dev))
                self.factors[name] = (a, b)
                self.hooks.append(mod.register_forward_hook(self._hook(a, b)))

    @staticmethod
    def _hook(a: torch.nn.Parameter, b: torch.nn.Parameter) -> Callable:
        def add(_mod: Any, args: tuple, out: torch.Tensor) -> torch.Tensor:
            return out + F.linear(F.linear(args[0], a.to(args[0].dtype)), b.to(args[0].dtype))
        return add

    def params(self) -> list[torch.Tensor]:
        return [t for ab in self.factors.values() for t in ab]

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


@torch.no_grad()
def sample(model: Any, vae: Any, embeds: torch.Tensor, rows: list[int],
           stats: tuple[torch.Tensor, torch.Tensor], seed: int, steps: int = 20,
           guidance: float = 4.0) -> np.ndarray:
    """A quick Euler flow sampler with CFG (the check during training; the product uses UniPC)."""
    dev = embeds.device
    mean, std = stats
    gen = torch.Generator(dev).manual_seed(seed)
    x = torch.randn((len(rows), 16, 5, 8, 8), device=dev, generator=gen)
    sig = torch.linspace(1, 0, steps + 1, device=dev)
    sig = SHIFT * sig / (1 + (SHIFT - 1) * sig)
    cond = _padded(embeds[rows])
    unc = _padded(embeds[[len(embeds) - 1] * len(rows)])
    for i in range(steps):
        t = sig[i].expand(len(rows)) * 1000
        with torch.autocast("cuda", torch.bfloat16, enabled=x.is_cuda):
            vc = model(x, timestep=t, encoder_hidden_states=cond).sample.float()
            vu = model(x, timestep=t, encoder_hidden_states=unc).sample.float()
        x = x + (sig[i + 1] - sig[i]) * (vu + guidance * (vc - vu))
    z = x * std.view(1, -1, 1, 1, 1) + mean.view(1, -1, 1, 1, 1)
    frames = vae.decode(z).sample.float().clamp(-1, 1)
    return ((frames + 1) * 127.5).round().byte().permute(0, 2, 3, 4, 1).cpu().numpy()


def _check(model: Any, vae: Any, embeds: torch.Tensor, specs: list[ClipSpec],
           stats: tuple[torch.Tensor, torch.Tensor], truth: Callable[[ClipSpec], ClipSpec],
           strip: Path | None = None) -> dict[str, Any]:
    prompts = [s.prompt for s in all_specs()]
    rows = [prompts.index(s.prompt) for s in specs]
    scores = []
    for seed in (0, 1):
        clips = sample(model, vae, embeds, rows, stats, seed)
        scores += [score_clip(c, truth(s)) for c, s in zip(clips, specs, strict=True)]
        if strip is not None and seed == 0:  # every 4th frame of the first 10 clips, one row each
            from PIL import Image

            rows_img = [np.concatenate(list(c[::4]), axis=1) for c in clips[:10]]
            Image.fromarray(np.concatenate(rows_img, axis=0)).save(strip)
    return summarise(scores)


def fit(base: Path, out: Path, seed: int, clips_n: int, budgets: dict[str, float], init: Path | None = None,
        batch: int = 128, lr: float = 3e-4) -> None:
    """Train the three phases into ``out``; ``init``: a fit folder to go on from (its VAE, stats and
    transformer are kept, and the VAE phase is skipped)."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from safetensors.torch import load_file, save_file

    from .score import prompt_set

    t_start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    device_name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    log: dict[str, Any] = {"seed": seed, "device": device_name, "torch": torch.__version__, "clips": clips_n,
                           "budgets_s": budgets, "phases": {}}
    specs_all = all_specs()
    rng = np.random.default_rng(seed)
    specs = [specs_all[i] for i in rng.permutation(clips_n) % len(specs_all)]
    t = time.perf_counter()
    clips = torch.from_numpy(_clips(specs, seed)).to(dev)
    log["draw_s"] = round(time.perf_counter() - t, 1)
    print(f"drew {len(clips)} clips in {log['draw_s']} s", flush=True)

    prompts = json.loads((base / "prompts.json").read_text())
    tensors = load_file(base / "prompts.safetensors")
    embeds = tensors["embeds"].to(dev)
    cond = torch.tensor([prompts.index(s.prompt) for s in specs], device=dev)

    vae = AutoencoderKLWan.from_pretrained(base / "vae").to(dev)
    if init is not None:
        vae.load_state_dict(load_file(init / "vae.safetensors"))
        vae.eval()
        before = json.loads((init / "log.json").read_text())
        log["init"] = {"from": str(init), "phases": before["phases"], "seconds": before.get("seconds")}
    else:
        vae_log: list = []
        t = time.perf_counter()
        n = fit_vae(vae, clips, budgets["vae"], 100_000, vae_log)
        log["phases"]["vae"] = {"steps": n, "seconds": round(time.perf_counter() - t, 1), "loss": vae_log}
        log["phases"]["vae"]["check"] = vae_check(vae, prompt_set(), out / "vae.png")
        print("vae check", log["phases"]["vae"]["check"], flush=True)
    save_file({k: v.contiguous() for k, v in vae.state_dict().items()}, out / "vae.safetensors")

    lat = encode_all(vae, clips)
    if init is not None:
        kept = json.loads((init / "stats.json").read_text())
        mean = torch.tensor(kept["latents_mean"], device=dev)
        std = torch.tensor(kept["latents_std"], device=dev)
    else:
        mean = lat.mean(dim=(0, 2, 3, 4))
        std = lat.std(dim=(0, 2, 3, 4))
    latents = (lat - mean.view(1, -1, 1, 1, 1)) / std.view(1, -1, 1, 1, 1)
    log["latents_mean"], log["latents_std"] = mean.tolist(), std.tolist()
    (out / "stats.json").write_text(json.dumps({"latents_mean": mean.tolist(), "latents_std": std.tolist()}))

    model = WanTransformer3DModel.from_pretrained(base / "transformer").to(dev)
    if init is not None:
        model.load_state_dict(load_file(init / "transformer.safetensors"))
    ema = Ema(model)
    flow_log: list = []
    t = time.perf_counter()
    n = fit_flow(model, latents, cond, embeds, budgets["transformer"], 100_000, lr, flow_log, ema=ema,
                 batch=batch)
    ema.copy_to(model)
    log["phases"]["transformer"] = {"steps": n, "seconds": round(time.perf_counter() - t, 1),
                                    "loss": flow_log}
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out / "transformer.safetensors")
    check = prompt_set()
    log["phases"]["transformer"]["check"] = _check(model, vae, embeds, check, (mean, std), lambda s: s,
                                                      out / "check.png")
    print("check", log["phases"]["transformer"]["check"], flush=True)
    _write_log(out, log, t_start)

    # the demo adapter: red and blue swapped in the pixels, the prompts unchanged
    swapped = [ClipSpec(s.shape, SWAP.get(s.colour, s.colour), s.motion, s.background) for s in specs]
    clips2 = torch.from_numpy(_clips(swapped, seed + 1)).to(dev)
    lat2 = (encode_all(vae, clips2) - mean.view(1, -1, 1, 1, 1)) / std.view(1, -1, 1, 1, 1)
    for p in model.parameters():
        p.requires_grad_(False)
    lora = Lora(model)
    lora_log: list = []
    t = time.perf_counter()
    n = fit_flow(model, lat2, cond, embeds, budgets["lora"], 100_000, 1e-3, lora_log, params=lora.params(),
                 batch=batch)
    log["phases"]["lora"] = {"steps": n, "seconds": round(time.perf_counter() - t, 1), "loss": lora_log,
                             "rank": LORA_RANK, "swap": SWAP}
    save_file({f"{name}.{ab}": t.detach().float().contiguous() for name, f in lora.factors.items()
               for ab, t in zip(("lora_A", "lora_B"), f, strict=True)}, out / "lora.safetensors")
    swap_truth = lambda s: ClipSpec(s.shape, SWAP.get(s.colour, s.colour), s.motion, s.background)  # noqa: E731
    log["phases"]["lora"]["check"] = _check(model, vae, embeds, [s for s in check if s.colour in SWAP],
                                            (mean, std), swap_truth)
    print("lora check", log["phases"]["lora"]["check"], flush=True)
    _write_log(out, log, t_start)


def _write_log(out: Path, log: dict[str, Any], t_start: float) -> None:
    log["seconds"] = round(time.perf_counter() - t_start, 1)
    (out / "log.json").write_text(json.dumps(log, indent=1) + "\n")


# ----- assemble (CPU): the pipeline folder, the adapter, the log -----

def assemble(base: Path, fitted: Path, dest: Path) -> Path:
    from diffusers import WanPipeline
    from safetensors.torch import load_file

    pipe = WanPipeline.from_pretrained(base)
    pipe.vae.load_state_dict(load_file(fitted / "vae.safetensors"))
    pipe.transformer.load_state_dict(load_file(fitted / "transformer.safetensors"))
    stats = json.loads((fitted / "stats.json").read_text())
    pipe.vae.register_to_config(latents_mean=stats["latents_mean"], latents_std=stats["latents_std"])
    folder = dest / shapes.NAME
    if folder.exists():
        shutil.rmtree(folder)
    pipe.save_pretrained(folder)
    write_defaults(folder)
    shutil.copy(fitted / "log.json", folder / "training_log.json")
    factors = load_file(fitted / "lora.safetensors")
    names = sorted({k.rsplit(".", 1)[0] for k in factors})
    layers = {f"{n}.{ab}.weight": factors[f"{n}.{ab}"] for n in names for ab in ("lora_A", "lora_B")}
    meta = {"r": LORA_RANK, "lora_alpha": LORA_RANK, "target_modules": names, "lora_dropout": 0.0,
            "bias": "none"}
    WanPipeline.save_lora_weights(dest / "loras", transformer_lora_layers=layers, weight_name=LORA_FILE,
                                  transformer_lora_adapter_metadata=meta)
    return folder


def write_defaults(folder: Path) -> None:
    """The request it was trained for, as the folder's default request (models/registry.py)."""
    from ..registry import DEFAULTS_FILE

    (folder / DEFAULTS_FILE).write_text(json.dumps(shapes.REQUEST, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.models.demo.train",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("phase", choices=("prepare", "fit", "assemble", "all"))
    p.add_argument("--base", type=Path, default=Path("out/shapes-base"))
    p.add_argument("--out", type=Path, default=Path("out/shapes-fit"), help="fit's output folder")
    p.add_argument("--dest", type=Path, default=shapes.WEIGHTS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clips", type=int, default=8000)
    p.add_argument("--vae-s", type=float, default=150.0, help="seconds for the VAE")
    p.add_argument("--transformer-s", type=float, default=240.0)
    p.add_argument("--lora-s", type=float, default=60.0)
    p.add_argument("--init", type=Path, default=None, help="a fit folder to go on from")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-4)
    a = p.parse_args(argv)
    if a.phase in ("prepare", "all"):
        prepare(a.base)
    if a.phase in ("fit", "all"):
        budgets = {"vae": a.vae_s, "transformer": a.transformer_s, "lora": a.lora_s}
        fit(a.base, a.out, a.seed, a.clips, budgets, a.init, a.batch, a.lr)
    if a.phase in ("assemble", "all"):
        print("wrote", assemble(a.base, a.out, a.dest))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
