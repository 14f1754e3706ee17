# Two entry points, both self-installing into ./.venv on first use:
#   make demo   - the main job on the embedded default (a persistent Valkey under ./.offload/)
#   make test   - lint, type-check and the whole test suite (pytest) against real servers (and a real browser:
#                 Debian's chromium, installed with apt-get when missing)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench clean chromium

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

demo: $(VENV)/.installed
	@$(BIN)/offload demo

lint: $(VENV)/.installed
	$(BIN)/ruff check offload tests bench
	$(BIN)/mypy

# The dashboard's browser tests drive Debian's Chromium through Playwright (never `playwright install`, whose
# browser download does not work here). Installed on first use; CI runs as root.
chromium:
	@test -x /usr/bin/chromium || { export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; }

test: lint chromium
	$(BIN)/pytest -q -n 2 --dist loadgroup

bench: $(VENV)/.installed
	$(BIN)/python bench/queue_throughput.py --jobs 100000

clean:
	rm -rf $(VENV) .offload .pytest_cache .mypy_cache .ruff_cache
