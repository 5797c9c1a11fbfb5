# dloserve: all set-up goes through `make setup`; every other target uses .venv.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup test lint serve demo generate bench loadtest clean

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)

setup: $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps -e .

test:
	$(BIN)/python -m pytest -q -x tests

lint:
	$(BIN)/ruff check service tests loadtest

generate:
	$(BIN)/dloserve generate --prompt "a red fox running through snow" --out out/demo.mp4

bench:
	$(BIN)/python loadtest/bench_offload.py

clean:
	rm -rf $(VENV) .pytest_cache out
