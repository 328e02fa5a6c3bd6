# shellcheck shell=bash
# Sourced by the hack/build-*.sh scripts that build programs from the Go module proxy: the pinned
# versions (with environment overrides), their log lines, and one Go build environment.
#
#   source "$(dirname "${BASH_SOURCE[0]}")/lib/go-build.sh"
#   ddp_load_versions 'KUBERNETES|ETCD'   # hack/k8s-versions.env; KUBERNETES_VERSION=... in the env wins
#   DDP_LOG_TAG=build-k8s                 # the [tag] of log and die
#   ddp_go_env 1.25                       # die without a Go toolchain; static, reproducible builds

DDP_HACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DDP_CACHE_ROOT="${DDP_CACHE:-${HOME}/.cache/ddp-operator}"
DDP_LOG_TAG="${DDP_LOG_TAG:-hack}"

log() { printf '[%s %s] %s\n' "${DDP_LOG_TAG}" "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf '[%s] ERROR: %s\n' "${DDP_LOG_TAG}" "$*" >&2; exit 1; }

# Source the pinned versions; variables named <NAME>_VERSION for NAME in the pattern keep the value
# the environment gave them.
ddp_load_versions() {
  local saved line
  saved="$(env | grep -E "^(${1})_VERSION=" || true)"
  # shellcheck source=../k8s-versions.env
  source "${DDP_HACK_DIR}/k8s-versions.env"
  while IFS= read -r line; do
    if [[ -n "${line}" ]]; then export "${line?}"; fi
  done <<<"${saved}"
}

# Servers are static binaries, like upstream's release builds; -trimpath keeps paths out of them.
ddp_go_env() {
  command -v go >/dev/null 2>&1 \
    || die "no Go toolchain on PATH: install Go >= ${1} (e.g. /usr/local/go/bin) and retry"
  export CGO_ENABLED=0
  export GOFLAGS="-buildvcs=false -trimpath"
  export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
}
