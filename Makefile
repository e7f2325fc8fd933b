# gpulayer: `make run` starts the whole stack here; `make test` runs the suite.
# Installs what it needs: uv from PyPI if missing, then the locked workspace.
SHELL := /bin/bash
export UV_PYTHON_DOWNLOADS := never
PYTHON ?= python3
UV ?= $(shell command -v uv 2>/dev/null)
ifeq ($(strip $(UV)),)
# No uv on PATH: install it from PyPI for this user and run it as a module.
UV := $(PYTHON) -m uv
UV_INSTALL := $(PYTHON) -m uv --version >/dev/null 2>&1 || \
	$(PYTHON) -m pip install --user --quiet uv || \
	$(PYTHON) -m pip install --user --quiet --break-system-packages uv
endif
VENV := .venv
STAMP := $(VENV)/.synced

.PHONY: run test test-durations test-repeat test-unit lint fmt bench bench-scale bench-ab sync clean faults faults-ha image wheels deploy-up deploy-down deploy-test deploy-test-clean

$(STAMP): uv.lock pyproject.toml $(wildcard libs/*/pyproject.toml services/*/pyproject.toml)
	$(UV_INSTALL)
	$(UV) sync --locked --all-groups --compile-bytecode --python $(PYTHON)
	@# Our own sources too: every service, CLI call and test stack is a new interpreter, and
	@# where PYTHONDONTWRITEBYTECODE is set (as on CI machines) each one compiled every module
	@# it imports, ~45% of a CLI call's CPU. A .pyc made stale by an edit is just not used.
	$(VENV)/bin/python -m compileall -q -j 0 libs services tests bench docs >/dev/null
	@touch $(STAMP)

sync: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/gpulayer dev up

# The whole suite, the fault run included, in parallel (pytest-xdist): its tests mostly wait
# on servers and processes, so TEST_WORKERS runs beat the cores. Each test's servers, ports and
# folders are its own; each run's folders are under a temporary root of its own (removed when
# the run passes, kept and named when it fails), so two runs at once never clean each other's.
TEST_WORKERS ?= 6
test: $(STAMP)
	@tmp=$$(mktemp -d "$${TMPDIR:-/tmp}/gpulayer-test.XXXXXX"); \
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder \
		--basetemp="$$tmp/t" \
		$(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 0 ]; then rm -rf "$$tmp"; else echo "the failed run's folders: $$tmp"; fi; \
	exit $$rc

# `make test-durations`: the suite once, then each slow module's time into
# tests/module_seconds.txt, which orders them slowest first (tests/conftest.py). Run it when a
# module's time changes much; a stale file only costs balance, never a result.
test-durations: $(STAMP)
	$(MAKE) test PYTEST_ARGS="--junitxml=$${TMPDIR:-/tmp}/gpulayer-durations.xml $(PYTEST_ARGS)"
	$(VENV)/bin/python tests/durations.py "$${TMPDIR:-/tmp}/gpulayer-durations.xml" \
		> tests/module_seconds.txt

# `make test-repeat N=5`: the suite N times on a fresh clone of HEAD (what is committed), each
# run's time and failures by test name, then how many were green: the flake hunt. BUSY=1 keeps
# a core busy meanwhile (a loaded CI machine: what a test leaning on a short wait fails on).
N ?= 5
BUSY ?= 0
test-repeat:
	BUSY=$(BUSY) bash tests/repeat.sh $(N)

# The fault run alone, its counts shown: NATS, placement, an executor killed with -9,
# PostgreSQL restarted and a node cut off the network under steady submits (tests/faults).
faults: $(STAMP)
	$(VENV)/bin/pytest -q -s tests/faults/test_fault_run.py $(PYTEST_ARGS)

# PostgreSQL as a Patroni cluster (etcd, a synchronous standby) under the fault run's load: its
# leader's PostgreSQL killed, a switchover, the old leader back by pg_rewind (tests/faults/
# test_fault_ha.py, test_patroni_failover.py). Needs etcd (apt-get install etcd-server); makes
# Patroni's venv in .gpulayer/patroni-venv from tests/faults/ha/patroni-requirements.txt.
# ASYNC=1: the same faults with synchronous_mode off, counting what was lost (not asserted).
faults-ha: $(STAMP)
	GPULAYER_HA_TESTS=1 $(if $(ASYNC),GPULAYER_HA_ASYNC=1,) $(VENV)/bin/pytest -q -s \
		$(if $(ASYNC),,tests/faults/test_patroni_failover.py) tests/faults/test_fault_ha.py $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(VENV)/bin/pytest -q tests/unit

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

fmt: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: $(STAMP)
	$(VENV)/bin/python -m bench $(if $(FULL),--full,) $(if $(PEERS),--peers,)

# A million jobs on 10,000 simulated nodes, then 900,000 waiting (bench/c1m.py): 20 minutes or
# more, about 10 GB of disk under the temp folder. SCALE=0.01 runs a hundredth of it.
bench-scale: $(STAMP)
	GPULAYER_C1M_SCALE=$(or $(SCALE),1) $(VENV)/bin/python -m bench --only c1m

# A change's cost: make bench-ab BASE=<commit> [ONLY=placement1k,loop] [PAIRS=3] [FULL=1]
# (bench/ab.py; `python -m bench.ab --help` for the rest). The base is built in a worktree of its
# own under .gpulayer/bench-ab/ and kept; then base and head run alternating, pair by pair, which
# side goes first swapped every other pair (an even PAIRS cancels the machine's drift).
bench-ab: $(STAMP)
	$(if $(BASE),,$(error make bench-ab needs BASE=<commit>, e.g. make bench-ab BASE=8d73258 ONLY=placement1k,loop))
	UV="$(UV)" PYTHON="$(PYTHON)" $(VENV)/bin/python -m bench.ab --base $(BASE) \
		$(if $(ONLY),--only $(ONLY),) $(if $(PAIRS),--pairs $(PAIRS),) $(if $(FULL),--full,)

# One image for every service and the CLI: localhost/gpulayer:dev and :<version>, with podman
# (or docker). BASE=, ENGINE=, CA=, FORCE=1: deploy/image/build says what each does.
image:
	bash deploy/image/build

# dist/wheels/: every gpulayer package and every locked dependency as wheels, for installing a
# node with no index (deploy/install-node). Rebuilt only when the sources or uv.lock changed;
# PYTHON= the interpreter whose platform the wheels are for, FORCE=1: deploy/wheels says more.
wheels:
	$(UV_INSTALL)
	UV="$(UV)" PYTHON="$(PYTHON)" bash deploy/wheels

# The compose stack (deploy/compose.yaml) with the image above: deploy/up does the documented
# steps once (gen-env, credentials, signing key; TLS=1: a CA and NATS over TLS), then compose
# up -d with podman-compose (or docker compose). deploy-down keeps the volumes; V=1 drops them.
deploy-up: $(STAMP) image
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" deploy/up
deploy-down: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" deploy/down $(if $(V),-v,)

# gpulayer installed as a team would, with podman: the image, compose up for real, two nodes
# running systemd joining over TLS, state across down/up (tests/deploy/run.py). KEEP=1 leaves
# it up; deploy-test-clean removes what it left.
deploy-test: $(STAMP)
	$(VENV)/bin/python -m tests.deploy.run
deploy-test-clean: $(STAMP)
	$(VENV)/bin/python -m tests.deploy.run --clean

docs: $(STAMP)  # regenerate docs/jobs.md and docs/schemas/ from the contracts
	$(VENV)/bin/python docs/gen_reference.py
.PHONY: docs  # docs/ is a directory: without this, make would call the target up to date

clean:
	rm -rf $(VENV) .gpulayer .pytest_cache .mypy_cache .ruff_cache
	git worktree prune  # forget make bench-ab's base checkouts, gone with .gpulayer
