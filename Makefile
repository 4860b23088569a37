# Danlu: `make up` starts the workbench, `make test` runs the tests.
# Both install into .venv first (idempotent; re-runs only when pyproject.toml changes).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Installed before the project so its `torch>=2.4` extra is already satisfied; on these machines
# torch==2.13.0 is a CPU build on disk. On a GPU box set TORCH_SPEC to the build you want.
TORCH_SPEC ?= torch==2.13.0
CHP_VERSION ?= 5.3.0
PYTEST_ARGS ?=

.PHONY: install up test demo benchmarks clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e '.[torch,test]'
	@command -v npm >/dev/null || { echo "npm is required for configurable-http-proxy: install Node.js (e.g. apt-get install nodejs npm)"; exit 2; }
	npm install --silent --no-fund --no-audit --prefix $(VENV)/chp configurable-http-proxy@$(CHP_VERSION)
	ln -sf ../chp/node_modules/.bin/configurable-http-proxy $(BIN)/configurable-http-proxy
	touch $@

up: install
	$(BIN)/danlu up

test: install
	$(BIN)/ruff check hub magics tests benchmarks examples
	$(BIN)/python -m pytest $(PYTEST_ARGS)

demo: install
	$(BIN)/python examples/run_demo.py

benchmarks: install
	$(BIN)/python benchmarks/submit_latency.py
	$(BIN)/python benchmarks/logging_overhead.py

clean:
	rm -rf $(VENV) .danlu build *.egg-info
