# carlskit: two commands on a fresh machine with Python 3.11+ (no conda needed).
#   make lab   - create .venv, install carlskit with the lab extras only, open the tutorials in JupyterLab
#   make test  - create or update .venv, install the lab and dev (test) extras, run every test and notebook
#   make check - the quick subset (no slow tests, chaos tests or notebooks) for a development loop
#   make docs  - the documentation site in docs/_build/html (API reference, tutorials with outputs, guide)
#   make soak  - the long model-based run of the distributed bank with worker kills (CARLSKIT_SOAK_STEPS)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
LAB_STAMP := $(VENV)/.installed-lab
TEST_STAMP := $(VENV)/.installed-test
# JupyterLab settings that hold for this venv only: no news or update-check toast on every page.
LAB_OVERRIDES := $(VENV)/share/jupyter/lab/settings/overrides.json
LAB_PORT ?= 8888
# Jupyter refuses to run as root unless told; containers and CI machines often are root.
LAB_ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: lab test check docs venv clean browser notebook-filter soak

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "carlskit needs Python >= 3.11; run make PYTHON=python3.11 ...")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip

# pip shows its own progress (downloads, builds): a first install takes minutes, never silently.
$(LAB_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -e ".[lab]"
	@mkdir -p $(dir $(LAB_OVERRIDES))
	printf '{"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": false}}\n' > $(LAB_OVERRIDES)
	@touch $(LAB_STAMP)

$(TEST_STAMP): $(LAB_STAMP)
	$(BIN)/python -m pip install -e ".[lab,dev]"
	@touch $(TEST_STAMP)

venv: $(LAB_STAMP)

# Notebooks stay free of outputs in git: JupyterLab saves them without outputs (a copy with outputs goes
# to notebooks/executed/, ignored; tools/jupyter_server_config.py), and git's clean filter
# (tools/nbstrip.py, named in .gitattributes) strips what other editors save. Outside a checkout: nothing to do.
notebook-filter:
	@if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then git config filter.carlskit-nbstrip.clean "$(PYTHON) tools/nbstrip.py"; fi

lab: $(LAB_STAMP) notebook-filter
	$(BIN)/jupyter lab --ip=127.0.0.1 --port=$(LAB_PORT) --ServerApp.root_dir=notebooks $(LAB_ROOT_FLAG) \
		--config=$(CURDIR)/tools/jupyter_server_config.py

# CARLSKIT_SMALL=1 shrinks the notebooks' problem sizes so the whole suite fits in CI's budget.
# The notebooks run once, as a user runs them: Run All and save in JupyterLab, driven by Chromium
# (tests/notebooks/test_run_all_in_lab.py, before tests/test_docs.py, which renders their executed copies in
# notebooks/executed/). Without Debian's Chromium (make browser) that test skips, so nbmake runs them instead.
# Two pytest-xdist workers: most tests keep one core busy; the tests that start or count JAX process groups,
# the notebooks and the docs run on one worker in order (tests/conftest.py: ONE_WORKER).
NOTEBOOK_RUN := $(if $(wildcard /usr/bin/chromium),,--nbmake notebooks --nbmake-timeout=300)
test: $(TEST_STAMP) notebook-filter
	CARLSKIT_SMALL=1 $(BIN)/python -m pytest $(NOTEBOOK_RUN) tests -p no:cacheprovider -rfE --durations=15 -n 2 --dist loadgroup

# Sphinx with warnings as errors (docs/conf.py says what is generated); the tutorials are rendered from
# notebooks/executed/ (what make test or JupyterLab last ran), never re-run here.
docs: $(TEST_STAMP)
	$(BIN)/python -m sphinx -W --keep-going -b html docs docs/_build/html
	@echo "open docs/_build/html/index.html"

# The quick loop for development: every test not marked slow, no chaos tests, no notebooks (~5 min).
check: $(TEST_STAMP) notebook-filter
	$(BIN)/python -m pytest tests -m "not slow" --ignore=tests/chaos -p no:cacheprovider -q -x

# The long model-based run (tests/bank/test_bank_model.py): CARLSKIT_SOAK_STEPS random steps (default 5000) on a
# 2-shard distributed bank with snapshots + write-ahead log, a worker SIGKILLed every
# CARLSKIT_SOAK_STEPS_BETWEEN_KILLS steps of an example at the earliest (default 50); prints steps, kills, recoveries, seconds.
CARLSKIT_SOAK_STEPS ?= 5000
soak: $(TEST_STAMP)
	CARLSKIT_SOAK_STEPS=$(CARLSKIT_SOAK_STEPS) $(BIN)/python -m pytest tests/bank/test_bank_model.py -k distributed \
		-p no:cacheprovider -s -q -o timeout=0

# The real-browser widget test drives Debian's Chromium through Playwright (it never downloads a browser).
# Without /usr/bin/chromium that one test is skipped locally; .ci/run installs it.
browser:
	@test -x /usr/bin/chromium || { S=$$([ "$$(id -u)" = 0 ] || echo sudo); $$S apt-get update -qq && $$S env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
