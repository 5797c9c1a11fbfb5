#!/bin/bash
# Issue 35's one-GPU figures, as run on a lent nvidia-h200 (after the wheels from
# ../shared/tools/gpu-wheels.sh are installed in /tmp/site): what keeping a request's per-step
# state costs per step (12 Wan-14B layers, 832x480x81, CFG), and a rank SIGKILLed at half of a
# request under `dloserve serve` (standby on) -> the request going on from its step, completed.
# About 6 minutes; each step has its own limit (8 minutes in all), each writes JSON under $OUT.
#
#   OUT=/some/dir bash loadtest/h200_resume.sh            # then copy $OUT/*.json to loadtest/results/
#   OUT=/tmp/o SMOKE=1 bash loadtest/h200_resume.sh       # CPU, the tiny demo model: the plumbing only
set -u
OUT=${OUT:?set OUT}
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PY:-python3}
DAY=$(date -u +%F)
step() { local limit=$1; shift; echo "== $(date +%T) $*"; timeout "$limit" "$@"; echo "== rc=$?"; }

if [ "${SMOKE:-0}" = 1 ]; then
  DEV=cpu MODEL=$OUT/tiny KIND=cpu STATE="--size 32x32x5 --steps 3 --rounds 1 --reps 2 --shape 1,16,2,4,4"
  KILL="--size 64x64x5 --steps 8 --kill-at 30 --module"
  [ -d "$MODEL" ] || step 120 $PY -m service.cli demo-model "$MODEL"
else
  DEV=cuda MODEL=/tmp/wan12 KIND=h200 STATE="--size 832x480x81 --steps 4 --rounds 2 --reps 30"
  KILL="--size 832x480x33 --steps 10 --kill-at 50 --module"
  [ -d "$MODEL" ] || step 120 $PY -m service.cli demo-model "$MODEL" --preset wan14b-shape --layers 12
fi
# The hand-off alone (a 480p x 81 latent, fp32 and bf16), then the request without and with it.
# shellcheck disable=SC2086
step 130 $PY loadtest/bench_state.py --device $DEV --model "$MODEL" $STATE --out "$OUT/$KIND-state-$DAY.json"
# Serve (default flags; an Euler view of the model, so the request is resumable), one request
# undisturbed, the same one with its rank killed at half of it, one after.
# shellcheck disable=SC2086
step 230 $PY loadtest/bench_startup.py --device $DEV --model "$MODEL" --euler --starts kill $KILL \
  --label 12-bf16-resume --out "$OUT/$KIND-resume-kill-$DAY.json"
cat "$OUT/$KIND-resume-kill-$DAY.json"  # (bench_state printed its own)
ls -la "$OUT"
