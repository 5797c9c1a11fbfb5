#!/bin/bash
# Wheels for a lent GPU machine in pieces that fit one `run` carry beside this tree (64 MiB in
# all): the closure of pyproject's dependencies and its `gpu` extra (from .venv's metadata) at the
# locks' pins, less what the image has (the list in ../shared/tools/gpu-wheels.sh, whose 56 MB
# pieces with the test suite's wheels do not fit). One pip call installs them all (a second
# `pip install --target --upgrade` would replace /tmp/site/bin, `ray` with it).
#   bash loadtest/device_wheels.sh   # here, after make setup: .devwheels/w0 .. wN (git-ignored)
#   device, one run per piece: mkdir -p /tmp/w && cp .devwheels/wK/* /tmp/w/; the last: bash /tmp/w/install.sh
set -euo pipefail
PIECE=${PIECE:-44000000}  # bytes; the tracked tree is about 19 MB
D=.devwheels
[ -f requirements.lock ] && [ -x .venv/bin/python ] || { echo "run from the project root after make setup"; exit 2; }
image=$(sed -n '/^ON_IMAGE="/,/"$/p' ../shared/tools/gpu-wheels.sh | tr -d '"' | sed 's/^ON_IMAGE=//')
pins=$(.venv/bin/python - "$image" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, distribution
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as norm


def lock(path: str) -> dict[str, str]:
    rows = (line.split("==") for line in open(path) if "==" in line and not line.startswith("#"))
    return {norm(n): v.strip() for n, v in rows}

pinned, gpu = lock("requirements.lock"), lock("requirements-gpu.lock")
skip = {norm(n) for n in sys.argv[1].split()}
need, todo = set(gpu), [("dloserve", {"gpu"})]
while todo:
    name, extras = todo.pop()
    try:
        requires = distribution(name).requires or []
    except PackageNotFoundError:  # GPU-only, not installed here: all of its lock is taken
        continue
    for r in map(Requirement, requires):
        if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in extras or {""}):
            if norm(r.name) not in need:
                need.add(norm(r.name))
                if norm(r.name) not in skip:  # the image's packages bring their own
                    todo.append((r.name, set(r.extras)))
pins = {**pinned, **gpu}
if missing := sorted(n for n in need - skip if n not in pins):
    sys.exit(f"not pinned in the lock files: {missing}")
print(" ".join(f"{n}=={pins[n]}" for n in sorted(need - skip)))
PY
)
plat=""; for p in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do plat="$plat --platform ${p}_x86_64"; done
rm -rf "$D" && mkdir -p "$D/whl" && { grep -qx "/$D/" .git/info/exclude || echo "/$D/" >> .git/info/exclude; }
# shellcheck disable=SC2086
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
  -d "$D/whl" $pins 2>&1 | { grep -v "is ignored" || true; }
tar -cf - -C "$D/whl" . | split -b "$PIECE" -d - "$D/part." && rm -rf "$D/whl"
i=0; for f in "$D"/part.*; do mkdir -p "$D/w$i"; mv "$f" "$D/w$i/"; last="$D/w$i"; i=$((i+1)); done
cat > "$last/install.sh" <<'SH'
#!/bin/bash
set -e  # every piece's part.* in /tmp/w, installed into /tmp/site in one pip call (once)
if [ ! -f /tmp/site/.dloserve-wheels ]; then
  rm -rf /tmp/wh && mkdir -p /tmp/wh && cat /tmp/w/part.* | tar -x -C /tmp/wh
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/wh/*.whl \
    && touch /tmp/site/.dloserve-wheels
fi
PYTHONPATH=/tmp/site python3 -c "import ray, ray.serve, fastapi, diffusers, av; print('ray', ray.__version__, 'in /tmp/site')"
SH
echo "$i pieces under $D (w0 .. w$((i-1)); the last holds install.sh): $(du -sh "$D" | cut -f1)"
