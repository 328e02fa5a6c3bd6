#!/usr/bin/env bash
# Build kube-router's binary from the Go module proxy into ~/.cache/ddp-operator/kube-router-<version>/bin.
# The e2e tier runs only its network-policy controller (iptables + ipset; no routing, no service proxy)
# to prove that a DDPJob's NetworkPolicy is enforced (docs/security.md). Test-only: never in the chart
# or a product image.
#
# Idempotent: a binary whose stamp matches the pinned version (hack/k8s-versions.env) is not rebuilt.
# Static (CGO off), like upstream's release builds. The module has no replace directives, so
# `go install <pkg>@<version>` builds it with exactly the dependency versions its go.mod pins.
# It programs the kernel through the `iptables` and `ipset` commands, so Debian's packages of both are
# installed when missing (--no-apt: fail instead).
#
# Usage: hack/build-kube-router.sh [--print-bin-dir] [--no-apt]
set -euo pipefail

# shellcheck source=lib/go-build.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/go-build.sh"
DDP_LOG_TAG=build-kube-router
ddp_load_versions 'KUBE_ROUTER'
PREFIX="${DDP_CACHE_ROOT}/kube-router-${KUBE_ROUTER_VERSION}"
BIN_DIR="${PREFIX}/bin"
BINARY="${BIN_DIR}/kube-router"
MODULE=github.com/cloudnativelabs/kube-router/v2

use_apt=1
for arg in "$@"; do
  case "${arg}" in
    --print-bin-dir) echo "${BIN_DIR}"; exit 0 ;;
    --no-apt) use_apt=0 ;;
    *) echo "usage: $0 [--print-bin-dir] [--no-apt]" >&2; exit 2 ;;
  esac
done

# Root's tools live in sbin, which a user's PATH may lack.
have() { command -v "$1" >/dev/null 2>&1 || [[ -x "/usr/sbin/$1" || -x "/sbin/$1" ]]; }
missing=()
have ipset || missing+=(ipset)
have iptables || missing+=(iptables)
if ((${#missing[@]} > 0)); then
  ((use_apt)) || die "missing system packages: ${missing[*]} (install them, or drop --no-apt)"
  sudo=""
  if [[ "$(id -u)" -ne 0 ]]; then
    command -v sudo >/dev/null 2>&1 || die "need root (or sudo) to install ${missing[*]}"
    sudo=sudo
  fi
  log "installing system packages: ${missing[*]}"
  ${sudo} apt-get update -qq
  DEBIAN_FRONTEND=noninteractive ${sudo} apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

ddp_go_env 1.21

if [[ -x "${BINARY}" && -f "${BIN_DIR}/.version" && "$(cat "${BIN_DIR}/.version")" == "${KUBE_ROUTER_VERSION}" ]]; then
  log "kube-router ${KUBE_ROUTER_VERSION}: up to date (${BINARY})"
  exit 0
fi

mkdir -p "${BIN_DIR}"
LOG_FILE="${PREFIX}/go.log"
: >"${LOG_FILE}"
t0=${SECONDS}
log "kube-router ${KUBE_ROUTER_VERSION}: building with $(go env GOVERSION) (downloads ~100 modules into $(go env GOMODCACHE) when cold)"
# The version stamp is what `kube-router --version` prints; upstream's Makefile sets the same variable.
ld="-s -w -X ${MODULE}/pkg/version.Version=${KUBE_ROUTER_VERSION}"
printf '$ go install -ldflags "%s" %s\n' "${ld}" "${MODULE}/cmd/kube-router@${KUBE_ROUTER_VERSION}" >>"${LOG_FILE}"
if ! GOBIN="${BIN_DIR}" go install -ldflags "${ld}" "${MODULE}/cmd/kube-router@${KUBE_ROUTER_VERSION}" >>"${LOG_FILE}" 2>&1; then
  tail -n 40 "${LOG_FILE}" >&2
  if grep -qiE 'unknown revision|invalid version|no matching versions|404 Not Found|410 Gone' "${LOG_FILE}"; then
    die "the Go module proxy ($(go env GOPROXY)) does not serve a module needed here (see ${LOG_FILE})"
  fi
  die "go install failed (full output: ${LOG_FILE})"
fi
echo "${KUBE_ROUTER_VERSION}" >"${BIN_DIR}/.version"
log "kube-router ${KUBE_ROUTER_VERSION}: done in $((SECONDS - t0)) s: ${BINARY}"
