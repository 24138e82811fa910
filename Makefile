# kvoffload — the two set-up commands are `make demo` and `make test`; everything else is a step of them.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export PATH := $(CURDIR)/$(BIN):$(PATH)
CLUSTER := $(BIN)/python -m kvtest
KUBECONFIG ?= $(CURDIR)/.cluster/kubeconfig
# The default engine pair (engine/images.py DEFAULT_PAIR, the serving Dockerfile's defaults; a test checks they agree).
VLLM_VERSION := 0.33.0
LMCACHE_VERSION := 0.5.6
# vLLM's router that spec.routing renders for (kvoffload/engine/router.py VERSION; images/router/Dockerfile).
ROUTER_VERSION := 0.1.17

.PHONY: background-builds router router-wheels router-image node-build venv operator-wheels serving-wheels images standin-image engine-venv engine-metadata engine-tables system-deps cluster-build gitops-tools keda cluster-up cluster-down cluster-status generate lint typecheck check unit integration test demo demo-down bench clean

venv: $(VENV)/.done
$(VENV)/.done: operator/pyproject.toml tests/support/pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e 'operator[test]'
	# The test-support package (tests/support: kvtest), so tests, benchmarks and scripts `import kvtest`.
	$(BIN)/pip install -q -e tests/support
	touch $@

# The operator's dependencies as wheels (cached), so the test that installs ./operator in a clean venv
# like the operator image does runs offline (tests never reach the network).
# Also what the slim stand-in engine image installs beside them (tests/images/vllm-standin-slim): vLLM's KV-event
# transport, ZMQ and msgpack, at the versions vLLM 0.26.0's engine venv holds.
operator-wheels: venv
	$(BIN)/pip download -q -d $(HOME)/.cache/kvoffload/wheelhouse ./operator 'setuptools>=68' wheel \
	  'pyzmq==27.3.0' 'msgspec==0.23.0'

# The serving image of one offered pair: PAIR=<vLLM>-<LMCache> (engine/images.py), default the default pair.
# COMPILE=1: a pair whose LMCache is compiled compiles it in the image's build, for the Dockerfile's GPU list, as users
# build it (over an hour on 2 cores); without it the build installs the wheel that pair's engine venv compiled.
PAIR ?= $(VLLM_VERSION)-$(LMCACHE_VERSION)
COMPILE_FLAG := $(if $(COMPILE),--compile)

# What the serving images' builds install with pip (cached), so `make images` builds without network: each pair's
# LMCache wheel from PyPI, or for a pair whose LMCache is compiled nothing more (its engine venv compiles the wheel),
# with COMPILE=1 (PAIR=0.33.0-0.5.6; after `make engine-venv`) its sdist and the toolchain build-lmcache.sh installs,
# as its --download mode resolves them in that pair's engine venv; and async-timeout, which LMCache's redis needs on
# Python < 3.11.3 (the local base's Debian 3.11.2). Without PAIR: every offered pair's (what `make test` builds).
serving-wheels: venv
	$(BIN)/python -m kvtest.images wheels $(if $(filter command line,$(origin PAIR)),--pair $(PAIR)) $(COMPILE_FLAG)

# vLLM's router and its dependencies as wheels (cached; binary wheels only, so nothing is built offline), so the router
# image (images/router/Dockerfile) builds without network: the real-node routing test runs it as the rendered pod.
router-wheels: venv
	$(BIN)/pip download -q --only-binary=:all: -d $(HOME)/.cache/kvoffload/wheelhouse-vllm-router-$(ROUTER_VERSION) 'vllm-router==$(ROUTER_VERSION)'

# The router image alone (tests/integration/test_real_node_routing.py builds and loads it itself).
router-image: venv system-deps router-wheels
	$(BIN)/python -m kvtest.images build router

# Both images (images/*/Dockerfile) with podman, offline, FROM local bases made from Debian's packages
# and the engine venv (tests/support/kvtest/images.py; README "Images" builds them FROM the public ones).
# PAIR=0.26.0-0.5.3: that pair's serving image; COMPILE=1: LMCache compiled in the build (an hour or more on 2 cores).
images: venv system-deps operator-wheels engine-venv serving-wheels
	$(BIN)/python -m kvtest.images build operator serving --pair $(PAIR) $(COMPILE_FLAG)

# The full stand-in engine image (tests/images/vllm-standin, FROM the serving image: vLLM's parser, the real LMCache
# server), for KVO_STANDIN=full runs on the real node. `make test` builds the slim one itself (kvtest.images standin-slim).
standin-image: images
	$(BIN)/python -m kvtest.images build standin

# vLLM + LMCache of every serving image (engine/images.serving_images()) in its own cached venv (~8-10 GB
# each; the first time ~4 min for a wheel pair, 15-25 min for the default pair, whose LMCache is compiled):
# the fidelity tests run vLLM's real parser and create_engine_config(), LMCache's real loader and its
# CUDA extension's load there.
engine-venv: venv
	PY=$(PY) $(BIN)/python tests/engine/engine_venv.py build

# What the compatibility matrix reads from PyPI (wheel metadata, LMCache wheels), fetched here at
# install time and cached: tests never reach the network.
engine-metadata: venv engine-venv
	$(BIN)/python tests/engine/compatibility.py --fetch

# Regenerate the operator's vLLM flag tables, one per offered pair, from that vLLM's own parser (a test checks
# they are current).
engine-tables: engine-venv
	$(BIN)/python tests/engine/engine_venv.py tables

# Debian packages the tests need: a real Prometheus (the exporter's scrape test), objdump (LMCache's
# compiled L1 allocator, tests/engine/test_l1_first_touch.py), and the image builders: podman/buildah,
# runc (Debian's crun refuses this VM's hybrid cgroups) and debootstrap (the local base images); the real
# node's (kvtest.node): nft (its guard, kube-proxy's nftables mode), iptables (kubelet's chains), ip, mount,
# conntrack, and gcc + libc6-dev's libc.a (pause.c, linked statically). runc is also the node's OCI runtime.
SYSTEM_DEPS := prometheus:prometheus objdump:binutils podman:podman buildah:buildah runc:runc debootstrap:debootstrap \
  nft:nftables iptables:iptables ip:iproute2 conntrack:conntrack gcc:gcc
system-deps:
	@missing=$$(for d in $(SYSTEM_DEPS); do command -v $${d%%:*} >/dev/null || echo $${d##*:}; done; \
	  gcc -print-file-name=libc.a | grep -q / || echo libc6-dev); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else echo "install these Debian packages (apt-get install $$missing)"; exit 1; fi; fi

# vLLM's router from its PyPI wheel in a cached venv (~/.cache/kvoffload/vllm-router-VERSION, a minute the first
# time): the routing tests and benchmark run the real router against the local cluster's API server.
router:
	PY=$(PY) tests/routing/build-router.sh $(ROUTER_VERSION) >/dev/null

cluster-build:
	tests/cluster/build.sh

# The real node's kubelet, kube-proxy, containerd, CNI plugins and pause (cached by version; tests/cluster/build-node.sh).
node-build: cluster-build
	tests/cluster/build-node.sh

# KEDA's operator and metrics API server for the autoscaling tests (tests/autoscaling/build-keda.sh), cached by
# version (cold: 20 CPU-minutes, 37 min wall on the loaded dev VM; docs/benchmarks.md). Without it the KEDA
# tests skip, or fail under KVO_REQUIRE_KEDA (make test).
keda:
	tests/autoscaling/build-keda.sh >/dev/null

# Argo CD's Lua health runner (gopher-lua), the kstatus checker (Helm v4's kstatus) and Flux's
# source-controller and kustomize-controller with their CRDs, cached by version.
gitops-tools:
	tests/gitops/build.sh

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

# mypy (pinned in operator/pyproject.toml [tool.mypy]) over the operator package.
typecheck: venv
	cd operator && ../$(BIN)/mypy

# Fast feedback, first in `make test`: lint, the type check, the generated files, the unit tests; stops at the
# first failure. No network and no build (KVO_CHECK=1): unit tests that need a built tool or a download (helm, the
# router, the GitOps tools, the wheelhouse: tests/conftest.py BUILT_TOOL_FIXTURES) skip here and run in the full pass.
check: lint typecheck
	$(BIN)/python -m kvoffload.cli.generate --check
	KVO_CHECK=1 $(BIN)/python -m pytest tests/unit -q -x

unit: venv operator-wheels router-wheels gitops-tools router
	$(BIN)/python -m pytest tests/unit -q

integration: venv system-deps operator-wheels router-wheels cluster-build node-build gitops-tools keda router
	KVO_REQUIRE_CLUSTER=1 KVO_REQUIRE_REAL_NODE=1 KVO_REQUIRE_KEDA=1 $(BIN)/python -m pytest tests/integration -q

# The longest cold builds start in the background once `make check` passed, at the lowest CPU and I/O priority, and
# the tests start as soon as the control plane and the node are built: the tests that need a background build run
# last and wait for it (tests/support/kvtest/background.py). Three chains: KEDA (~20 CPU-min cold), Flux's
# controllers, and the engine chain (`python -m kvtest.background engine`): both engine venvs at once (one compiling
# LMCache's wheel: ~15 CPU-min), the images that need no venv beside them, each pair's images after its venv (the
# default's installs that wheel), then the compatibility matrix's PyPI metadata. Each holds its lock while it runs; a
# failed one leaves no result and the tests needing it fail naming its log (~/.cache/kvoffload/<chain>-background.log,
# which has each step's wall and CPU seconds). Warm, each is a cache check.
KVO_CACHE ?= $(HOME)/.cache/kvoffload
BACKGROUND := nice -n 19 ionice -c 3
background-builds: venv operator-wheels serving-wheels router-wheels system-deps
	@mkdir -p $(KVO_CACHE)
	@(flock $(KVO_CACHE)/engine-background.lock env KVO_BACKGROUND=1 PY=$(PY) $(BACKGROUND) \
	  $(BIN)/python -m kvtest.background engine >$(KVO_CACHE)/engine-background.log 2>&1 &)
	@($(BACKGROUND) tests/autoscaling/build-keda.sh >$(KVO_CACHE)/keda-background.log 2>&1 &)
	@($(BACKGROUND) tests/gitops/flux/build.sh >$(KVO_CACHE)/flux-background.log 2>&1 &)

# `make check` first (fails fast, before any build), then the unit tests that needed a built tool (helm;
# KVO_UNIT_RAN: tests/conftest.py), the engine fidelity tests and everything on the real control plane and
# the real node (started from the cached builds, stopped after), KEDA's autoscaling tests included; the tests
# needing a background build last (KVO_WAIT_BUILDS). --durations: where a run's time went.
test: check background-builds cluster-build node-build router
	tests/gitops/build.sh --without-flux >/dev/null
	KVO_UNIT_RAN=1 KVO_REQUIRE_CLUSTER=1 KVO_REQUIRE_REAL_NODE=1 KVO_REQUIRE_ENGINE=1 KVO_REQUIRE_KEDA=1 KVO_WAIT_BUILDS=1 \
	  $(BIN)/python -m pytest tests -q --durations=40

demo: venv system-deps operator-wheels cluster-build node-build
	tests/cluster/demo.sh

demo-down: venv
	-tests/cluster/demo.sh down

bench: venv cluster-build
	$(BIN)/python benchmarks/exporter_bench.py

clean: demo-down
	rm -rf $(VENV) .cluster .pytest_cache
