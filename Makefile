# Three entry points, all self-installing into ./.venv on first use:
#   make demo   - the main job on the embedded default (a persistent Valkey under ./.offload/)
#   make check  - lint, type-check and the fast tests (CHECK_TESTS, under a minute): the default while working
#   make test   - lint, type-check and the whole test suite (pytest) against real servers (and a real browser:
#                 Debian's chromium, installed with apt-get when missing, as is libjemalloc2)
# The venvs' interpreter: the distro's CPython (/usr/bin/python3) where it is 3.11 or newer and has venv, as
# deploy/'s cloud-init and image install offload on it, else the first python3 on PATH; `make PYTHON=...` to
# choose. Why the distro's first: tests and benchmarks then run on the interpreter offload is deployed with, and a
# CPython built without PGO/LTO (pyenv's default, the PATH's python3 on these machines) ran offload's 2,000-job
# webhook burst with 15-20 % more CPU in the worker and the simulator (docs/benchmarks.md, *Interpreter*).
# (Probed once: `?=` would make a recursive variable, which runs the probe again wherever $(PYTHON) is used.)
ifeq ($(origin PYTHON),undefined)
PYTHON := $(shell for p in /usr/bin/python3 python3; do "$$p" -c 'import sys, ensurepip, venv; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1 && { echo "$$p"; break; }; done)
endif
ifeq ($(strip $(PYTHON)),)
$(error no Python 3.11+ with the venv module found: install one, or run make PYTHON=/path/to/python3.11)
endif
VENV := .venv
BIN := $(VENV)/bin
# checkov (IaC scanner) lives in a venv of its own: it pins dependencies the project's venv must not inherit. The
# same venv runs cloud-init's own schema check, from Debian's cloud-init package unpacked into it (cloud-init is
# not on PyPI); where apt cannot fetch it, the cloud-init tests fall back to YAML and required-key checks.
CHECKOV_VERSION := 3.3.30
TOOLS := .venv-checkov
TOOLS_STAMP := $(TOOLS)/.installed-$(CHECKOV_VERSION)

.PHONY: demo test check lint docs docs-serve reference bench clean deploy-tools chromium jemalloc faketime

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# uv installs what pip would (the same versions, compared with `pip freeze`) in about 5 s where pip takes ~50 s of
# a CI run; pip installs them where uv cannot (no uv wheel, or no way to its index). Both leave compiled bytecode:
# where PYTHONDONTWRITEBYTECODE is set nothing else writes it, and every process started compiles again what it
# imports (~0.5 s of CPU for each offload process; see docs/performance.md).
UV_INSTALL = $(1)/bin/pip install --quiet uv && VIRTUAL_ENV=$(CURDIR)/$(1) $(1)/bin/uv pip install --quiet \
	--compile-bytecode $(2) || $(1)/bin/pip install --quiet $(2)
BYTECODE = $(BIN)/python -m compileall -q -j 0 offload bench tests >/dev/null \
	|| echo "note: some bytecode was not written; processes compile those modules as they import them"

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(call UV_INSTALL,$(VENV),-e '.[dev]')
	$(BYTECODE)
	touch $@

$(TOOLS_STAMP):
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/pip install --quiet --upgrade pip
	$(call UV_INSTALL,$(TOOLS),'checkov==$(CHECKOV_VERSION)' 'configobj>=5' 'jsonpatch>=1.33')
	rm -rf $(TOOLS)/cloud-init $(TOOLS)/deb && mkdir -p $(TOOLS)/deb
	if command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null; then \
	  (cd $(TOOLS)/deb && (apt-get download -q cloud-init 2>/dev/null \
	    || { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get download -q cloud-init 2>/dev/null; })) \
	  && dpkg-deb -x $(TOOLS)/deb/cloud-init_*.deb $(TOOLS)/cloud-init \
	  || echo "note: Debian's cloud-init package could not be fetched; its schema check will be skipped"; \
	fi
	rm -rf $(TOOLS)/deb
	touch $@

deploy-tools: $(TOOLS_STAMP)

demo: $(VENV)/.installed
	@$(BIN)/offload demo

lint: $(VENV)/.installed
	$(BIN)/ruff check offload tests bench scripts
	$(BIN)/ruff format --check offload tests bench scripts
	$(BIN)/mypy

# The docs site (mkdocs.yml, docs/): the generated reference pages written again from the code, then a strict
# build into site/ (a broken link or anchor fails it); docs-serve serves it on 127.0.0.1:8000 while you write.
reference: $(VENV)/.installed
	$(BIN)/python -m scripts.reference

docs: reference
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: reference
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

# The dashboard's browser tests drive Debian's Chromium through Playwright (never `playwright install`, whose
# browser download does not work here). Installed on first use; CI runs as root.
chromium:
	@test -x /usr/bin/chromium || { export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; }

# The wheel's Valkey runs with jemalloc preloaded where the machine has it (offload/local/embedded.py: ~35% less Valkey
# CPU per job than glibc's malloc); the tests check that it does, so `make test` installs Debian's libjemalloc2.
jemalloc:
	@/sbin/ldconfig -p | grep -q 'libjemalloc\.so\.2' || { export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q libjemalloc2 || { apt-get update -q && apt-get install -y -q libjemalloc2; }; }

# The tests of wrong clocks and the fault harness step Valkey's clock and skew workers' with libfaketime
# (bench/chaos/faketime.py): Debian's faketime package.
faketime:
	@ls /usr/lib/*/faketime/libfaketime.so.1 >/dev/null 2>&1 || { export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q faketime || { apt-get update -q && apt-get install -y -q faketime; }; }

# The fast tier: real servers still, but no subprocess fleets, browsers, clusters or timed scenarios; chosen to run
# in under a minute with lint on a loaded 2-core machine (measured with `time make check`: see CONTRIBUTING.md).
CHECK_TESTS := tests/project/test_docs_layout.py tests/project/test_import_graph.py tests/project/test_keys_layout.py \
	tests/jobstore/test_queue.py tests/jobstore/test_queue_replies.py tests/jobstore/test_queue_submits.py \
	tests/jobstore/test_queue_replays.py tests/jobstore/test_redis_client.py tests/jobstore/test_lua_scripts.py \
	tests/worker/test_batching.py \
	tests/worker/test_job_limits.py \
	tests/sim/test_sim_sender.py tests/sim/test_backends.py tests/security/test_security_redact.py \
	tests/security/test_security_redact_forms.py \
	tests/webhooks/test_webhooks_config.py tests/webhooks/test_webhooks_store.py tests/autoscale/test_autoscale_config.py \
	tests/server/test_server_auth.py

check: lint
	$(BIN)/pytest -q $(CHECK_TESTS)

# Three pytest processes on two cores: most of the suite waits on subprocesses, servers and timeouts (9:18 with
# -n 2 against 7:02 with -n 3, the same 999 tests, one after the other on one machine).
test: lint $(TOOLS_STAMP) chromium jemalloc faketime
	$(BYTECODE)
	$(BIN)/pytest -q -n 3 --dist loadgroup --durations=40

bench: $(VENV)/.installed
	$(BIN)/python bench/queue_throughput.py --jobs 100000

clean:
	rm -rf $(VENV) $(TOOLS) .offload .pytest_cache .mypy_cache .ruff_cache site
