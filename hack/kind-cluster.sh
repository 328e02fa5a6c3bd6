#!/usr/bin/env bash
# The kind cluster of the e2e suite (docs/kind.md): our node image, both images loaded, one CoreDNS.
#
#   hack/kind-cluster.sh up NAME KUBECONFIG [IMAGE...]   create it (replacing one left by an interrupted
#                                                        run) and load the images (default: both of ours)
#   hack/kind-cluster.sh down NAME              delete it (nothing to do when it does not exist)
#
# tests/e2e/test_kind.py runs `up` itself, or uses the cluster `make test` brought up beside the earlier
# tiers (DDP_E2E_KIND_KUBECONFIG): either way this script is the one place that says how.
# Environment: KIND_NODE_IMAGE (default: the image hack/build-kind.sh built).
set -euo pipefail
cd "$(dirname "$0")/.."

KIND=$(hack/build-kind.sh --print-kind)
K8S_BIN=$(hack/build-k8s.sh --print-bin-dir)
VERSION=$(sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml | head -n1)

log() { printf '[kind-cluster %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

case ${1:-} in
  up)
    [[ $# -ge 3 ]] || { echo "usage: $0 up NAME KUBECONFIG [IMAGE...]" >&2; exit 2; }
    name=$2 kubeconfig=$3
    shift 3
    images=("$@")
    [[ ${#images[@]} -gt 0 ]] || images=("ddp-operator:$VERSION" "ddp-trainer:$VERSION")
    node_image=${KIND_NODE_IMAGE:-$(hack/build-kind.sh --print-node-image)}
    "$KIND" delete cluster --name "$name" >/dev/null 2>&1 || true
    started=$SECONDS
    "$KIND" create cluster --name "$name" --image "$node_image" --config hack/kind/cluster.yaml \
      --kubeconfig "$kubeconfig" --wait 180s
    log "created $name in $((SECONDS - started)) s"
    started=$SECONDS
    "$KIND" load docker-image "${images[@]}" --name "$name"
    log "loaded ${images[*]} in $((SECONDS - started)) s"
    # One CoreDNS replica is plenty for one node, and its 100m CPU request is what two 500m ranks, the
    # operator and the control plane need to fit on a 2-core machine.
    "$K8S_BIN/kubectl" --kubeconfig "$kubeconfig" scale deployment coredns -n kube-system --replicas=1
    ;;
  down)
    [[ $# -eq 2 ]] || { echo "usage: $0 down NAME" >&2; exit 2; }
    "$KIND" delete cluster --name "$2" >/dev/null 2>&1 || true
    ;;
  *)
    echo "usage: $0 up NAME KUBECONFIG [IMAGE...] | down NAME" >&2
    exit 2
    ;;
esac
