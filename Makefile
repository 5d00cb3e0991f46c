PY ?= python3
VENV = .venv
PYTEST_ARGS ?=

.PHONY: venv bytecode test demo clean bench-recovery bench-idle bench-recover-time bench-throughput \
	bench-latency bench-standalone bench-submit bench-chaos

venv: $(VENV)/.installed bytecode

# The project's own modules compiled to bytecode, as installing a wheel would: an editable
# install compiles none, and with PYTHONDONTWRITEBYTECODE set every process would compile each
# module it imports again (about a fifth of the start-up of ql3 standalone). Stale files are
# recompiled; Python checks each against its source anyway.
PACKAGES = ql3 benchmarks

bytecode: $(VENV)/.installed
	$(VENV)/bin/python -m compileall -q $(PACKAGES) >/dev/null

# Reinstall only when the project metadata changes.
$(VENV)/.installed: pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[dev,bench]'
	touch $@

# What the tests run besides Python, as COMMAND:DEBIAN_PACKAGE: openssl (TLS certificates),
# promtool (alert rules), spin (the protocol model); installed only when missing.
SYSTEM_TOOLS = openssl:openssl promtool:prometheus spin:spin chromium:chromium

test: venv
	@missing=""; for tool in $(SYSTEM_TOOLS); do \
		command -v $${tool%%:*} >/dev/null || missing="$$missing $${tool#*:}"; \
	done; \
	if [ -n "$$missing" ]; then apt-get update && apt-get install -y $$missing; fi
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)
	cd examples/shop && ../../$(VENV)/bin/python -m pytest

demo: venv
	$(VENV)/bin/ql3 demo

bench-recovery: venv
	$(VENV)/bin/python -m benchmarks recovery

bench-idle: venv
	$(VENV)/bin/python -m benchmarks idle

bench-recover-time: venv
	$(VENV)/bin/python -m benchmarks recover-time

bench-throughput: venv
	$(VENV)/bin/python -m benchmarks throughput

bench-latency: venv
	$(VENV)/bin/python -m benchmarks latency

bench-standalone: venv
	$(VENV)/bin/python -m benchmarks standalone

bench-submit: venv
	$(VENV)/bin/python -m benchmarks submit

bench-chaos: venv
	$(VENV)/bin/python -m benchmarks chaos

clean:
	rm -rf $(VENV) build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
