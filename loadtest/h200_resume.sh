#!/bin/bash
# Issue 35's one-GPU figures, as run on a lent nvidia-h200 (after the wheels from
# ../shared/tools/gpu-wheels.sh are installed in /tmp/site): what keeping a request's per-step
# state costs per step (12 Wan-14B layers, 832x480x81, CFG), and a rank SIGKILLed at half of a
# request under `dloserve serve` (standby on) -> the request going on from its step, completed.
# About 6 minutes; each step has its own limit (8 minutes in all), each writes JSON under $OUT.
#
#   OUT=/some/dir bash loadtest/h200_resume.sh            # then copy $OUT/*.json to loadtest/results/
set -u
OUT=${OUT:?set OUT}
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DAY=$(date -u +%F)
step() { local limit=$1; shift; echo "== $(date +%T) $*"; timeout "$limit" "$@"; echo "== rc=$?"; }

[ -d /tmp/wan12 ] || step 150 python3 -m service.cli demo-model /tmp/wan12 --preset wan14b-shape --layers 12
# The hand-off alone (480p x 81 latent, fp32 and bf16), then the request without and with it.
step 120 python3 loadtest/bench_state.py --device cuda --model /tmp/wan12 --size 832x480x81 --steps 4 \
  --rounds 2 --reps 30 --out "$OUT/h200-state-$DAY.json" > /dev/null
# Serve (default flags, an Euler view of the model so the request is resumable), one request
# undisturbed, the same one with its rank killed at >= 50% progress, one after.
step 210 python3 loadtest/bench_startup.py --model /tmp/wan12 --euler --starts kill --size 832x480x33 \
  --steps 10 --kill-at 50 --label 12-bf16-resume --out "$OUT/h200-resume-kill-$DAY.json"
cat "$OUT"/h200-state-"$DAY".json "$OUT"/h200-resume-kill-"$DAY".json
ls -la "$OUT"
