# baton — `make help` lists the targets.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
# torch's CPU build lies on disk on the development machines; pip finds it there.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.DEFAULT_GOAL := help
.PHONY: help setup kernels redis nixl run test proto schema lint bench bench-peer gpu-check helm-lint image image-check clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@command -v python3 >/dev/null || { echo "python3 (3.11+) is required"; exit 1; }
	[ -x $(PY) ] || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(FIND_LINKS) torch==2.13.0
	$(PIP) install -q $(FIND_LINKS) -e '.[test,dev]'
	@touch $(STAMP)

# Every build this CPU runs (an AVX-512 host's AVX2 one too: the tests run each); a compiler
# error fails here, with the compiler's message. BATON_CPU_KERNELS=0 skips them.
kernels: $(STAMP) # baton's CPU kernels, built for this machine (cached; a C++ compiler when missing)
	@command -v g++ >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq g++ >/dev/null; }
	@$(PY) -c "from baton.kernels import cpu; cpu.enabled() and cpu.build(builds=cpu.builds_for_this_cpu())"

redis: # the redis-server binary, from the system's package manager when missing
	@command -v redis-server >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq redis-server >/dev/null; }

setup: $(STAMP) redis kernels ## create the virtualenv, install packages and redis-server, build the CPU kernels

# NIXL, the optional second KV data plane (--kv-transport-kind nixl): requirements-nixl.txt.
NIXL_STAMP := $(VENV)/.nixl
nixl: $(NIXL_STAMP) ## add NIXL (UCX) to the virtualenv, for pods that ship KV over it (~220 MB)
$(NIXL_STAMP): $(STAMP) requirements-nixl.txt
	$(PIP) install -q --no-deps -r requirements-nixl.txt
	@touch $@

run: setup ## run the whole service locally (gateway, prefill chain, decode) and stream a generation
	$(PY) -m baton.cli up --demo

test: setup nixl ## run the test suite (NIXL's tests too: it is installed for them)
	$(PY) -m pytest -q

proto: $(STAMP) ## regenerate services/baton/api from proto/
	$(PY) -m baton.api.generate

schema: $(STAMP) ## regenerate the CRD, values.schema.json and values.yaml's defaults from baton.config
	$(PY) -m baton_operator.schema

lint: $(STAMP) ## ruff over the code
	$(VENV)/bin/ruff check services operator tests bench

bench: setup ## run the benchmarks; reports and plots land in docs/benchmarks/
	$(PY) bench/engine.py
	$(PY) bench/runahead.py
	$(PY) bench/pyramid_quality.py
	$(PY) bench/sarathi.py
	$(PY) bench/serve.py
	$(PY) bench/kv_transfer.py
	$(PY) bench/reliability.py
	$(PY) bench/served_cores.py

bench-peer: setup ## baton against vLLM on this machine (vLLM in its own .venv-peer); writes docs/benchmarks/peer.md
	@[ -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq libtcmalloc-minimal4 >/dev/null; }
	$(PY) bench/peer/run.py

gpu-check: setup ## on a CUDA machine: the GPU tests, then the GPU reports (*-gpu*.md); logs in gpu-logs/
	PY=$(PY) bash bench/gpu_check.sh

helm-lint: $(STAMP) ## lint and render the Helm chart with the real Helm library
	$(PY) -m pytest -q tests/helm

# The image's settings; empty keeps the Dockerfile's defaults (python:3.11-slim-bookworm, torch
# from the PyTorch CPU index). TORCH_WHEELS=DIR takes torch from a wheel directory (buildah only);
# NIXL=1 adds NIXL (requirements-nixl.txt) for spec.kvTransport nixl.
IMAGE ?= baton:0.1.0
BASE_IMAGE ?=
TORCH_INDEX_URL ?=
TORCH_WHEELS ?=
NIXL ?=

image: ## build the image: docker build when a daemon answers, else buildah (IMAGE, BASE_IMAGE, TORCH_*, NIXL)
	IMAGE=$(IMAGE) BASE_IMAGE=$(BASE_IMAGE) TORCH_INDEX_URL=$(TORCH_INDEX_URL) \
	TORCH_WHEELS=$(TORCH_WHEELS) NIXL=$(NIXL) scripts/image.sh build

image-check: ## build the image here with buildah and run baton, the operator and `baton up` in it (slow)
	BASE_IMAGE=$(BASE_IMAGE) TORCH_INDEX_URL=$(TORCH_INDEX_URL) TORCH_WHEELS=$(TORCH_WHEELS) \
	scripts/image.sh check

clean: ## remove the virtualenv and caches
	rm -rf $(VENV) .venv-peer .pytest_cache .ruff_cache
