#!/usr/bin/env bash
# Build the binaries of the local control plane's real node (`ddp-harness cluster up --real-node`):
#   kubelet, kube-proxy  (k8s.io/kubernetes, the same release and build flags as hack/build-k8s.sh)
#   coredns              (github.com/coredns/coredns, with only the plugins our Corefile uses)
#   crictl               (sigs.k8s.io/cri-tools: `down` removes every pod sandbox through CRI with it)
#   pause                (a tiny static program that sleeps until a signal: the pod sandbox)
# into ~/.cache/ddp-operator/k8s-<kubernetes version>/bin, next to the control plane's binaries, and
# install the Debian packages it runs with when they are missing: containerd (CRI v1; the kubelet falls
# back to its own cgroupDriver because containerd 1.x lacks the RuntimeConfig call), runc,
# containernetworking-plugins (bridge, host-local, portmap, loopback) and conntrack (kube-proxy).
#
# Idempotent: a binary whose stamp matches its pinned version is not rebuilt. The kubelet and kube-proxy
# share Go's build cache with hack/build-k8s.sh (same module versions), so after the control plane has
# been built they compile only what they add. Versions: hack/k8s-versions.env, COREDNS_VERSION below.
#
# Usage: hack/build-node-binaries.sh [--print-bin-dir] [--no-apt] [--only=packages,pause,coredns,crictl,kubernetes]
set -euo pipefail

HACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
_saved_env="$(env | grep -E '^(KUBERNETES|COREDNS|CRICTL)_VERSION=' || true)"
# shellcheck source=k8s-versions.env
source "${HACK_DIR}/k8s-versions.env"
COREDNS_VERSION="${COREDNS_VERSION:-v1.14.7}"
CRICTL_VERSION="${CRICTL_VERSION:-v1.37.0}"
while IFS= read -r line; do [[ -n "${line}" ]] && export "${line?}"; done <<<"${_saved_env}"

CACHE_ROOT="${DDP_CACHE:-${HOME}/.cache/ddp-operator}"
PREFIX="${DDP_K8S_PREFIX:-${CACHE_ROOT}/k8s-${KUBERNETES_VERSION}}"
BIN_DIR="${PREFIX}/bin"
WORK_DIR="${PREFIX}/build"

use_apt=1
only="packages,pause,coredns,crictl,kubernetes"
for arg in "$@"; do
  case "${arg}" in
    --print-bin-dir) echo "${BIN_DIR}"; exit 0 ;;
    --no-apt) use_apt=0 ;;
    --only=*) only="${arg#--only=}" ;;
    *) echo "usage: $0 [--print-bin-dir] [--no-apt] [--only=packages,pause,coredns,crictl,kubernetes]" >&2; exit 2 ;;
  esac
done

log() { printf '[build-node %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf '[build-node] ERROR: %s\n' "$*" >&2; exit 1; }

export CGO_ENABLED=0
export GOFLAGS="-buildvcs=false -trimpath"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
K8S_TAGS="selinux,notest,grpcnotrace"

mkdir -p "${BIN_DIR}" "${WORK_DIR}"

stamp_ok() { [[ -x "${BIN_DIR}/$1" && -f "${BIN_DIR}/.$1.version" && "$(cat "${BIN_DIR}/.$1.version")" == "$2" ]]; }
write_stamp() { echo "$2" >"${BIN_DIR}/.$1.version"; }

run_go() {
  local out
  if ! out="$("$@" 2>&1)"; then
    printf '%s\n' "${out}" >&2
    die "command failed: $* (a module the Go proxy does not serve is named above)"
  fi
  return 0
}

new_module() { # dir name
  command -v go >/dev/null 2>&1 || die "no Go toolchain on PATH: install Go >= 1.25 (e.g. /usr/local/go/bin) and retry"
  rm -rf "$1" && mkdir -p "$1"
  (cd "$1" && run_go go mod init "$2" && run_go go mod edit -go="$(go env GOVERSION | sed 's/^go//; s/^\([0-9]*\.[0-9]*\).*/\1.0/')")
}

# Root's tools live in sbin, which a user's PATH may lack.
have() { command -v "$1" >/dev/null 2>&1 || [[ -x "/usr/sbin/$1" || -x "/sbin/$1" ]]; }

install_debian_packages() {
  local missing=()
  have containerd || missing+=(containerd)
  have runc || missing+=(runc)
  [[ -x /usr/lib/cni/bridge || -x /opt/cni/bin/bridge ]] || missing+=(containernetworking-plugins)
  have conntrack || missing+=(conntrack)
  have iptables || missing+=(iptables)
  ((${#missing[@]} == 0)) && { log "system packages: present"; return; }
  ((use_apt)) || die "missing system packages: ${missing[*]} (install them, or drop --no-apt)"
  local sudo=""
  if [[ "$(id -u)" -ne 0 ]]; then
    command -v sudo >/dev/null 2>&1 || die "need root (or sudo) to install ${missing[*]}"
    sudo=sudo
  fi
  log "installing system packages: ${missing[*]}"
  ${sudo} apt-get update -qq
  DEBIAN_FRONTEND=noninteractive ${sudo} apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

build_node_kubernetes() {
  local v="${KUBERNETES_VERSION}" missing=()
  for b in kubelet kube-proxy; do stamp_ok "${b}" "${v}" || missing+=("${b}"); done
  if ((${#missing[@]} == 0)); then log "kubelet/kube-proxy ${v}: up to date"; return; fi
  log "kubernetes ${v}: building ${missing[*]}"
  # A module of our own (replace directives of a dependency are ignored by Go). The same versions as
  # hack/build-k8s.sh resolves, so Go's build cache already holds most packages.
  local mod_dir="${WORK_DIR}/kubernetes-node"
  new_module "${mod_dir}" ddp-operator.local/build-kubernetes-node
  cd "${mod_dir}"
  local info gomod
  info="$(go mod download -json "k8s.io/kubernetes@${v}" 2>&1)" ||
    die "the Go module proxy does not serve k8s.io/kubernetes@${v}: ${info}"
  gomod="$(sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p' <<<"${info}")"
  [[ -f "${gomod}" ]] || die "could not locate go.mod of k8s.io/kubernetes@${v} (got: ${gomod})"
  local staging_version="v0.${v#v1.}" staging args=()
  staging="$(awk '$2 == "v0.0.0" && $1 ~ /^k8s\.io\// {print $1}' "${gomod}" | sort -u)"
  [[ -n "${staging}" ]] || die "found no v0.0.0 staging requirements in ${gomod}"
  for m in ${staging}; do args+=("-replace=${m}=${m}@${staging_version}"); done
  run_go go mod edit "${args[@]}"
  local pkgs=()
  for b in "${missing[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/${b}"); done
  run_go go get "${pkgs[@]/%/@${v}}"
  local minor="${v#v1.}"; minor="${minor%%.*}"
  local ld="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X ${p}.gitVersion=${v} -X ${p}.gitMajor=1 -X ${p}.gitMinor=${minor} -X ${p}.gitTreeState=clean"
    ld+=" -X ${p}.buildDate=1970-01-01T00:00:00Z"
  done
  run_go go build -tags "${K8S_TAGS}" -ldflags "${ld}" -o "${BIN_DIR}/" "${pkgs[@]}"
  for b in "${missing[@]}"; do write_stamp "${b}" "${v}"; done
  log "kubernetes ${v}: done: $("${BIN_DIR}/kubelet" --version 2>/dev/null || echo '?')"
}

# CoreDNS with only the plugins the node's Corefile uses (CoreDNS's documented way to choose plugins
# at compile time: our own main sets dnsserver.Directives). The full build pulls every cloud SDK its
# other plugins need (~1400 packages); this one compiles ~800.
build_coredns() {
  local v="${COREDNS_VERSION}" stamp="${COREDNS_VERSION}-minimal"
  if stamp_ok coredns "${stamp}"; then log "coredns ${v}: up to date"; return; fi
  log "coredns ${v}: building"
  local mod_dir="${WORK_DIR}/coredns"
  new_module "${mod_dir}" ddp-operator.local/build-coredns
  cat >"${mod_dir}/main.go" <<'EOF'
// CoreDNS with the plugins of the real node's Corefile and nothing else.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

func init() {
	// Plugins run in this order whatever the Corefile says: the order of CoreDNS's plugin.cfg.
	dnsserver.Directives = []string{
		"bind", "ready", "health", "errors", "log", "loadbalance", "cache", "kubernetes", "forward",
	}
}

func main() { coremain.Run() }
EOF
  cd "${mod_dir}"
  run_go go mod edit -require="github.com/coredns/coredns@${v}"
  run_go go mod tidy
  run_go go build -ldflags "-s -w" -o "${BIN_DIR}/coredns" .
  write_stamp coredns "${stamp}"
  log "coredns ${v}: done: $("${BIN_DIR}/coredns" -version 2>/dev/null | sed -n 1p)"
}

build_crictl() {
  local v="${CRICTL_VERSION}"
  if stamp_ok crictl "${v}"; then log "crictl ${v}: up to date"; return; fi
  log "crictl ${v}: building"
  local mod_dir="${WORK_DIR}/crictl"
  new_module "${mod_dir}" ddp-operator.local/build-crictl
  cd "${mod_dir}"
  run_go go get "sigs.k8s.io/cri-tools/cmd/crictl@${v}"
  run_go go build -ldflags "-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=${v}" -o "${BIN_DIR}/crictl" \
    sigs.k8s.io/cri-tools/cmd/crictl
  write_stamp crictl "${v}"
  log "crictl ${v}: done"
}

# The pod sandbox's process: blocks until SIGINT/SIGTERM, reaps orphans (it is PID 1 of the pod's
# shared PID namespace when one is requested). Static, so the image is one file.
PAUSE_VERSION="ddp-1"
build_pause() {
  if stamp_ok pause "${PAUSE_VERSION}"; then log "pause ${PAUSE_VERSION}: up to date"; return; fi
  log "pause ${PAUSE_VERSION}: building"
  local mod_dir="${WORK_DIR}/pause"
  new_module "${mod_dir}" ddp-operator.local/pause
  cat >"${mod_dir}/main.go" <<'EOF'
// pause: the process of a pod sandbox. It holds the pod's namespaces open until it is told to stop.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	children := make(chan os.Signal, 8)
	signal.Notify(children, syscall.SIGCHLD)
	for {
		select {
		case <-stop:
			os.Exit(0)
		case <-children:
			for {
				var status syscall.WaitStatus
				pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
				if pid <= 0 || err != nil {
					break
				}
			}
		}
	}
}
EOF
  (cd "${mod_dir}" && run_go go build -ldflags "-s -w" -o "${BIN_DIR}/pause" .)
  write_stamp pause "${PAUSE_VERSION}"
}

start=${SECONDS}
wanted() { [[ ",${only}," == *",$1,"* ]]; }
if wanted packages; then install_debian_packages; fi
if wanted pause; then build_pause; fi
if wanted coredns; then build_coredns; fi
if wanted crictl; then build_crictl; fi
if wanted kubernetes; then build_node_kubernetes; fi
log "node binaries ready in ${BIN_DIR} ($((SECONDS - start)) s)"
