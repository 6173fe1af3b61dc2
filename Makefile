# The single source of truth for building, testing and benchmarking hindsight.
# `make help` lists the targets.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
# The virtualenv lives outside the checkout so that fresh clones on the same
# machine (CI) reuse the large torch install; it is rebuilt when
# requirements-dev.txt changes (its hash names the directory).
REQ_HASH := $(shell sha256sum requirements-dev.txt | cut -c1-12)
VENV ?= $(HOME)/.cache/hindsight/venv-$(REQ_HASH)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PIP_CACHE_DIR ?= $(HOME)/.cache/hindsight/pip
# The Rust build lives there too, for the same reason: a fresh clone compiles
# only the workspace's own crates, not its hundreds of dependencies again.
export CARGO_TARGET_DIR ?= $(HOME)/.cache/hindsight/target
PYTEST_ARGS ?=

.PHONY: help
help: ## Show this help
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

# The first build downloads torch (the default index serves the CUDA build,
# about 6 GB installed: the CPU-only index is not reachable from every
# machine) and compiles the engine: minutes, so both show their progress.
$(STAMP):
	@echo "== first build: a virtualenv in $(VENV) (torch, lightning, transformers, ...; several GB, minutes)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --progress-bar off -r requirements-dev.txt
	touch $(STAMP)

.PHONY: venv
venv: $(STAMP) ## Create the Python environment (torch CPU, maturin, pytest)

.PHONY: develop
develop: $(STAMP) ## Build the extension into the environment (debug-info build)
	@echo "== building the engine (the first build compiles every crate: several minutes)"
	VIRTUAL_ENV=$(VENV) PATH=$(VENV)/bin:$$PATH $(VENV)/bin/maturin develop

.PHONY: develop-release
develop-release: $(STAMP)
	VIRTUAL_ENV=$(VENV) PATH=$(VENV)/bin:$$PATH $(VENV)/bin/maturin develop --quiet --release

# Keras 3 (tests/test_keras.py) in a file of its own: a change to it
# installs it into the existing virtualenv instead of building a new one.
KERAS_STAMP := $(VENV)/.keras-$(shell sha256sum requirements-keras.txt | cut -c1-12)
$(KERAS_STAMP): $(STAMP) requirements-keras.txt
	$(PY) -m pip install --quiet --progress-bar off -r requirements-keras.txt
	touch $(KERAS_STAMP)

.PHONY: keras
keras: $(KERAS_STAMP) ## Install Keras 3 (torch backend) into the environment for the Keras callback's tests

PY_SOURCES := python tests benches examples

.PHONY: lint
lint: develop keras ## Rust (fmt, clippy -D warnings) and Python (ruff check + format, mypy, stubtest of the .pyi)
	cargo fmt --all -- --check
	PYO3_PYTHON=$(PY) cargo clippy --workspace --all-targets --features hindsight-cli/s3 -- -D warnings
	$(PY) -m ruff check $(PY_SOURCES)
	$(PY) -m ruff format --check $(PY_SOURCES)
	$(PY) -m mypy
	cd /tmp && $(PY) -m mypy.stubtest hindsight._native

.PHONY: test-rust
test-rust: venv azurite xrootd ## Rust unit, property and integration tests; storage conformance also against loopback S3 (moto), Azure (Azurite) and XRootD servers
	cargo test --workspace --exclude hindsight-py
	$(PY) tests/s3util.py -- $(PY) tests/azureutil.py -- $(PY) tests/xrootdutil.py -- cargo test -p hindsight-core --features s3 --test conformance

# Azurite, Microsoft's Azure Storage emulator (npm), for the Azure tests; its
# version is pinned and it installs under the cache, like the virtualenv.
# Node.js comes from Debian where missing.
AZURITE_VERSION := 3.37.0
AZURITE_DIR := $(HOME)/.cache/hindsight/azurite
export HINDSIGHT_AZURITE_DIR := $(AZURITE_DIR)

.PHONY: azurite
azurite: ## Install Azurite (npm) and Node.js (Debian) for the Azure Blob Storage tests
	@if ! command -v npm >/dev/null; then \
		echo "installing nodejs npm"; \
		export DEBIAN_FRONTEND=noninteractive; \
		$(SUDO) apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null \
		|| { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null; }; \
	fi
	@if ! test -x $(AZURITE_DIR)/node_modules/.bin/azurite-blob || ! grep -q '"version": "$(AZURITE_VERSION)"' $(AZURITE_DIR)/node_modules/azurite/package.json; then \
		echo "installing azurite $(AZURITE_VERSION) in $(AZURITE_DIR)"; \
		mkdir -p $(AZURITE_DIR) && npm install --prefix $(AZURITE_DIR) --no-audit --no-fund --silent azurite@$(AZURITE_VERSION); \
	fi

# Debian's XRootD server and client tools, for the root:// store tests
# (tests/xrootdutil.py starts a server on loopback; nothing under /etc is
# configured). Users of root:// stores need only the client, xrootd-client.
XROOTD_PACKAGES := xrootd-server xrootd-server-plugins xrootd-client

.PHONY: xrootd
xrootd: ## Install Debian's XRootD server and client for the root:// storage tests
	@if ! command -v xrootd >/dev/null || ! command -v xrdcp >/dev/null || ! command -v xrdsssadmin >/dev/null; then \
		echo "installing $(XROOTD_PACKAGES)"; \
		export DEBIAN_FRONTEND=noninteractive; \
		$(SUDO) apt-get install -y -qq --no-install-recommends $(XROOTD_PACKAGES) >/dev/null \
		|| { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends $(XROOTD_PACKAGES) >/dev/null; }; \
	fi

# Debian's slurm-wlm daemons and munge, for the tests that run jobs on a
# single-node cluster on loopback (tests/slurmutil.py starts it; nothing under
# /etc is configured). Installed only where missing; needs root or sudo.
SLURM_PACKAGES := slurmctld slurmd slurm-client munge
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: slurm
slurm: ## Install Debian's Slurm (slurmctld, slurmd, client) and munge for the cluster tests
	@if ! command -v sbatch >/dev/null || ! test -x /usr/sbin/slurmctld -a -x /usr/sbin/slurmd -a -x /usr/sbin/munged; then \
		echo "installing $(SLURM_PACKAGES)"; \
		export DEBIAN_FRONTEND=noninteractive; \
		$(SUDO) apt-get install -y -qq --no-install-recommends $(SLURM_PACKAGES) >/dev/null \
		|| { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends $(SLURM_PACKAGES) >/dev/null; }; \
	fi

# Two workers, a test file on one (docs/testing.md); then the tests that
# measure the machine, alone. Exit 5 is "no test selected" (PYTEST_ARGS
# naming a file without serial tests).
PYTEST_PARALLEL ?= -n 2 --dist loadgroup

.PHONY: test-python
test-python: develop keras slurm azurite xrootd ## pytest suite against real torch (and a real single-node Slurm cluster)
	cd tests && $(PY) -m pytest -q $(PYTEST_PARALLEL) -m "not serial and not matrix" $(PYTEST_ARGS)
	cd tests && { $(PY) -m pytest -q -p no:xdist -m "serial and not matrix" $(PYTEST_ARGS) || test $$? = 5; }

.PHONY: test
test: venv lint test-rust test-python ## Everything CI runs: lint, Rust tests (+ S3 conformance), pytest

.PHONY: example
example: develop-release ## The main job: record a real training run, then question it by replay
	$(PY) examples/demo.py --dir .hindsight-demo

.PHONY: example-resume
example-resume: develop-release ## Checkpoint every epoch, interrupt, resume bit-exactly, verify
	$(PY) examples/train_checkpointed.py --store .hindsight/example-store

.PHONY: bench
bench: develop-release ## Benchmarks: checkpoints vs torch.save/load, record overhead, per-step cost and replay, zoo scripts at 5 s epochs, preemption (tables)
	$(PY) benches/bench_checkpoint.py
	$(PY) benches/bench_replay.py
	$(PY) benches/bench_zoo.py
	$(PY) benches/bench_preempt.py

.PHONY: bench-data
bench-data: develop-release ## Input service: hs.data.Loader vs DataLoader examples/s, a worker killed (bench-out/data_failover.png), journal replay
	$(PY) benches/bench_data.py

.PHONY: bench-dist
bench-dist: develop-release ## Multi-rank checkpoints (torchrun, gloo, 2 and 4 ranks, FSDP2): hindsight.dist vs DCP save/async_save/load, resharding 2->4
	cd benches && $(PY) bench_dist.py

# On a GPU machine with no network and no Rust (the lent device machines):
# `make wheel` here, install dist/*.whl there, then run there
# `make bench-gpu test-cuda PY=python3 NOBUILD=1`.
.PHONY: bench-gpu
bench-gpu: $(if $(NOBUILD),,develop-release) ## GPU checkpoint path (2 and 8 GiB) vs torch.save, DCP async_save, torch.load; GPU record overhead and replay (needs CUDA)
	$(PY) benches/bench_gpu.py

.PHONY: test-cuda
test-cuda: $(if $(NOBUILD),,develop) ## Only the tests marked cuda (skipped, not failed, without a GPU)
	cd tests && $(PY) -m pytest -q -m cuda $(PYTEST_ARGS)

.PHONY: wheel
wheel: $(STAMP) ## Release wheel in dist/ (abi3), e.g. to carry to a GPU machine
	VIRTUAL_ENV=$(VENV) PATH=$(VENV)/bin:$$PATH $(VENV)/bin/maturin build --quiet --release -o dist

.PHONY: chaos
chaos: develop-release ## Fault injection (kill -9, gc vs writers, corruption, manifest fuzzer, same-name saves, crafted files, concurrent resumes, rogue workers): table of trials and failures; the signal matrices (pytest -m matrix)
	$(PY) benches/chaos.py
	cd tests && $(PY) -m pytest -q $(PYTEST_PARALLEL) -m matrix $(PYTEST_ARGS)

.PHONY: zoo
zoo: develop-release ## Acceptance suite: public training scripts (tests/zoo/) resumed after signals and replayed with probes (table)
	$(PY) tests/zoo/driver.py --all

.PHONY: clean
clean:
	cargo clean
	rm -rf .hindsight bench-out
