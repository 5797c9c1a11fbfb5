#!/usr/bin/env bash
# Build the CPU image with podman and run it, without a registry (make image-test; CI runs it).
#
# Base: Debian bookworm made by debootstrap from Debian's packages, imported into podman
# (cached in ~/.cache/dloserve/bookworm-rootfs.tar). Build: podman build --isolation chroot,
# with the torch CPU wheel pip finds on this machine put in docker/wheels/ and this
# machine's CA bundle in docker/extra-ca/ (PyPI is reached the way the host reaches it).
# Run: podman run cannot start containers here (crun: setrlimit refused), so the image is
# mounted (podman image mount) and its programs run with chroot as the image's user:
# `dloserve generate`, then `dloserve serve` with one request over HTTP, whose MP4 must
# equal the generated one. Any step that fails fails the script.
#
# `test_image.sh build` only builds (CI starts it in the background while the tests run: it
# waits on the network and the disk more than on the CPU); `test_image.sh run` only runs an
# image built before; no argument: both.
set -euo pipefail
cd "$(dirname "$0")/.."
STEP=${1:-all}
case "$STEP" in build|run|all) ;; *) echo "usage: $0 [build|run]" >&2; exit 2 ;; esac
t0=$(date +%s)
IMAGE=localhost/dloserve:cpu
BASE=localhost/dloserve-base:bookworm
CACHE="${DLOSERVE_CACHE:-$HOME/.cache/dloserve}"
mkdir -p "$CACHE"
PY=${PY:-.venv/bin/python}

if [ "$STEP" != run ]; then
if ! podman image exists "$BASE"; then
  if [ ! -f "$CACHE/bookworm-rootfs.tar" ]; then
    root=$(mktemp -d /tmp/bookworm.XXXX)
    debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian >/dev/null
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -cf "$CACHE/bookworm-rootfs.tar" .
    rm -rf "$root"
  fi
  podman import "$CACHE/bookworm-rootfs.tar" "$BASE" >/dev/null
fi
t_base=$(date +%s)

rm -f docker/wheels/*.whl docker/extra-ca/*.crt
"$PY" -m pip download -q --no-deps -d docker/wheels "torch==2.13.0"
cp /etc/ssl/certs/ca-certificates.crt docker/extra-ca/host-bundle.crt
podman build --isolation chroot -f docker/Dockerfile --build-arg BASE="$BASE" --build-arg VARIANT=cpu \
  --build-arg TORCH_INDEX=https://pypi.org/simple \
  -t "$IMAGE" . >/tmp/dloserve-image-build.log 2>&1 || { tail -40 /tmp/dloserve-image-build.log; exit 1; }
rm -f docker/wheels/*.whl docker/extra-ca/*.crt
t_build=$(date +%s)
echo "image-build: OK. base $((t_base - t0)) s, build $((t_build - t_base)) s"
[ "$STEP" = build ] && exit 0
else
  podman image exists "$IMAGE" || { echo "test_image.sh run: no $IMAGE: run 'test_image.sh build' first" >&2; exit 1; }
  t_base=$t0 t_build=$t0
fi
size=$(podman image inspect "$IMAGE" --format '{{.Size}}')

mnt=$(podman image mount "$IMAGE")
work=$(mktemp -d /tmp/dloserve-image-run.XXXX)
cleanup() {
  set +e
  if [ -n "${serve_pid:-}" ]; then
    kill -TERM "$serve_pid" 2>/dev/null
    for _ in $(seq 90); do kill -0 "$serve_pid" 2>/dev/null || break; sleep 1; done
  fi
  for p in /proc/[0-9]*; do  # anything still running inside the image: stop it
    [ "$(readlink "$p/root" 2>/dev/null)" = "$mnt" ] && kill -KILL "${p#/proc/}" 2>/dev/null
  done
  sleep 1
  for m in "$mnt/home/dloserve" "$mnt/tmp" "$mnt/dev/shm" "$mnt/dev" "$mnt/sys" "$mnt/proc"; do
    mountpoint -q "$m" && umount -l "$m"
  done
  podman image unmount "$IMAGE" >/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
mount -t proc proc "$mnt/proc"
mount --rbind /sys "$mnt/sys"
mount --rbind /dev "$mnt/dev"
mount -t tmpfs -o size=4g tmpfs "$mnt/dev/shm"
mount -t tmpfs tmpfs "$mnt/tmp"
mount --bind "$work" "$mnt/home/dloserve"
chown 1000:1000 "$work"
in_image() { chroot --userspec=1000:1000 "$mnt" env -i HOME=/home/dloserve PATH=/opt/venv/bin:/usr/bin:/bin \
  HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1 "$@"; }

in_image dloserve generate --prompt "a red fox runs through snow" --width 96 --height 64 --num-frames 9 \
  --steps 3 --seed 0 --out /home/dloserve/generated.mp4 --quiet
port=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
# Not through in_image: chroot and env exec in place, so $! is the service's own pid.
chroot --userspec=1000:1000 "$mnt" env -i HOME=/home/dloserve PATH=/opt/venv/bin:/usr/bin:/bin HF_HUB_OFFLINE=1 \
  RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1 dloserve serve --port "$port" --ready-timeout-s 600 \
  >"$work/serve.log" 2>&1 &
serve_pid=$!
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$port/readyz" >/dev/null && break
  kill -0 "$serve_pid" 2>/dev/null || { tail -30 "$work/serve.log"; exit 1; }
  sleep 1
done
curl -sf -o "$work/served.mp4" "http://127.0.0.1:$port/v1/videos/sync" -H 'content-type: application/json' \
  -d '{"prompt": "a red fox runs through snow", "size": "96x64", "num_frames": 9, "num_inference_steps": 3, "seed": 0}'
cmp "$work/generated.mp4" "$work/served.mp4"
# The playground's files are package data: each must have made it into the image.
curl -sf -o "$work/ui.html" "http://127.0.0.1:$port/ui/"
grep -q "<title>dloserve playground</title>" "$work/ui.html"
for f in $(cd service/api/ui && ls *.js *.css); do curl -sf -o /dev/null "http://127.0.0.1:$port/ui/$f"; done
kill -TERM "$serve_pid"
for _ in $(seq 90); do kill -0 "$serve_pid" 2>/dev/null || break; sleep 1; done
if kill -0 "$serve_pid" 2>/dev/null; then echo "dloserve serve in the image did not stop on SIGTERM" >&2; exit 1; fi
left=$(for p in /proc/[0-9]*; do [ "$(readlink "$p/root" 2>/dev/null)" = "$mnt" ] && echo "${p#/proc/}"; done; true)
if [ -n "$left" ]; then echo "processes left in the image after it stopped: $left" >&2; exit 1; fi
serve_pid=
t_run=$(date +%s)
echo "image-test: OK. base $((t_base - t0)) s, build $((t_build - t_base)) s, run $((t_run - t_build)) s;" \
  "$IMAGE $((size / 1000000)) MB; served MP4 == generated MP4 ($(stat -c %s "$work/served.mp4") bytes)"
