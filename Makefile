# Two commands matter: `make demo` (run the marketplace) and `make test` (run the suite).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip -q --disable-pip-version-check
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: demo demo-smoke test lint bench schema lock clean services

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: requirements.txt constraints.txt $(BIN)/python
	$(PIP) install -r requirements.txt -c constraints.txt
	touch $@

$(VENV)/.installed-demo: requirements-demo.txt $(VENV)/.installed
	$(PIP) install -r requirements-demo.txt -c constraints.txt
	touch $@

$(VENV)/.installed-dev: requirements-dev.txt $(VENV)/.installed
	$(PIP) install -r requirements-dev.txt -c constraints.txt
	touch $@

# The `vastai` CLI and SDK for tests/compat, in a venv of their own (requirements-vastai.txt says why).
VASTAI_VENV := .venv-vastai
$(VASTAI_VENV)/.installed: requirements-vastai.txt constraints-vastai.txt
	$(PYTHON) -m venv $(VASTAI_VENV)
	$(VASTAI_VENV)/bin/pip -q --disable-pip-version-check install -r requirements-vastai.txt -c constraints-vastai.txt
	touch $@

## demo: install, migrate, seed, then run web + worker + beat until Ctrl-C
demo: $(VENV)/.installed-demo
	scripts/demo

# pytest-xdist for `make test`: five worker processes, each with its own test database and Redis databases
# (config/settings/test.py); tests/docker stay on one of them (--dist loadgroup). `PYTEST_XDIST=` runs one process.
# Five on two cores: most of the suite waits on sim nodes answering at their real card's pace, so three workers
# kept the CPUs 40 % busy (16 min 8 s on this machine; five: 12 min 56 s, 92 % busy). Seven since stop 56: the
# suite has grown (7,248 tests) and five left the CPUs idle while tests waited on sim nodes and Chromium; on a
# quiet machine five took 752 s, seven 703 s with the CPUs 92.5 % busy (/proc/stat), both -p no:cacheprovider.
# (The three failures that kept this off were another session's suite flushing the same Redis databases.)
PYTEST_XDIST ?= -n 7 --dist loadgroup
# The 20 slowest tests printed at the end, so that a suite drifting towards CI's limits shows where.
# Bytecode is written for the run even where the shell sets PYTHONDONTWRITEBYTECODE (this machine's does): every
# xdist worker imports every test module, and without pytest's cached rewrite of their asserts each worker
# re-parses them all (collecting the suite: 28.7 s of CPU a process without the cache, 16.1 s with it); the
# Celery workers and manage.py runs the tests start compile the project again each time too. __pycache__ is ignored.
PYTEST_DURATIONS ?= --durations=20

# mypy's incremental cache outside the checkout, so that a fresh clone (CI's) on a machine that ran mypy before
# checks only what changed: 18.7 s of CPU cold, 1.5 s warm (docs/BENCHMARKS.md). mypy compares each file's hash
# with its cache, so a cache from another checkout or commit gives the same answer as none.
MYPY_CACHE_DIR ?= $(HOME)/.cache/gpumarket/mypy
# While lint and mypy run on one core, one `pytest --collect-only` on the other writes pytest's rewritten test
# modules to __pycache__: otherwise all five xdist workers rewrite all of them at once (21 CPU-s a worker cold,
# 9 warm). It takes no run lock (tests/conftest.py): collecting touches no database.
PYTEST_WARM = PYTHONDONTWRITEBYTECODE= $(BIN)/pytest --collect-only -q -p no:cacheprovider $(PYTEST_ARGS) >/dev/null 2>&1

## test: install what the tests need, make sure PostgreSQL and Redis are up, run lint, the import contract
## (.importlinter) and the suite
test: $(VENV)/.installed-dev $(VASTAI_VENV)/.installed services
	$(PYTEST_WARM) & warm=$$!; \
	$(BIN)/ruff check . && $(BIN)/lint-imports --no-cache && $(BIN)/mypy --cache-dir "$(MYPY_CACHE_DIR)" && \
	DJANGO_SETTINGS_MODULE=config.settings.test $(BIN)/python manage.py makemigrations --check --dry-run; \
	checked=$$?; wait $$warm; exit $$checked
	PYTHONDONTWRITEBYTECODE= $(BIN)/pytest $(PYTEST_XDIST) $(PYTEST_DURATIONS) $(PYTEST_ARGS)

## demo-smoke: `make demo` from a fresh venv against PostgreSQL and Redis until its first server is listed,
## then Ctrl-C; fails if anything it started is left running (CI runs it after `make test`)
demo-smoke: services
	scripts/demo-smoke

services:
	scripts/ensure-services

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy

$(VENV)/.installed-bench: requirements-bench.txt $(VENV)/.installed-dev
	$(PIP) install -r requirements-bench.txt -c constraints.txt
	touch $@

## bench: the benchmarks under bench/ (needs PostgreSQL, Redis, sshd)
bench: $(VENV)/.installed-bench services
	DJANGO_SETTINGS_MODULE=config.settings.test $(BIN)/python bench/offers_search.py
	DJANGO_SETTINGS_MODULE=config.settings.test $(BIN)/python bench/offers_search.py --http
	DJANGO_SETTINGS_MODULE=config.settings.test $(BIN)/python bench/fleet.py
	DJANGO_SETTINGS_MODULE=config.settings.test $(BIN)/python bench/booking.py

## schema: write the OpenAPI schema to docs/openapi.yaml, as PostgreSQL serves it (the integer bounds of fields
## follow the database backend: SQLite's would differ), which is what tests/test_schema.py compares it with
schema: $(VENV)/.installed services
	DJANGO_SETTINGS_MODULE=config.settings.test $(BIN)/python manage.py spectacular --validate --file docs/openapi.yaml

## lock: re-pin every package after changing requirements*.txt
lock: $(BIN)/python
	$(PIP) install -r requirements-dev.txt -r requirements-demo.txt -r requirements-bench.txt
	(echo '# Every installed package, pinned (pip freeze of requirements*.txt). Regenerate with `make lock`.'; \
	 $(BIN)/pip freeze --all | grep -v -e '^-e' -e '^pip==' | sort) > constraints.txt
	$(PYTHON) -m venv $(VASTAI_VENV)
	$(VASTAI_VENV)/bin/pip -q --disable-pip-version-check install -r requirements-vastai.txt
	(echo '# Every package of .venv-vastai (requirements-vastai.txt), pinned. Regenerate with `make lock`.'; \
	 $(VASTAI_VENV)/bin/pip freeze --all | grep -v -e '^-e' -e '^pip==' -e '^setuptools==' | LC_ALL=C sort) \
	 > constraints-vastai.txt

clean:
	rm -rf $(VENV) $(VASTAI_VENV) var
