#!/bin/bash
# The one-GPU runs behind issues 20, 22, 23, 24 and 27's figures, as run on a lent nvidia-h200 (after the
# wheels from ../shared/tools/gpu-wheels.sh are installed in /tmp/site). Every step has its own
# time limit so that one slow step leaves the others' results; each writes JSON under $OUT.
#
#   OUT=/some/dir bash loadtest/h200_dp1.sh kill,encode   # then: ... serve (a call is 10 minutes at most)
set -u
OUT=${OUT:?set OUT}
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PARTS=${1:-kill,encode,serve}
has() { [[ ",$PARTS," == *",$1,"* ]]; }
step() { local limit=$1; shift; echo "== $(date +%T) $*"; timeout "$limit" "$@"; echo "== rc=$?"; }

[ -d /tmp/wan12 ] || step 150 python3 -m service.cli demo-model /tmp/wan12 --preset wan14b-shape --layers 12
# A rank SIGKILLed mid-request under default flags: the held request, time to serving again.
has kill && step 200 python3 loadtest/rank_kill.py --model /tmp/wan12 --dp 1 --out "$OUT/h200-rank-kill.json"
# Default flags (only the offload switch) against the resident ideal, requests sent at once.
has serve && step 420 python3 loadtest/serve_bench.py --model /tmp/wan12 --dp 1 --designs default --mix video \
  --requests 8 --rate-per-min 0 --ideal --out "$OUT/h200-serve-default.json" --logdir /tmp
# MP4 encoding of a 480x832x81 clip by x264 thread count, and streamed during decode.
has encode && step 150 python3 loadtest/bench_encode.py --parts threads,stream --threads 1,4,8,16 --reps 1 \
  --clips noise --decode-s 0,5 --out "$OUT/h200-encode.json"
# A rank-64 LoRA on every Linear against none, resident and streamed (issue 24).
has lora && step 300 python3 loadtest/bench_lora.py --layers 12 --model /tmp/wan12 --out "$OUT/h200-lora.json"
# Two experts (Wan2.2 A14B shape, 12 blocks each) streamed through one ring against both
# resident, with and without the next expert's prefetch (issue 22; DP2 runs need two GPUs).
has experts && step 330 python3 loadtest/bench_experts.py --device cuda --preset wan22-a14b-shape --layers 12 \
  --sizes 832x480x81,832x480x33 --steps 4 --runs resident,dp1,dp1-noexpect --out "$OUT/h200-experts.json"
# Step caches (first-block, MagCache) at two thresholds each against none, DLO DP1 (issue 23).
has cache && step 250 python3 loadtest/bench_cache.py --model /tmp/wan12 --steps 6 --out "$OUT/h200-cache.json"
ls -la "$OUT"
