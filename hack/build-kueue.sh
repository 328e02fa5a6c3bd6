#!/usr/bin/env bash
# Build Kueue's manager (sigs.k8s.io/kueue/cmd/kueue) from the Go module proxy, in a throwaway module,
# into ~/.cache/ddp-operator/kueue-<version>/bin/kueue, and copy the CRDs it needs from the module
# (config/components/crd/bases/*.yaml in the Go module cache) into ~/.cache/ddp-operator/kueue-<version>/crds,
# and its webhook configurations (config/components/webhook/manifests.yaml) into .../webhooks.yaml; the
# integration harness (tests/integration/kueue_harness.py) rewrites them to reach a local kueue process.
# Nothing of Kueue is committed to this repository: the CRDs come from the module, at build time.
# Idempotent: a binary whose stamp matches the pinned version is not rebuilt.
# Version: KUEUE_VERSION in hack/k8s-versions.env (overridable from the environment).
#
# Usage: hack/build-kueue.sh [--print-prefix]
set -euo pipefail

# shellcheck source=lib/go-build.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/go-build.sh"
DDP_LOG_TAG=build-kueue
ddp_load_versions 'KUEUE'

CACHE_ROOT="${DDP_CACHE_ROOT}"
PREFIX="${DDP_KUEUE_PREFIX:-${CACHE_ROOT}/kueue-${KUEUE_VERSION}}"
BIN_DIR="${PREFIX}/bin"
CRD_DIR="${PREFIX}/crds"
WORK_DIR="${PREFIX}/build"

if [[ "${1:-}" == "--print-prefix" ]]; then
  echo "${PREFIX}"
  exit 0
fi

ddp_go_env 1.25

v="${KUEUE_VERSION}"
ASSETS_STAMP="${PREFIX}/.assets.version"
binary_ok() { [[ -x "${BIN_DIR}/kueue" && -f "${BIN_DIR}/.kueue.version" && "$(cat "${BIN_DIR}/.kueue.version")" == "${v}" ]]; }
assets_ok() { [[ -f "${ASSETS_STAMP}" && "$(cat "${ASSETS_STAMP}")" == "${v}" ]]; }
if binary_ok && assets_ok; then
  log "kueue ${v}: up to date in ${PREFIX}"
  exit 0
fi

mkdir -p "${BIN_DIR}" "${WORK_DIR}"
GO_LOG="${WORK_DIR}/go.log"
printf "\n=== %s\n" "$(date -u +%FT%TZ)" >>"${GO_LOG}"

run_go() { # quiet; output to go.log, the tail shown on failure
  local out rc=0 ticker started=${SECONDS}
  printf '$ %s\n' "$*" >>"${GO_LOG}"
  (while sleep 60 </dev/null >/dev/null 2>&1; do log "  ... still running \`$1 $2\` ($(((SECONDS - started) / 60)) min)"; done) &
  ticker=$!
  out="$("$@" 2>&1)" || rc=$?
  kill "${ticker}" 2>/dev/null || true
  wait "${ticker}" 2>/dev/null || true
  printf '%s\n' "${out}" >>"${GO_LOG}"
  if ((rc != 0)); then
    printf '%s\n' "${out}" | tail -n 40 >&2
    if grep -qiE 'unknown revision|invalid version|no matching versions|403 Forbidden|410 Gone|404 Not Found' <<<"${out}"; then
      die "the Go module proxy ($(go env GOPROXY)) does not serve sigs.k8s.io/kueue@${v} or a dependency (command: $*)"
    fi
    die "command failed: $*"
  fi
}

t0=${SECONDS}
mod_dir="${WORK_DIR}/module"
if ! binary_ok || [[ ! -f "${mod_dir}/go.mod" ]]; then
  rm -rf "${mod_dir}" && mkdir -p "${mod_dir}"
  (cd "${mod_dir}" &&
    run_go go mod init ddp-operator.local/build-kueue &&
    run_go go mod edit -go="$(go env GOVERSION | sed 's/^go//; s/^\([0-9]*\.[0-9]*\).*/\1.0/')" &&
    run_go go get "sigs.k8s.io/kueue/cmd/kueue@${v}")
fi
cd "${mod_dir}"

# What the harness needs besides the binary, from the module's source tree in the module cache
# (read-only there): the CRDs, and the webhook configurations it rewrites to reach a local process.
mod_src="$(go list -m -f '{{.Dir}}' sigs.k8s.io/kueue)"
[[ -d "${mod_src}/config/components/crd/bases" ]] || die "no config/components/crd/bases in ${mod_src}"
[[ -f "${mod_src}/config/components/webhook/manifests.yaml" ]] || die "no config/components/webhook/manifests.yaml in ${mod_src}"
rm -rf "${CRD_DIR}" && mkdir -p "${CRD_DIR}"
cp "${mod_src}"/config/components/crd/bases/*.yaml "${CRD_DIR}/"
cp "${mod_src}/config/components/webhook/manifests.yaml" "${PREFIX}/webhooks.yaml"
chmod u+w "${CRD_DIR}"/*.yaml "${PREFIX}/webhooks.yaml"
echo "${v}" >"${ASSETS_STAMP}"
log "kueue ${v}: copied $(find "${CRD_DIR}" -name '*.yaml' | wc -l) CRDs and the webhook configurations into ${PREFIX}"

if ! binary_ok; then
  log "kueue ${v}: building with $(go env GOVERSION) (10+ min on 2 busy cores when cold)"
  ld="-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=${v} -X sigs.k8s.io/kueue/pkg/version.GitCommit=module-proxy"
  run_go go build -ldflags "${ld}" -o "${BIN_DIR}/kueue" sigs.k8s.io/kueue/cmd/kueue
  echo "${v}" >"${BIN_DIR}/.kueue.version"
fi
log "kueue ${v}: ready in ${PREFIX} ($((SECONDS - t0)) s)"
