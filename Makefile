# kvoffload — the two set-up commands are `make demo` and `make test`; everything else is a step of them.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export PATH := $(CURDIR)/$(BIN):$(PATH)
CLUSTER := $(BIN)/python -m kvtest
KUBECONFIG ?= $(CURDIR)/.cluster/kubeconfig
LMCACHE_VERSION := 0.5.6

.PHONY: venv system-deps cluster-build cluster-up cluster-down cluster-status generate lint unit integration test demo demo-down bench clean

venv: $(VENV)/.done
$(VENV)/.done: operator/pyproject.toml tests/support/pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e 'operator[test]'
	# The test-support package (tests/support: kvtest), so tests, benchmarks and scripts `import kvtest`.
	$(BIN)/pip install -q -e tests/support
	# LMCache's own config loader, for fidelity tests only (no torch, no CUDA): not an operator dependency.
	$(BIN)/pip install -q --no-deps lmcache==$(LMCACHE_VERSION)
	touch $@

# A real Prometheus for the exporter's scrape test (Debian package).
system-deps:
	@command -v prometheus >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	  else echo "install prometheus (apt-get install prometheus) for the exporter scrape test"; exit 1; fi; }

cluster-build:
	tests/cluster/build.sh

cluster-up: venv cluster-build
	$(CLUSTER) up

cluster-down: venv
	$(CLUSTER) down

cluster-status: venv
	$(CLUSTER) status

generate: venv
	$(BIN)/python -m kvoffload.cli.generate

# ruff, one configuration (operator/pyproject.toml [tool.ruff]) for the package, the tests and the benchmarks.
lint: venv
	$(BIN)/ruff check --config operator/pyproject.toml operator tests benchmarks

unit: venv
	$(BIN)/python -m pytest tests/unit -q

integration: venv system-deps cluster-build
	KVO_REQUIRE_CLUSTER=1 $(BIN)/python -m pytest tests/integration -q

# Lint, the generated files, unit tests, then everything on the real control plane (started from the cached build, stopped after).
test: venv lint system-deps cluster-build
	$(BIN)/python -m kvoffload.cli.generate --check
	KVO_REQUIRE_CLUSTER=1 $(BIN)/python -m pytest tests -q

demo: venv cluster-build
	tests/cluster/demo.sh

demo-down: venv
	-tests/cluster/demo.sh down

bench: venv cluster-build
	$(BIN)/python benchmarks/exporter_bench.py

clean: demo-down
	rm -rf $(VENV) .cluster .pytest_cache
