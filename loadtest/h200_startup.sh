#!/bin/bash
# The one-GPU start-up and serving figures on a lent machine (wheels from loadtest/device_wheels.sh
# in /tmp/site): `dloserve serve` to ready at 12 and 40 Wan-14B layers (bf16, FP8; a first start and
# a restart), a redeploy on a running cluster, a rank SIGKILLed mid-request, short clips and issue
# 46's 480p mix under default flags against the resident ideal. Each step has its own limit and
# writes JSON under $OUT; a device call is 10 minutes at most: pass the parts per call.
#
#   OUT=/some/dir bash loadtest/h200_startup.sh ready12,kill     # then: fp8,short; video; ready40,redeploy
#   OUT=/tmp/o SMOKE=1 bash loadtest/h200_startup.sh ready12     # CPU, the tiny demo model: the plumbing only
#   OUT=/some/dir COMPILE_BYTECODE=0 bash loadtest/h200_startup.sh ready12  # the baseline: *-nobytecode.json
set -u
OUT=${OUT:?set OUT}
DSL=/tmp/site/nvidia_cutlass_dsl/dsl_packages; [ -d $DSL ] || DSL=""  # the GPU extra's CuTe DSL (a .pth names it; PYTHONPATH reads none)
export PYTHONPATH=/tmp/site${DSL:+:$DSL}:$PWD${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PARTS=${1:-ready12,kill}
PY=${PY:-python3}
DAY=$(date -u +%F)
has() { [[ ",$PARTS," == *",$1,"* ]]; }
step() { local limit=$1; shift; echo "== $(date +%T) $*"; timeout "$limit" "$@"; echo "== rc=$?"; }

# A production image holds compiled bytecode (docker/Dockerfile); the lent image's torch has none,
# its Python writes none and the carried wheels go in with --no-compile: every process of a start
# would compile its imports (2.1x the restart on an H100, docs/operate.md). So it is compiled once,
# into a folder of our own (machine.bytecode in each result); COMPILE_BYTECODE=0 is that baseline.
NB=""
if [ "${COMPILE_BYTECODE:-1}" != 1 ]; then NB="-nobytecode"; export PYTHONDONTWRITEBYTECODE=1; fi
if [ "${SMOKE:-0}" != 1 ] && [ -z "$NB" ]; then
  unset PYTHONDONTWRITEBYTECODE
  export PYTHONPYCACHEPREFIX=/tmp/pycache
  if [ ! -f /tmp/pycache/.done ]; then
    # shellcheck disable=SC2046
    step 300 $PY -m compileall -q -j 0 $($PY -c "import sys; print(' '.join(p for p in sys.path if p.endswith('-packages') or p == '/tmp/site'))") service
    touch /tmp/pycache/.done  # (its rc is 1 where a package ships a file that is not Python 3)
  fi
fi

if [ "${SMOKE:-0}" = 1 ]; then
  DEV="--device cpu" M12=$OUT/tiny M40=$OUT/tiny KIND=cpu SIZE=64x64x5
  [ -d "$M12" ] || step 120 $PY -m service.cli demo-model "$M12"
else
  DEV="" M12=/tmp/wan12 M40=/tmp/wan40 SIZE=832x480x33
  # the results are named by the card that ran them (a call for nvidia-h200 may get an H100)
  KIND=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -i -E 'h[0-9]00' | tr 'H' 'h'); KIND=${KIND:-gpu}
  if has ready12 || has kill || has fp8 || has short || has video || has redeploy; then
    [ -d "$M12" ] || step 150 $PY -m service.cli demo-model "$M12" --preset wan14b-shape --layers 12
  fi
  if has ready40; then
    [ -d "$M40" ] || step 300 $PY -m service.cli demo-model "$M40" --preset wan14b-shape --layers 40
  fi
fi
B="$PY loadtest/bench_startup.py $DEV --module" NB=$NB${TAG:-}  # TAG=-x: an A/B arm's labels and files
# shellcheck disable=SC2086
has ready12 && step 240 $B --model "$M12" --label 12-bf16$NB --starts ready,ready --out "$OUT/$KIND-startup-$DAY-12$NB.json"
# shellcheck disable=SC2086
has fp8 && step 240 $B --model "$M12" --label 12-fp8$NB "--serve-args=--quantization fp8" --starts ready,ready \
  --out "$OUT/$KIND-startup-$DAY-12-fp8$NB.json"
# shellcheck disable=SC2086
has ready40 && step 240 $B --model "$M40" --label 40-bf16$NB --starts ready,ready --out "$OUT/$KIND-startup-$DAY-40$NB.json"
# A redeploy on a running cluster: Ray started once, `dloserve serve --address` joins it twice; twice more on a running Serve.
if has redeploy; then (  # a subshell: RAY_AUTH_MODE stays in it
  [ "${SMOKE:-0}" = 1 ] && G=0 || G=1
  ray get-auth-token --generate > /dev/null  # Ray's token authentication on, as `ray start` has it by default
  export RAY_AUTH_MODE=token
  step 60 ray start --head --port=6390 --num-gpus=$G --disable-usage-stats
  # shellcheck disable=SC2086
  step 240 $B --model "$M12" --label 12-bf16-redeploy$NB "--serve-args=--address 127.0.0.1:6390" --starts ready,ready \
    --out "$OUT/$KIND-startup-$DAY-12-redeploy$NB.json"
  step 60 serve start -a 127.0.0.1:6390 --http-host 127.0.0.1 --http-port 8011  # Serve kept running, as a RayService has it
  step 240 $B --model "$M12" --label 12-bf16-redeploy-serve$NB "--serve-args=--address 127.0.0.1:6390" --port 8011 \
    --starts ready,ready --out "$OUT/$KIND-startup-$DAY-12-redeploy-serve$NB.json"
  step 60 ray stop --force  # every Ray cluster on the machine: run it where nothing else uses Ray
) fi
# An Euler view of the model, so the killed request goes on from its step.
# shellcheck disable=SC2086
has kill && step 240 $B --model "$M12" --label 12-bf16-kill --euler --starts kill --size $SIZE --steps 10 \
  --kill-at 50 --out "$OUT/$KIND-startup-$DAY-kill.json"
# Requests sent at once, the service under default flags against the resident ideal: short clips
# (5-17 frames, 2-4 steps) 8 and 24 at once; issue 46's 480p mix (33 and 81 frames, 4-6 steps) 8.
for run in short:8 short:24 video:8; do
  part=${run%:*} n=${run#*:}; mix=$part
  [ "${SMOKE:-0}" = 1 ] && mix=tiny
  # shellcheck disable=SC2086
  has "$part" && step 420 $PY loadtest/serve_bench.py $DEV --model "$M12" --dp 1 --designs default --mix $mix \
    --requests "$n" --rate-per-min 0 --ideal --out "$OUT/$KIND-serve-$part$n-$DAY.json" --logdir /tmp
done
# A device call returns 8 files at most (two results were lost to it): the logs go back as one tarball.
(cd "$OUT" && compgen -G "*.log" > /dev/null && tar czf "logs-$(date -u +%H%M%S).tgz" ./*.log && rm -f ./*.log; ls -la)
