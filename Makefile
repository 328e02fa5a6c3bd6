# Every target installs what it needs itself; expensive things are cached outside the repo.
CACHE     ?= $(HOME)/.cache/ddp-operator
VENV      ?= $(CACHE)/venv
PY        := $(VENV)/bin/python
# Two stamps: the dependencies (torch's GB) follow the pyproject files only; the editable installs of
# the product and the harness point at one checkout, so a fresh clone elsewhere redoes only those (8 s,
# not a minute of pip resolving what is already installed). The hashes in the names are the keys: the
# files are no prerequisites, since a fresh clone's are always newer than any stamp.
DEPS_STAMP := $(VENV)/.deps-$(shell cat pyproject.toml harness/pyproject.toml | sha256sum | cut -c1-16)
STAMP     := $(VENV)/.installed-$(shell (cat pyproject.toml harness/pyproject.toml | sha256sum; echo '$(CURDIR)') | sha256sum | cut -c1-16)
PYTEST    := $(PY) -m pytest
export PATH := $(VENV)/bin:$(PATH)

.PHONY: all system-deps venv venv-lowest demo test lint typecheck test-unit test-trainer test-trainer-lowest test-integration test-integration-a test-integration-b test-e2e test-e2e-node test-e2e-kind k8s-binaries kueue-binary node-binaries kube-router images kind kind-up kind-demo kind-down chart-crds bench clean-venv

all: test

$(DEPS_STAMP):
	@echo ">>> creating the virtualenv in $(VENV) (torch is several GB on a cold machine)"
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# torch is downloaded once into a wheel cache: the venv installs from it, and the trainer image
	@# build (hack/build-images.sh) reuses it instead of fetching several GB again.
	$(PY) -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print("\n".join(p["optional-dependencies"]["trainer"]))' > $(CACHE)/trainer-requirements.txt
	$(PY) -m pip download -q -d $(CACHE)/wheels -r $(CACHE)/trainer-requirements.txt
	$(PY) -m pip install -q --find-links $(CACHE)/wheels -e '.[trainer,operator,dev]'
	@rm -f $(VENV)/.deps-* $(VENV)/.installed-*; touch $@

$(STAMP): $(DEPS_STAMP)
	$(PY) -m pip install -q --no-deps -e .
	@# The test harness (ddp-harness): a distribution of its own, so it stays out of the product's wheel.
	$(PY) -m pip install -q --no-deps -e ./harness
	@rm -f $(VENV)/.installed-*; touch $@

system-deps:
	@hack/install-system-deps.sh

venv: system-deps $(STAMP)

## The README's main job: train the digits example with 2 ranks on this machine.
demo: venv
	$(VENV)/bin/ddpjob run examples/digits-cpu.yaml

## The README's test command: lint, types and every tier, the builds beside the early tiers (hack/test-all.sh).
test:
	@hack/test-all.sh

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy's cache lives with the other caches: it checks each file's hash, so a fresh clone reuses it and
# still re-checks whatever changed (44 s cold, about 1 s warm).
typecheck: venv
	MYPY_CACHE_DIR=$(CACHE)/mypy $(VENV)/bin/mypy

# The slowest tests of each tier are printed, so a run shows where its time went.
DURATIONS ?= --durations=15

test-unit: venv
	$(PYTEST) tests/unit -q

test-trainer: venv
	$(PYTEST) tests/trainer -q $(DURATIONS)

## The user's torch: the trainer runs on every torch from TORCH_LOWEST on (pyproject.toml). A second,
## cached virtualenv holds the lowest, and the trainer tier's recovery tests run on it against this
## checkout (PYTHONPATH: nothing of the project is installed there). docs/testing.md has its cost.
TORCH_LOWEST   ?= 2.8.0
VENV_LOWEST    := $(CACHE)/venv-torch$(TORCH_LOWEST)
LOWEST_STAMP   := $(VENV_LOWEST)/.deps-$(shell cat pyproject.toml | sha256sum | cut -c1-16)
RECOVERY_TESTS  = tests/trainer/test_inplace_restarts.py tests/trainer/test_elastic.py tests/trainer/test_short_round.py tests/trainer/test_rendezvous.py

$(LOWEST_STAMP): $(DEPS_STAMP)
	@echo ">>> the virtualenv with the lowest supported torch ($(TORCH_LOWEST)) in $(VENV_LOWEST)"
	@test -x $(VENV_LOWEST)/bin/python || python3 -m venv $(VENV_LOWEST)
	$(VENV_LOWEST)/bin/python -m pip install -q --upgrade pip
	$(PY) -c 'import tomllib; e = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]; print("\n".join(r for k in ("trainer", "operator", "dev") for r in e[k] if not r.startswith("torch")))' > $(CACHE)/lowest-requirements.txt
	echo "torch==$(TORCH_LOWEST)" >> $(CACHE)/lowest-requirements.txt
	$(VENV_LOWEST)/bin/python -m pip download -q -d $(CACHE)/wheels "torch==$(TORCH_LOWEST)"
	$(VENV_LOWEST)/bin/python -m pip install -q --find-links $(CACHE)/wheels -r $(CACHE)/lowest-requirements.txt
	@rm -f $(VENV_LOWEST)/.deps-*; touch $@

venv-lowest: $(LOWEST_STAMP)

# Stock torchrun's own restarts (no code of ours in them) run on the newest torch only.
test-trainer-lowest: venv $(LOWEST_STAMP)
	PYTHONPATH=$(CURDIR)/trainer_image:$(CURDIR)/operator:$(CURDIR)/harness \
	  $(VENV_LOWEST)/bin/python -m pytest $(RECOVERY_TESTS) -q $(DURATIONS) -k "not stock_torchrun"

k8s-binaries:
	hack/build-k8s.sh

## Kueue's manager, CRDs and webhook configurations (docs/scheduling.md), for the integration tier.
kueue-binary:
	hack/build-kueue.sh

test-integration: venv k8s-binaries kueue-binary
	$(PYTEST) tests/integration -q $(DURATIONS)

## `make test` runs the integration tier in two parts, one per lane, to even the lanes out
## (hack/test-all.sh): lane A the Kueue, gang-scheduling and chart modules after the trainer tier, lane B
## the rest (the kind suite follows it, so lane B sets the total: the chart's ~130 s moved to even them).
INTEGRATION_A = tests/integration/test_kueue.py tests/integration/test_gang_api.py tests/integration/test_chart.py tests/integration/test_chart_alerts.py
test-integration-a: venv k8s-binaries kueue-binary
	$(PYTEST) $(INTEGRATION_A) -q $(DURATIONS)

test-integration-b: venv k8s-binaries kueue-binary
	$(PYTEST) tests/integration -q $(DURATIONS) $(addprefix --ignore=,$(INTEGRATION_A))

## Both images, on a local debootstrap base (no registry needed); tagged by version.
images: venv
	hack/build-images.sh

## The chart's crds/ is generated from crds/; the integration tier checks that they agree.
chart-crds:
	hack/gen-chart-crds.sh

## kubelet, kube-proxy, CoreDNS, crictl, the pause image, CNI plugins and containerd for the real node.
node-binaries:
	hack/build-node-binaries.sh

## The e2e tier's NetworkPolicy enforcer: kube-router's firewall alone (test-only; docs/security.md).
kube-router:
	hack/build-kube-router.sh

## kind, kubeadm and a kind node image built from our own parts (no registry): docs/kind.md.
kind: k8s-binaries node-binaries images
	hack/build-kind.sh

test-e2e: venv k8s-binaries node-binaries kube-router images kind
	$(PYTEST) tests/e2e -q $(DURATIONS)

## The e2e tier in two halves that `make test` runs side by side: Docker and the real node; kind.
E2E_KIND  = tests/e2e/test_kind.py
test-e2e-node: venv k8s-binaries node-binaries kube-router images
	$(PYTEST) tests/e2e -q $(DURATIONS) --ignore=$(E2E_KIND) -m "not kind_suite"

test-e2e-kind: venv k8s-binaries node-binaries kube-router images kind
	$(PYTEST) $(E2E_KIND) -q $(DURATIONS)

## The README's kind path: a cluster from our node image, both images loaded, the chart installed.
KIND_CLUSTER ?= ddp
KIND_BIN      = $(shell hack/build-kind.sh --print-kind)
K8S_BIN       = $(shell hack/build-k8s.sh --print-bin-dir)
VERSION       = $(shell sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml | head -n1)
kind-up: kind
	$(KIND_BIN) get clusters 2>/dev/null | grep -qx '$(KIND_CLUSTER)' || \
	  $(KIND_BIN) create cluster --name $(KIND_CLUSTER) --image "$$(hack/build-kind.sh --print-node-image)" \
	    --config hack/kind/cluster.yaml --wait 180s
	@# one CoreDNS replica frees the CPU request two 500m ranks need on a 2-core machine
	$(K8S_BIN)/kubectl --context kind-$(KIND_CLUSTER) scale deployment coredns -n kube-system --replicas=1
	$(KIND_BIN) load docker-image ddp-operator:$(VERSION) ddp-trainer:$(VERSION) --name $(KIND_CLUSTER)
	$(K8S_BIN)/helm upgrade --install ddp charts/ddp-operator --namespace ddp-system --create-namespace --wait \
	  --kube-context kind-$(KIND_CLUSTER)

## Train the digits example on the kind cluster and wait for it to finish.
kind-demo: kind-up
	$(K8S_BIN)/kubectl --context kind-$(KIND_CLUSTER) apply -f examples/digits-cpu.yaml
	$(K8S_BIN)/kubectl --context kind-$(KIND_CLUSTER) wait ddpjob/digits --for=jsonpath='{.status.phase}'=Succeeded --timeout=15m
	$(K8S_BIN)/kubectl --context kind-$(KIND_CLUSTER) get ddpjob digits

kind-down:
	$(KIND_BIN) delete cluster --name $(KIND_CLUSTER)

bench: venv
	$(PY) benchmarks/run_all.py

clean-venv:
	rm -rf $(VENV)
