# dloserve: all set-up goes through `make setup`; every other target uses .venv.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup setup-system test test-random e2e soak multinode deploy-check ui-check image image-test lint serve generate bench bench-dp loadtest batch quality clean

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)

setup: $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps -e .

# Debian packages for the deploy checks (podman, debootstrap, prometheus/promtool) and the
# browser tests (chromium, chromium-driver: Playwright drives /usr/bin/chromium); needs root.
setup-system:
	@missing=""; for c in podman debootstrap prometheus promtool curl chromium chromedriver; do \
	   command -v $$c >/dev/null || missing=1; done; \
	 if [ -n "$$missing" ]; then apt-get update -q && \
	   apt-get install -y -q podman debootstrap prometheus curl chromium chromium-driver; fi

# The fast suite, in file order; every test's time goes to out/test-results.xml (CI keeps it).
test:
	mkdir -p out && $(BIN)/python -m pytest -q -p no:randomly --durations=15 --junitxml=out/test-results.xml tests

# The same suite in a random order (pytest-randomly): make test-random SEED=3
SEED ?= 1
test-random:
	mkdir -p out && $(BIN)/python -m pytest -q -p randomly -p no:cacheprovider --randomly-seed=$(SEED) \
	  --junitxml=out/test-random-$(SEED).xml tests

# Slow end to end: `dloserve serve` and the batch job as subprocesses, start-up and signals.
e2e:
	mkdir -p out && $(BIN)/python -m pytest -q -p no:randomly -m e2e --durations=15 \
	  --junitxml=out/e2e-results.xml tests

soak:
	mkdir -p out && SOAK_OUT=out/soak.json $(BIN)/python -m pytest -q -p no:randomly -m soak -s tests/api/test_soak.py

# Two Ray nodes on this machine: batch job, two replicas, one job store, a node removed.
multinode:
	$(BIN)/python -m pytest -q -p no:randomly -m multinode -s tests/api/test_multinode.py

# Live Prometheus against a running service, then the CPU image built and run (podman).
# IMAGE_STEP=run runs an image built before (.ci/run builds it in the background).
IMAGE_STEP ?= all
deploy-check:
	$(BIN)/python -m pytest -q -p no:randomly -m deploy tests
	bash docker/test_image.sh $(IMAGE_STEP)

# The /ui playground in Debian's Chromium (Playwright) against a real `dloserve serve`; screenshots
# in out/ui/. Needs `make setup-system` (chromium).
ui-check:
	mkdir -p out/ui && $(BIN)/python -m pytest -q -p no:randomly -m browser tests/api/test_ui.py

VARIANT ?= cpu
IMAGE_BASE ?= debian:bookworm-slim
image:
	@engine=$$(if docker info >/dev/null 2>&1; then echo docker; elif command -v podman >/dev/null; then echo podman; fi); \
	 [ -n "$$engine" ] || { echo "make image: needs docker (with a running engine) or podman" >&2; exit 2; }; \
	 flags=""; [ "$$engine" = podman ] && flags="--isolation chroot"; \
	 $$engine build $$flags -f docker/Dockerfile --build-arg VARIANT=$(VARIANT) --build-arg BASE=$(IMAGE_BASE) \
	   -t dloserve:$(VARIANT) .

image-test:
	bash docker/test_image.sh

lint:
	$(BIN)/ruff check service tests loadtest deploy

SERVE_ARGS ?= --data-parallel-size 2 --enable-distributed-layerwise-offload
serve:
	$(BIN)/dloserve serve $(SERVE_ARGS)

loadtest:
	mkdir -p out && $(BIN)/python loadtest/http_load.py --url http://127.0.0.1:8000 --concurrency 4 --requests 16 \
	  --out out/loadtest.json

PROMPTS ?= prompts.jsonl
batch:
	$(BIN)/python -m service.jobs.batch --prompts $(PROMPTS) --out out/batch --data-parallel-size 2

generate:
	$(BIN)/dloserve generate --prompt "a red circle moving right on a black background" --seed 7 --out out/demo.mp4

# The trained demo model's quality under every setting that changes numbers (CPU columns; about
# 40 min on 2 cores): exits 1 when one misses its threshold (loadtest/quality.py says which).
quality:
	$(BIN)/python loadtest/quality.py --check

bench:
	$(BIN)/python loadtest/bench_offload.py

bench-dp:
	$(BIN)/python loadtest/bench_dp.py

clean:
	rm -rf $(VENV) .pytest_cache out
