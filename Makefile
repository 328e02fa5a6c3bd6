# Every target installs what it needs itself; expensive things are cached outside the repo.
CACHE     ?= $(HOME)/.cache/ddp-operator
VENV      ?= $(CACHE)/venv
PY        := $(VENV)/bin/python
STAMP     := $(VENV)/.installed-$(shell sha256sum pyproject.toml | cut -c1-16)
PYTEST    := $(PY) -m pytest
export PATH := $(VENV)/bin:$(PATH)

.PHONY: all system-deps venv demo test lint typecheck test-unit test-trainer test-integration test-e2e k8s-binaries bench clean-venv

all: test

$(STAMP): pyproject.toml
	@echo ">>> creating the virtualenv in $(VENV) (torch is several GB on a cold machine)"
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --find-links $(CACHE)/wheels -e '.[trainer,operator,dev]'
	@rm -f $(VENV)/.installed-*; touch $@

system-deps:
	@hack/install-system-deps.sh

venv: system-deps $(STAMP)

## The README's main job: train the digits example with 2 ranks on this machine.
demo: venv
	$(VENV)/bin/ddpjob run examples/digits-cpu.yaml

## The README's test command: lint, types and every tier.
test: lint typecheck test-unit test-trainer test-integration test-e2e

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: venv
	$(VENV)/bin/mypy

test-unit: venv
	$(PYTEST) tests/unit -q

test-trainer: venv
	$(PYTEST) tests/trainer -q

k8s-binaries:
	hack/build-k8s.sh

test-integration: venv k8s-binaries
	$(PYTEST) tests/integration -q

test-e2e: venv
	$(PYTEST) tests/e2e -q

bench: venv
	$(PY) benchmarks/run_all.py

clean-venv:
	rm -rf $(VENV)
