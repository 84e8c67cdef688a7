# The two commands: `make run` serves, `make test` runs the whole suite. Both set everything up.
# `make docs` builds the documentation site (site/), `make docs-serve` serves it while you edit.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TEST_STAMP := $(VENV)/.installed-test-stamp
# apt-get waits for another one's package lock (a second set-up beside this one) instead of failing.
APT := apt-get -o DPkg::Lock::Timeout=600
# The same suite at the bottom of pyproject.toml's ranges: every direct dependency at its lower
# bound (constraints-lowest.txt, a lowest-direct resolution made by `make lock`).
LOWEST := .venv-lowest
LOWEST_STAMP := $(LOWEST)/.installed-stamp

.PHONY: run test test-lowest lock test-taskcluster demo bench docs docs-serve clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "Python 3.11+ is needed")'
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) \
		|| { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && rm -rf $(VENV) \
			&& { $(APT) update -qq; $(APT) install -y -qq --no-install-recommends python3-venv; } && $(PYTHON) -m venv $(VENV); } \
		|| { echo "python3 -m venv failed: install Debian's python3-venv (apt-get install python3-venv)"; exit 1; }
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	@touch $@

$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[test]'
	@touch $@

$(LOWEST_STAMP): $(STAMP) constraints-lowest.txt
	@test -x $(LOWEST)/bin/python || $(PYTHON) -m venv $(LOWEST)
	$(LOWEST)/bin/python -m pip install -q --upgrade pip
	$(LOWEST)/bin/python -m pip install -q -c constraints-lowest.txt -e '.[test]'
	@touch $@

run: $(STAMP)
	$(BIN)/coalescer serve

demo: $(STAMP)
	$(BIN)/coalescer demo

# pytest-xdist workers per pass, each with a redis-server of its own (tests/conftest.py). The
# tests mostly wait on processes, brokers and sockets: two passes of 3 keep 2 cores busy.
TEST_WORKERS ?= 3
# The slowest files first (tests/conftest.py), handed out two at a time as workers free up (a
# larger chunk would queue them all on the first worker).
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist load --maxschedchunk 1
# At the lowest versions: every test but those tests/conftest.py marks newest_only (the
# product's own decisions: property tests, the bisection's search, the replay's model, the
# demo and the soak), which no library's version changes.
LOWEST_SCOPE := -m "not newest_only"

# The whole suite at the newest versions pyproject.toml's ranges allow (.venv) and, side by
# side with it, the tests that exercise libraries at the lowest (.venv-lowest), so that every
# declared range is tested at both ends. Each pass has its own workers and redis-servers; the
# lowest pass's output (build/test-lowest.log) is printed after the newest's.
test: $(TEST_STAMP) $(LOWEST_STAMP)
	$(BIN)/python scripts/lock.py --check
	$(BIN)/ruff check coalescer tests tests_taskcluster
	$(BIN)/ruff format --check coalescer tests tests_taskcluster
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache && $(BIN)/deptry coalescer
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site
	@# Installs and starts what the tests need once, before two passes run side by side.
	$(BIN)/python scripts/with_services.py $(BIN)/pytest --version
	@mkdir -p build
	@TEST_PASS=lowest $(BIN)/python scripts/with_services.py $(LOWEST)/bin/pytest -q -p no:cacheprovider \
		$(PYTEST_PARALLEL) $(LOWEST_SCOPE) > build/test-lowest.log 2>&1 & \
	$(BIN)/python scripts/with_services.py $(BIN)/pytest -q $(PYTEST_PARALLEL); newest=$$?; \
	wait $$!; lowest=$$?; \
	echo "== the tests that exercise libraries, at the lowest versions (.venv-lowest)"; \
	cat build/test-lowest.log; \
	test $$newest = 0 && test $$lowest = 0

# The lowest-versions pass only (the second half of `make test`).
test-lowest: $(TEST_STAMP) $(LOWEST_STAMP)
	$(BIN)/python scripts/with_services.py $(LOWEST)/bin/pytest -q -p no:cacheprovider \
		$(PYTEST_PARALLEL) $(LOWEST_SCOPE)

# requirements.txt (the hashed deploy lock) and constraints-lowest.txt, from pyproject.toml.
lock: $(TEST_STAMP)
	$(BIN)/python scripts/lock.py

# Opt-in: the real-systems scenarios against a real Taskcluster deployment named by the
# environment (docs/how-to/real-taskcluster.md). `make test` never collects them.
test-taskcluster: $(TEST_STAMP)
	@$(BIN)/python -m tests_taskcluster.environment
	$(BIN)/pytest -q -p no:cacheprovider --timeout 300 --durations=0 tests_taskcluster

bench: $(TEST_STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	@command -v wrk >/dev/null || { [ "$$(id -u)" = 0 ] && $(APT) update -qq && $(APT) install -y -qq --no-install-recommends wrk; } \
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
	@# One library per job (docs/architecture.md): pika against aio-pika and aiormq consuming
	@# and acking the same backlog; the worker shim's per-claim GET through httpx and aiohttp.
	$(BIN)/python scripts/with_services.py $(BIN)/python bench/amqp_clients.py
	$(BIN)/python bench/http_clients.py

# The chaos soak: the real processes under random store, broker and process faults for
# SOAK_DURATION seconds on SOAK_STORE (redis: one Redis; cluster: 3 masters with replicas), then
# the invariants checked; the report in SOAK_REPORT (report.html, report.json). Exits 1 on any
# violation. `make test` runs a 60 s version (tests/integration/test_soak.py).
SOAK_DURATION ?= 600
SOAK_STORE ?= redis
SOAK_REPORT ?= build/soak-$(SOAK_STORE)
soak: $(TEST_STAMP)
	$(BIN)/python scripts/with_services.py $(BIN)/python -m tests.soak \
		--duration $(SOAK_DURATION) --store $(SOAK_STORE) --report $(SOAK_REPORT)

# The soak's mutation check (not in `make test`: about 2 minutes a soak): each small bug listed
# in tests/soak/mutants.py applied to a scratch copy of the project, the 60 s soak run on it with
# make test's seed on SOAK_STORE, one at a time, and the table of which were caught (also in
# SOAK_CHECK_REPORT/table.md). Exits 1 if a bug escaped or the unmodified soak had a violation.
SOAK_CHECK_REPORT ?= build/soak-check-$(SOAK_STORE)
soak-check: $(TEST_STAMP)
	$(BIN)/python scripts/with_services.py $(BIN)/python -m tests.soak.mutants \
		--store $(SOAK_STORE) --report $(SOAK_CHECK_REPORT)

# The documentation site, built strictly: a broken link or anchor is an error.
docs: $(TEST_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site
	@echo "open site/index.html"

docs-serve: $(TEST_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict --dev-addr 127.0.0.1:8001

clean:
	rm -rf $(VENV) $(LOWEST) .pytest_cache .mypy_cache .ruff_cache site
