#!/usr/bin/env bash
# Build sigs.k8s.io/kube-network-policies, the NetworkPolicy enforcer that kind ships (nftables rules
# that send each pod's first packets to an nfqueue, judged in user space against the NetworkPolicies),
# from the Go module proxy into ~/.cache/ddp-operator/kube-network-policies-<version>/bin. The e2e
# tier runs it on the real node to prove that a DDPJob's NetworkPolicy is enforced (docs/security.md).
#
# Idempotent: a binary whose stamp matches the pinned version is not rebuilt. Static (CGO off): its
# netlink, nftables and nfqueue libraries are pure Go. Its module has no replace directives, so a
# throwaway module that requires it is enough.
#
# Usage: hack/build-kube-network-policies.sh [--print-bin-dir]
set -euo pipefail

# shellcheck source=lib/go-build.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/go-build.sh"
DDP_LOG_TAG=build-knp
KUBE_NETWORK_POLICIES_VERSION="${KUBE_NETWORK_POLICIES_VERSION:-v0.8.0}"
CACHE_ROOT="${DDP_CACHE_ROOT}"
PREFIX="${CACHE_ROOT}/kube-network-policies-${KUBE_NETWORK_POLICIES_VERSION}"
BIN_DIR="${PREFIX}/bin"
WORK_DIR="${PREFIX}/build"
BINARY="${BIN_DIR}/kube-network-policies"
# Where `main` lives in this release (v0.9 moved it to cmd/kube-network-policies/standard).
MAIN_PACKAGE="${KUBE_NETWORK_POLICIES_MAIN:-sigs.k8s.io/kube-network-policies/cmd}"

if [[ "${1:-}" == "--print-bin-dir" ]]; then
  echo "${BIN_DIR}"
  exit 0
fi
[[ $# -eq 0 ]] || { echo "usage: $0 [--print-bin-dir]" >&2; exit 2; }

ddp_go_env 1.23

if [[ -x "${BINARY}" && -f "${BIN_DIR}/.version" && "$(cat "${BIN_DIR}/.version")" == "${KUBE_NETWORK_POLICIES_VERSION}" ]]; then
  log "kube-network-policies ${KUBE_NETWORK_POLICIES_VERSION}: up to date (${BINARY})"
  exit 0
fi

mkdir -p "${BIN_DIR}" "${WORK_DIR}"
LOG_FILE="${WORK_DIR}/go.log"
run_go() {
  printf '$ %s\n' "$*" >>"${LOG_FILE}"
  if ! "$@" >>"${LOG_FILE}" 2>&1; then
    tail -n 40 "${LOG_FILE}" >&2
    if grep -qiE 'unknown revision|invalid version|no matching versions|404 Not Found|410 Gone' "${LOG_FILE}"; then
      die "the Go module proxy ($(go env GOPROXY)) does not serve a module needed here (command: $*)"
    fi
    die "command failed: $* (full output: ${LOG_FILE})"
  fi
}

t0=${SECONDS}
log "kube-network-policies ${KUBE_NETWORK_POLICIES_VERSION}: building with $(go env GOVERSION)"
mod_dir="${WORK_DIR}/module"
rm -rf "${mod_dir}" && mkdir -p "${mod_dir}"
cd "${mod_dir}"
run_go go mod init ddp-operator.local/build-kube-network-policies
run_go go mod edit -go="$(go env GOVERSION | sed 's/^go//; s/^\([0-9]*\.[0-9]*\).*/\1.0/')"
# `go get` of the main package (not the module root, which has none) records every module it imports.
run_go go get "${MAIN_PACKAGE}@${KUBE_NETWORK_POLICIES_VERSION}"
run_go go build -ldflags "-s -w" -o "${BINARY}" "${MAIN_PACKAGE}"
echo "${KUBE_NETWORK_POLICIES_VERSION}" >"${BIN_DIR}/.version"
log "kube-network-policies ${KUBE_NETWORK_POLICIES_VERSION}: done in $((SECONDS - t0)) s: ${BINARY}"
