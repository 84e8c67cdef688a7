# The two commands: `make run` serves, `make test` runs the whole suite. Both set everything up.
# `make docs` builds the documentation site (site/), `make docs-serve` serves it while you edit.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TEST_STAMP := $(VENV)/.installed-test-stamp

.PHONY: run test test-taskcluster demo bench docs docs-serve clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "Python 3.11+ is needed")'
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) \
		|| { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && rm -rf $(VENV) \
			&& { apt-get update -qq; apt-get install -y -qq python3-venv; } && $(PYTHON) -m venv $(VENV); } \
		|| { echo "python3 -m venv failed: install Debian's python3-venv (apt-get install python3-venv)"; exit 1; }
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	@touch $@

$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[test]'
	@touch $@

run: $(STAMP)
	$(BIN)/coalescer serve

demo: $(STAMP)
	$(BIN)/coalescer demo

test: $(TEST_STAMP)
	$(BIN)/ruff check coalescer tests tests_taskcluster
	$(BIN)/ruff format --check coalescer tests tests_taskcluster
	$(BIN)/mypy
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site
	$(BIN)/python scripts/with_services.py $(BIN)/pytest -q

# Opt-in: the real-systems scenarios against a real Taskcluster deployment named by the
# environment (docs/how-to/real-taskcluster.md). `make test` never collects them.
test-taskcluster: $(TEST_STAMP)
	@$(BIN)/python -m tests_taskcluster.environment
	$(BIN)/pytest -q -p no:cacheprovider --timeout 300 --durations=0 tests_taskcluster

bench: $(TEST_STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	@command -v wrk >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get install -y -qq wrk; } \
		|| { echo "make bench needs wrk: apt-get install wrk"; exit 1; }
	@# The query against a bare Starlette endpoint: the rotating mix (the default), one URL, and
	@# tc-coalesce's route against a model of tc-coalesce.
	$(BIN)/python scripts/with_services.py $(BIN)/python bench/query.py
	@# Two web processes (serve --workers 2) against one, on the rotating mix.
	$(BIN)/python scripts/with_services.py $(BIN)/python bench/workers.py
	@# The query at 1k, 100k and 1M tracked tasks, and Redis bytes per task (a private redis-server).
	$(BIN)/python bench/scale.py
	@# Ingest: one `coalescer listen` draining a Pulse backlog, and POST /v1/events in bodies of 1,000.
	$(BIN)/python scripts/with_services.py $(BIN)/python bench/ingest.py

# The documentation site, built strictly: a broken link or anchor is an error.
docs: $(TEST_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site
	@echo "open site/index.html"

docs-serve: $(TEST_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict --dev-addr 127.0.0.1:8001

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
