# Two entry points: `make serve` and `make test`. Each sets up what it needs first (a virtual
# environment in .venv with qgemm installed editable, the models fetched), so either works on a
# fresh clone.  The CUDA extra is added when the machine has an NVIDIA driver.
PYTHON ?= python3
VENV   ?= .venv
HOST   ?= 127.0.0.1
PORT   ?= 8000
EXTRAS ?= test$(shell command -v nvidia-smi >/dev/null 2>&1 && echo ,cuda)
BIN    := $(VENV)/bin

.PHONY: setup models serve test lint clean

$(BIN)/qgemm: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[$(EXTRAS)]'
	touch $@

setup: $(BIN)/qgemm

models: setup
	$(BIN)/qgemm fetch

serve: models
	$(BIN)/qgemm serve --host $(HOST) --port $(PORT)

lint: setup
	$(BIN)/ruff check .

test: models lint
	QGEMM_TEST_REQUIRE_MODELS=1 $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
