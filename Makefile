# Two entry points: `make serve` and `make test`. Each sets up what it needs first (a virtual
# environment in .venv with qgemm installed editable, the models fetched), so either works on a
# fresh clone.  `serve` installs what serving needs; `test` adds the test extras.  The CUDA extra is
# added when the machine has an NVIDIA driver (CUDA=cuda12 for drivers older than CUDA 13's).
PYTHON ?= python3
VENV   ?= .venv
HOST   ?= 127.0.0.1
PORT   ?= 8000
CUDA   ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda)
BIN    := $(VENV)/bin
# the build backend's banners (an editable install's advice) are not for the person running make
QUIET  := PYTHONWARNINGS=ignore
PYTEST_WORKERS ?= auto

.PHONY: setup setup-test models serve test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# what serving needs (and CUDA's CuPy where there is a GPU)
$(VENV)/.serve: pyproject.toml | $(BIN)/python
	$(QUIET) $(BIN)/python -m pip install --quiet -e '.$(if $(CUDA),[$(CUDA)])'
	touch $@

# and the test extras (pytest, schemathesis, Playwright, Ray, ruff, ...)
$(VENV)/.test: pyproject.toml | $(BIN)/python
	$(QUIET) $(BIN)/python -m pip install --quiet -e '.[test$(if $(CUDA),$(comma)$(CUDA))]'
	touch $@ $(VENV)/.serve

comma := ,

setup: $(VENV)/.serve

setup-test: $(VENV)/.test

models: setup
	$(BIN)/qgemm fetch

serve: models
	$(BIN)/qgemm serve --host $(HOST) --port $(PORT)

lint: setup-test
	$(BIN)/ruff check .
	$(BIN)/lint-imports  # the layers: tools on app on models on kernels, no cycles (pyproject.toml)

test: setup-test models lint
	QGEMM_TEST_REQUIRE_MODELS=1 $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
