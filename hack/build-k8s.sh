#!/usr/bin/env bash
# Build the local control plane's binaries from the Go module proxy (no container registry needed):
#   kube-apiserver, kube-controller-manager, kube-scheduler, kubectl  (k8s.io/kubernetes)
#   and, in the same go build, the node's kubelet, kube-proxy and kubeadm (the real node and kind use
#   them; hack/build-node-binaries.sh and hack/build-kind.sh then find them up to date)
#   etcd (go.etcd.io/etcd/server/v3), kwok (sigs.k8s.io/kwok), helm (helm.sh/helm/v3)
# into ~/.cache/ddp-operator/k8s-<kubernetes version>/bin. Idempotent: a binary whose stamp matches its
# pinned version is not rebuilt. Versions: hack/k8s-versions.env (overridable from the environment).
#
# Usage: hack/build-k8s.sh [--print-bin-dir]
set -euo pipefail

# shellcheck source=lib/go-build.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/go-build.sh"
DDP_LOG_TAG=build-k8s
ddp_load_versions 'KUBERNETES|ETCD|KWOK|HELM'

CACHE_ROOT="${DDP_CACHE_ROOT}"
PREFIX="${DDP_K8S_PREFIX:-${CACHE_ROOT}/k8s-${KUBERNETES_VERSION}}"
BIN_DIR="${PREFIX}/bin"
WORK_DIR="${PREFIX}/build"

if [[ "${1:-}" == "--print-bin-dir" ]]; then
  echo "${BIN_DIR}"
  exit 0
fi

ddp_go_env 1.25
GO_VERSION="$(go env GOVERSION)"
K8S_TAGS="selinux,notest,grpcnotrace"

mkdir -p "${BIN_DIR}" "${WORK_DIR}"
printf "\n=== %s\n" "$(date -u +%FT%TZ)" >>"${WORK_DIR}/go.log"

stamp_ok() { # name version -> 0 when bin/name exists and was built at that version
  [[ -x "${BIN_DIR}/$1" && -f "${BIN_DIR}/.$1.version" && "$(cat "${BIN_DIR}/.$1.version")" == "$2" ]]
}
write_stamp() { echo "$2" >"${BIN_DIR}/.$1.version"; }

# Runs a go command quietly (its output goes to build/go.log, shown on failure) and turns "module not
# served" errors into a message that names the module.
run_go() {
  local out rc=0 ticker started=${SECONDS}
  printf '$ %s\n' "$*" >>"${WORK_DIR}/go.log"
  # A heartbeat, so a 20-minute compile does not look hung.
  (while sleep 60 </dev/null >/dev/null 2>&1; do log "  ... still running \`$1 $2\` ($(((SECONDS - started) / 60)) min)"; done) &
  ticker=$!
  out="$("$@" 2>&1)" || rc=$?
  kill "${ticker}" 2>/dev/null || true
  wait "${ticker}" 2>/dev/null || true
  if ((rc != 0)); then
    printf '%s\n' "${out}" | tee -a "${WORK_DIR}/go.log" | tail -n 40 >&2
    if grep -qiE 'unknown revision|not found|invalid version|no matching versions|not available|403 Forbidden|410 Gone|404 Not Found' <<<"${out}"; then
      local module
      module="$(grep -oE '[[:alnum:]._/~-]+@v[0-9][[:alnum:].+_-]*' <<<"${out}" | head -n 1)"
      die "the Go module proxy ($(go env GOPROXY)) does not serve ${module:-a module needed here} (command: $*)"
    fi
    die "command failed: $*"
  fi
  printf '%s\n' "${out}" >>"${WORK_DIR}/go.log"
  local downloads
  downloads="$(grep -c '^go: downloading' <<<"${out}" || true)"
  if ((downloads > 0)); then log "  downloaded ${downloads} modules"; fi
  return 0
}

# A throwaway main module: dependencies' replace directives are ignored by Go, so builds that need them
# (k8s.io/kubernetes, etcd) happen in a module of our own.
new_module() { # dir name
  rm -rf "$1" && mkdir -p "$1"
  (cd "$1" && run_go go mod init "$2" && run_go go mod edit -go="$(go env GOVERSION | sed 's/^go//; s/^\([0-9]*\.[0-9]*\).*/\1.0/')")
}

# The node's binaries share most packages with the control plane's: compiled in one go build, a cold
# run compiles those packages once, and the real node's and kind's builds, which came after this one,
# start with them done.
k8s_binaries=(kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy kubeadm)

build_kubernetes() {
  local v="${KUBERNETES_VERSION}" missing=()
  for b in "${k8s_binaries[@]}"; do stamp_ok "${b}" "${v}" || missing+=("${b}"); done
  if ((${#missing[@]} == 0)); then log "kubernetes ${v}: up to date"; return; fi
  local t0=${SECONDS}
  log "kubernetes ${v}: building ${missing[*]} (the long one: 10-15 min on 2 cores when cold)"
  local mod_dir="${WORK_DIR}/kubernetes"
  new_module "${mod_dir}" ddp-operator.local/build-kubernetes
  cd "${mod_dir}"
  log "kubernetes ${v}: reading the release's go.mod"
  local info gomod
  info="$(go mod download -json "k8s.io/kubernetes@${v}" 2>&1)" ||
    die "the Go module proxy does not serve k8s.io/kubernetes@${v}: ${info}"
  gomod="$(sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p' <<<"${info}")"
  [[ -f "${gomod}" ]] || die "could not locate go.mod of k8s.io/kubernetes@${v} (got: ${gomod})"
  # Every staging module is required at v0.0.0; its release is v0.<minor>.<patch>.
  local staging_version="v0.${v#v1.}"
  local staging
  staging="$(awk '$2 == "v0.0.0" && $1 ~ /^k8s\.io\// {print $1}' "${gomod}" | sort -u)"
  [[ -n "${staging}" ]] || die "found no v0.0.0 staging requirements in ${gomod}"
  log "kubernetes ${v}: replacing $(wc -l <<<"${staging}") staging modules with ${staging_version}"
  local args=()
  for m in ${staging}; do args+=("-replace=${m}=${m}@${staging_version}"); done
  run_go go mod edit "${args[@]}"
  local pkgs=()
  for b in "${missing[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/${b}"); done
  log "kubernetes ${v}: resolving dependencies (downloads a few hundred MB into $(go env GOMODCACHE) when cold)"
  run_go go get "${pkgs[@]/%/@${v}}"
  local minor="${v#v1.}"; minor="${minor%%.*}"
  local ld="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X ${p}.gitVersion=${v} -X ${p}.gitMajor=1 -X ${p}.gitMinor=${minor} -X ${p}.gitTreeState=clean"
    ld+=" -X ${p}.buildDate=1970-01-01T00:00:00Z"
  done
  log "kubernetes ${v}: compiling ${missing[*]} with ${GO_VERSION} (one go build, shared compilation)"
  run_go go build -tags "${K8S_TAGS}" -ldflags "${ld}" -o "${BIN_DIR}/" "${pkgs[@]}"
  for b in "${missing[@]}"; do write_stamp "${b}" "${v}"; done
  log "kubernetes ${v}: done in $((SECONDS - t0)) s: $("${BIN_DIR}/kube-apiserver" --version 2>/dev/null || echo '?')"
}

build_etcd() {
  local v="${ETCD_VERSION}"
  if stamp_ok etcd "${v}"; then log "etcd ${v}: up to date"; return; fi
  local t0=${SECONDS}
  log "etcd ${v}: building"
  local mod_dir="${WORK_DIR}/etcd"
  new_module "${mod_dir}" ddp-operator.local/build-etcd
  cd "${mod_dir}"
  run_go go get "go.etcd.io/etcd/server/v3@${v}"
  run_go go build -ldflags "-s -w" -o "${BIN_DIR}/etcd" go.etcd.io/etcd/server/v3
  write_stamp etcd "${v}"
  log "etcd ${v}: done in $((SECONDS - t0)) s: $("${BIN_DIR}/etcd" --version 2>/dev/null | head -1 || echo '?')"
}

build_kwok() {
  local v="${KWOK_VERSION}"
  if stamp_ok kwok "${v}"; then log "kwok ${v}: up to date"; return; fi
  local t0=${SECONDS}
  log "kwok ${v}: building"
  local mod_dir="${WORK_DIR}/kwok"
  new_module "${mod_dir}" ddp-operator.local/build-kwok
  cd "${mod_dir}"
  run_go go get "sigs.k8s.io/kwok/cmd/kwok@${v}"
  run_go go build -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${v#v}" -o "${BIN_DIR}/kwok" \
    sigs.k8s.io/kwok/cmd/kwok
  write_stamp kwok "${v}"
  log "kwok ${v}: done in $((SECONDS - t0)) s"
}

build_helm() {
  local v="${HELM_VERSION}"
  if stamp_ok helm "${v}"; then log "helm ${v}: up to date"; return; fi
  local t0=${SECONDS}
  log "helm ${v}: building"
  local mod_dir="${WORK_DIR}/helm"
  new_module "${mod_dir}" ddp-operator.local/build-helm
  cd "${mod_dir}"
  run_go go get "helm.sh/helm/v3/cmd/helm@${v}"
  local minor="${KUBERNETES_VERSION#v1.}"; minor="${minor%%.*}"
  # Without the chartutil values an offline `helm template` assumes Kubernetes 1.20.
  local ld="-s -w -X helm.sh/helm/v3/internal/version.version=${v}"
  ld+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
  ld+=" -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=${minor}"
  run_go go build -ldflags "${ld}" -o "${BIN_DIR}/helm" helm.sh/helm/v3/cmd/helm
  write_stamp helm "${v}"
  log "helm ${v}: done in $((SECONDS - t0)) s: $("${BIN_DIR}/helm" version --short 2>/dev/null || echo '?')"
}

start=${SECONDS}
log "building into ${BIN_DIR} with ${GO_VERSION} (GOMODCACHE=$(go env GOMODCACHE), GOCACHE=$(go env GOCACHE))"
build_kubernetes
build_etcd
build_kwok
build_helm
log "all binaries ready in ${BIN_DIR} ($((SECONDS - start)) s)"
