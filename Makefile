# carlskit: two commands on a fresh machine with Python 3.11+ (no conda needed).
#   make lab   - create .venv, install carlskit with the lab extras, open the tutorials in JupyterLab
#   make test  - create or update .venv, install, run every test and notebook
#   make check - the quick subset (no slow tests, chaos tests or notebooks) for a development loop
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LAB_PORT ?= 8888
# Jupyter refuses to run as root unless told; containers and CI machines often are root.
LAB_ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: lab test check venv clean browser

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "carlskit needs Python >= 3.11; run make PYTHON=python3.11 ...")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[lab,dev]"
	@touch $(STAMP)

venv: $(STAMP)

lab: $(STAMP)
	$(BIN)/jupyter lab --ip=127.0.0.1 --port=$(LAB_PORT) --ServerApp.root_dir=notebooks $(LAB_ROOT_FLAG)

# CARLSKIT_SMALL=1 shrinks the notebooks' problem sizes so the whole suite fits in CI's budget.
test: $(STAMP)
	CARLSKIT_SMALL=1 $(BIN)/python -m pytest tests --nbmake notebooks --nbmake-timeout=300 -p no:cacheprovider -rfE --durations=15

# The quick loop for development: every test not marked slow, no chaos tests, no notebooks (~5 min).
check: $(STAMP)
	$(BIN)/python -m pytest tests -m "not slow" --ignore=tests/chaos -p no:cacheprovider -q -x

# The real-browser widget test drives Debian's Chromium through Playwright (it never downloads a browser).
# Without /usr/bin/chromium that one test is skipped locally; .ci/run installs it.
browser:
	@test -x /usr/bin/chromium || { S=$$([ "$$(id -u)" = 0 ] || echo sudo); $$S apt-get update -qq && $$S env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
