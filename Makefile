# The words a newcomer guesses: run, test, lint, bench, chaos.
# The CPython .venv is made with: the OS's own optimised build when there is one (scripts/python_pick.py).
ifeq ($(origin PYTHON),undefined)
PYTHON := $(shell python3 scripts/python_pick.py 2>/dev/null || echo python3)
endif
VENV   := .venv
BIN    := $(VENV)/bin
# Names the interpreter .venv was made with: another choice of PYTHON makes .venv again.
VENV_MADE := $(VENV)/.made-with-$(subst /,-,$(patsubst /%,%,$(PYTHON)))
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: run test lint format bench chaos native clean help

help:
	@echo "make run    - start the whole platform on embedded defaults (http://127.0.0.1:8000)"
	@echo "make test   - lint, checks and the whole test suite on PostgreSQL and Redis"
	@echo "make bench  - benchmarks (tables + bench/results/*.json)"
	@echo "make lint   - ruff"
	@echo "make native - compile the placement core with mypyc (test, bench and chaos do it first)"

$(VENV_MADE):
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@touch $@

$(VENV)/.installed: requirements.txt pyproject.toml client/pyproject.toml $(VENV_MADE)
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/pip install -q --no-deps -e client
	@touch $@

$(VENV)/.installed-dev: requirements-dev.txt $(VENV)/.installed
	$(BIN)/pip install -q -r requirements-dev.txt
	@touch $@

run: $(VENV)/.installed
	-$(BIN)/python scripts/jobexec_build.py  # without it the agent drops privileges in Python
	$(BIN)/python scripts/run.py

native: $(VENV)/.installed-dev
	$(BIN)/python scripts/native_build.py
	$(BIN)/python scripts/jobexec_build.py

test: native
	$(BIN)/python scripts/services_check.py
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	DJANGO_SETTINGS_MODULE=gpushare.settings.test $(BIN)/python manage.py check
	DJANGO_SETTINGS_MODULE=gpushare.settings.test $(BIN)/python manage.py makemigrations --check --dry-run
	DJANGO_SETTINGS_MODULE=gpushare.settings.test $(BIN)/python manage.py spectacular --validate --fail-on-warn --file /dev/null
	$(BIN)/pytest

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(VENV)/.installed-dev
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: native
	$(BIN)/python scripts/services_check.py
	$(BIN)/python -m bench

chaos: native
	$(BIN)/python scripts/services_check.py
	$(BIN)/python -m chaos

clean:
	rm -rf var staticfiles .pytest_cache build
