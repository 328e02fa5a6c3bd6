#!/usr/bin/env bash
# Builds the kind tier's parts without any container registry:
#   kind                      sigs.k8s.io/kind from the Go module proxy
#   kubeadm                   k8s.io/kubernetes/cmd/kubeadm, the release of hack/k8s-versions.env
#   coredns (kubeadm's set)   github.com/coredns/coredns with the plugins of kubeadm's Corefile
#   local-path-provisioner    github.com/rancher/local-path-provisioner (the default StorageClass)
#   the node image            ddp-kind-node:<kubernetes version>-<hash of its inputs>: a debootstrap
#                             Debian with systemd, containerd, runc, CNI plugins and iptables, the
#                             kubelet/kubeadm/kubectl, and the control-plane, kube-proxy, etcd,
#                             CoreDNS, pause, CNI and storage images preloaded into containerd under
#                             the names `kubeadm config images list` gives.
# It reuses what hack/build-k8s.sh and hack/build-node-binaries.sh built (run them first; `make kind`
# does) and the Docker that hack/build-images.sh starts. Everything is cached under
# ~/.cache/ddp-operator/kind-<kind version>/, keyed by versions and by the hash of hack/kind/.
#
# Usage: hack/build-kind.sh [--print-node-image | --print-kind | --print-bin-dir]
#        hack/build-kind.sh [kind|kubeadm|coredns|local-path|binaries|rootfs|image|all]...   (default: all)
set -euo pipefail

HACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=k8s-versions.env
source "${HACK_DIR}/k8s-versions.env"
# shellcheck source=kind/versions.env
source "${HACK_DIR}/kind/versions.env"
COREDNS_VERSION="${COREDNS_VERSION:-v1.14.7}"

CACHE_ROOT="${DDP_CACHE:-${HOME}/.cache/ddp-operator}"
K8S_BIN="${DDP_K8S_PREFIX:-${CACHE_ROOT}/k8s-${KUBERNETES_VERSION}}/bin"
KIND_DIR="${CACHE_ROOT}/kind-${KIND_VERSION}"
KIND_BIN="${KIND_DIR}/bin"
WORK="${KIND_DIR}/work"
DOCKER="${DOCKER:-docker}"
NODE_REPOSITORY="${KIND_NODE_REPOSITORY:-ddp-kind-node}"

log() { printf '[build-kind %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf '[build-kind] ERROR: %s\n' "$*" >&2; exit 1; }

export CGO_ENABLED=0
export GOFLAGS="-buildvcs=false -trimpath"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"

stamp_ok() { [[ -x "$1/$2" && -f "$1/.$2.version" && "$(cat "$1/.$2.version")" == "$3" ]]; }
write_stamp() { echo "$3" >"$1/.$2.version"; }

# The node image's tag names everything that went into it: the files under hack/kind, this script,
# and the versions of the binaries (their stamps).
node_image_tag() {
  local digest
  digest="$( (
    cd "${HACK_DIR}" && find kind -type f -print0 | sort -z | xargs -0 sha256sum
    sha256sum build-kind.sh
    for b in kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubelet kubectl kubeadm etcd pause crictl; do
      printf '%s %s\n' "${b}" "$(cat "${K8S_BIN}/.${b}.version" 2>/dev/null || echo missing)"
    done
    echo "coredns ${COREDNS_VERSION} local-path ${LOCAL_PATH_PROVISIONER_VERSION} ${KIND_NODE_SUITE}"
  ) | sha256sum | cut -c1-12)"
  echo "${NODE_REPOSITORY}:${KUBERNETES_VERSION}-${digest}"
}

case "${1:-}" in
  --print-node-image) node_image_tag; exit 0 ;;
  --print-kind) echo "${KIND_BIN}/kind"; exit 0 ;;
  --print-bin-dir) echo "${KIND_BIN}"; exit 0 ;;
esac

run_go() {
  local out
  if ! out="$("$@" 2>&1)"; then
    printf '%s\n' "${out}" | tail -n 40 >&2
    die "command failed: $* (a module the Go proxy does not serve is named above)"
  fi
}

new_module() { # dir name
  command -v go >/dev/null 2>&1 || die "no Go toolchain on PATH: install Go >= 1.25 and retry"
  rm -rf "$1" && mkdir -p "$1"
  (cd "$1" && run_go go mod init "$2" &&
    run_go go mod edit -go="$(go env GOVERSION | sed 's/^go//; s/^\([0-9]*\.[0-9]*\).*/\1.0/')")
}

timed() { # what command... : runs it and logs how long it took
  local what=$1 t0=${SECONDS}
  shift
  "$@"
  log "${what}: $((SECONDS - t0)) s"
}

build_kind() {
  local real="kind-${KIND_VERSION}"
  if stamp_ok "${KIND_BIN}" "${real}" "${KIND_VERSION}"; then
    log "kind ${KIND_VERSION}: up to date"
  else
    log "kind ${KIND_VERSION}: building"
    new_module "${WORK}/go-kind" ddp-operator.local/build-kind
    (cd "${WORK}/go-kind" && run_go go get "sigs.k8s.io/kind@${KIND_VERSION}" &&
      run_go go build -ldflags "-s -w" -o "${KIND_BIN}/${real}" sigs.k8s.io/kind)
    write_stamp "${KIND_BIN}" "${real}" "${KIND_VERSION}"
  fi
  rm -f "${KIND_BIN}/kind" "${KIND_BIN}/.kind.version"
  if host_lacks_capabilities; then
    # kind runs every node `docker run --privileged`, which fails where the daemon lacks a capability:
    # kind gets a docker shim that selects a runtime leaving those out (docs/kind.md, host facts).
    mkdir -p "${KIND_BIN}/docker-shim"
    sed "s|@REAL_DOCKER@|$(command -v "${DOCKER}")|" "${HACK_DIR}/kind/host/docker" >"${KIND_BIN}/docker-shim/docker"
    sed "s|@KIND_VERSION@|${KIND_VERSION}|" "${HACK_DIR}/kind/host/kind" >"${KIND_BIN}/kind"
    install -m 0755 "${HACK_DIR}/kind/host/runc-without-sys-resource" "${KIND_BIN}/runc-without-sys-resource"
    chmod 0755 "${KIND_BIN}/docker-shim/docker" "${KIND_BIN}/kind"
  else
    ln -s "${real}" "${KIND_BIN}/kind"
  fi
}

# CapBnd of this process: all of them (0x1ffffffffff and beyond) unless the machine withholds some.
host_lacks_capabilities() {
  local bnd last
  bnd="$(awk '/^CapBnd:/ {print $2}' /proc/self/status)"
  last="$(cat /proc/sys/kernel/cap_last_cap)"
  (( (16#${bnd} & ((1 << (last + 1)) - 1)) != ((1 << (last + 1)) - 1) ))
}

# Registers ddp-kind-runc with dockerd (an added runtime, never the default; dockerd reloads its
# runtimes on SIGHUP, so running containers are not touched).
ensure_docker_runtime() {
  host_lacks_capabilities || return 0
  if ${DOCKER} info --format '{{json .Runtimes}}' 2>/dev/null | grep -q '"ddp-kind-runc"'; then return 0; fi
  log "registering the Docker runtime ddp-kind-runc (${KIND_BIN}/runc-without-sys-resource) in /etc/docker/daemon.json"
  as_root mkdir -p /etc/docker
  as_root python3 - "${KIND_BIN}/runc-without-sys-resource" <<'PY'
import json, os, sys
path = "/etc/docker/daemon.json"
config = json.load(open(path)) if os.path.exists(path) and os.path.getsize(path) else {}
config.setdefault("runtimes", {})["ddp-kind-runc"] = {"path": sys.argv[1]}
with open(path + ".tmp", "w") as f:
    json.dump(config, f, indent=2)
os.replace(path + ".tmp", path)
PY
  as_root kill -HUP "$(pgrep -x dockerd | head -n1)"
  for _ in $(seq 1 20); do
    ${DOCKER} info --format '{{json .Runtimes}}' 2>/dev/null | grep -q '"ddp-kind-runc"' && return 0
    sleep 0.5
  done
  die "dockerd did not load the runtime ddp-kind-runc from /etc/docker/daemon.json"
}

build_kubeadm() {
  local v="${KUBERNETES_VERSION}"
  if stamp_ok "${K8S_BIN}" kubeadm "${v}"; then log "kubeadm ${v}: up to date"; return; fi
  log "kubeadm ${v}: building (shares Go's build cache with hack/build-k8s.sh)"
  local mod="${WORK}/go-kubeadm" info gomod staging args=()
  new_module "${mod}" ddp-operator.local/build-kubeadm
  cd "${mod}"
  info="$(go mod download -json "k8s.io/kubernetes@${v}")" || die "the Go module proxy does not serve k8s.io/kubernetes@${v}"
  gomod="$(sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p' <<<"${info}")"
  staging="$(awk '$2 == "v0.0.0" && $1 ~ /^k8s\.io\// {print $1}' "${gomod}" | sort -u)"
  [[ -n "${staging}" ]] || die "found no v0.0.0 staging requirements in ${gomod}"
  for m in ${staging}; do args+=("-replace=${m}=${m}@v0.${v#v1.}"); done
  run_go go mod edit "${args[@]}"
  run_go go get "k8s.io/kubernetes/cmd/kubeadm@${v}"
  local minor="${v#v1.}" ld="-s -w"
  minor="${minor%%.*}"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X ${p}.gitVersion=${v} -X ${p}.gitMajor=1 -X ${p}.gitMinor=${minor} -X ${p}.gitTreeState=clean"
    ld+=" -X ${p}.buildDate=1970-01-01T00:00:00Z"
  done
  run_go go build -tags "selinux,notest,grpcnotrace" -ldflags "${ld}" -o "${K8S_BIN}/kubeadm" k8s.io/kubernetes/cmd/kubeadm
  write_stamp "${K8S_BIN}" kubeadm "${v}"
  cd - >/dev/null
}

# kubeadm's CoreDNS Deployment runs the Corefile kubeadm writes: errors, health, ready, kubernetes,
# prometheus, forward, cache, loop, reload, loadbalance. The real node's minimal CoreDNS lacks some of them.
build_coredns() {
  local stamp="${COREDNS_VERSION}-kubeadm"
  if stamp_ok "${KIND_BIN}" coredns "${stamp}"; then log "coredns ${stamp}: up to date"; return; fi
  log "coredns ${COREDNS_VERSION}: building with kubeadm's plugins"
  local mod="${WORK}/go-coredns"
  new_module "${mod}" ddp-operator.local/build-coredns-kubeadm
  cat >"${mod}/main.go" <<'EOF'
// CoreDNS with the plugins of the Corefile kubeadm writes, in CoreDNS's plugin.cfg order.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/metrics"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
)

func init() {
	dnsserver.Directives = []string{
		"reload", "ready", "health", "prometheus", "errors", "log", "loadbalance", "cache", "loop",
		"kubernetes", "forward",
	}
}

func main() { coremain.Run() }
EOF
  (cd "${mod}" && run_go go mod edit -require="github.com/coredns/coredns@${COREDNS_VERSION}" &&
    run_go go mod tidy && run_go go build -ldflags "-s -w" -o "${KIND_BIN}/coredns" .)
  write_stamp "${KIND_BIN}" coredns "${stamp}"
}

build_local_path() {
  local v="${LOCAL_PATH_PROVISIONER_VERSION}"
  if stamp_ok "${KIND_BIN}" local-path-provisioner "${v}"; then log "local-path-provisioner ${v}: up to date"; return; fi
  log "local-path-provisioner ${v}: building"
  local mod="${WORK}/go-local-path"
  new_module "${mod}" ddp-operator.local/build-local-path
  (cd "${mod}" && run_go go get "github.com/rancher/local-path-provisioner@${v}" &&
    run_go go build -ldflags "-s -w" -o "${KIND_BIN}/local-path-provisioner" github.com/rancher/local-path-provisioner)
  write_stamp "${KIND_BIN}" local-path-provisioner "${v}"
}

binaries() {
  mkdir -p "${KIND_BIN}" "${WORK}"
  timed "kind" build_kind
  timed "kubeadm" build_kubeadm
  timed "coredns" build_coredns
  timed "local-path-provisioner" build_local_path
}

# --- images -------------------------------------------------------------------------------------

as_root() { if [[ "$(id -u)" -eq 0 ]]; then "$@"; else sudo "$@"; fi; }

debian_mirror() {
  if [[ -n "${DEBIAN_MIRROR:-}" ]]; then echo "${DEBIAN_MIRROR}"; return; fi
  local uri
  uri=$(grep -hoE '^URIs: *[^ ]+/debian$' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1 | awk '{print $2}')
  [[ -n "${uri}" ]] || uri=$(grep -hoE '^deb +[^ ]+/debian ' /etc/apt/sources.list 2>/dev/null | head -n1 | awk '{print $2}')
  echo "${uri:-http://deb.debian.org/debian}"
}

# A debootstrap rootfs imported into Docker, cached as a tarball keyed by suite and packages.
rootfs_image() { # name packages -> prints the image tag
  local name=$1 packages=$2 key tag tarball rootfs t0=${SECONDS}
  key="$(printf '%s %s' "${KIND_NODE_SUITE}" "${packages}" | sha256sum | cut -c1-12)"
  tag="ddp-kind-${name}:${KIND_NODE_SUITE}-${key}"
  if ${DOCKER} image inspect "${tag}" >/dev/null 2>&1; then echo "${tag}"; return; fi
  tarball="${KIND_DIR}/rootfs-${name}-${KIND_NODE_SUITE}-${key}.tar.gz"
  if [[ ! -s "${tarball}" ]]; then
    command -v debootstrap >/dev/null 2>&1 || die "no debootstrap (hack/build-images.sh installs it)"
    rootfs="$(mktemp -d "${WORK}/rootfs.XXXXXX")"
    log "debootstrap ${KIND_NODE_SUITE} for ${name} (${packages}) from $(debian_mirror)"
    as_root debootstrap --variant=minbase --include="${packages}" "${KIND_NODE_SUITE}" "${rootfs}" "$(debian_mirror)" \
      >"${WORK}/debootstrap-${name}.log" 2>&1 || { tail -n 30 "${WORK}/debootstrap-${name}.log" >&2; die "debootstrap failed"; }
    as_root rm -rf "${rootfs}"/var/lib/apt/lists/* "${rootfs}"/var/cache/apt/* "${rootfs}"/usr/share/doc/* \
      "${rootfs}"/usr/share/man/* "${rootfs}"/usr/share/info/* "${rootfs}"/usr/share/locale/* "${rootfs}"/var/log/*
    as_root tar --numeric-owner -C "${rootfs}" -c . | gzip -1 >"${tarball}.tmp"
    as_root rm -rf "${rootfs}"
    mv "${tarball}.tmp" "${tarball}"
    log "rootfs ${name} cached: ${tarball} ($(du -h "${tarball}" | cut -f1), $((SECONDS - t0)) s)"
  fi
  ${DOCKER} import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' "${tarball}" "${tag}" >/dev/null
  echo "${tag}"
}

docker_build() { # tag context [build args...]: a quiet classic build, its log kept on failure
  local tag=$1 context=$2
  shift 2
  DOCKER_BUILDKIT=0 ${DOCKER} build --network none "$@" -t "${tag}" "${context}" >"${WORK}/build.log" 2>&1 ||
    { tail -n 30 "${WORK}/build.log" >&2; die "docker build of ${tag} failed"; }
}

# One static binary on an empty filesystem (or on a given base), run as kubeadm's manifests expect.
binary_image() { # tag binary dest-path base entrypoint-or-empty
  local tag=$1 binary=$2 dest=$3 base=$4 entrypoint=$5 ctx
  ctx="$(mktemp -d "${WORK}/ctx.XXXXXX")"
  cp "${binary}" "${ctx}/bin"
  {
    echo "FROM ${base}"
    echo "COPY bin ${dest}"
    echo "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    [[ -z "${entrypoint}" ]] || echo "ENTRYPOINT [\"${entrypoint}\"]"
  } >"${ctx}/Dockerfile"
  docker_build "${tag}" "${ctx}"
  rm -rf "${ctx}"
}

# The node: systemd, the container runtime, CNI plugins, and what the kubelet and kube-proxy run.
NODE_PACKAGES=systemd,containerd,runc,containernetworking-plugins,iptables,nftables,conntrack,iproute2,ethtool,kmod,procps,ca-certificates,socat,libseccomp2
# A small userland for kube-proxy, the CNI installer and local-path's helper pods.
TOOLS_PACKAGES=iptables,nftables,conntrack,ca-certificates

rootfs_images() {
  ${DOCKER} info >/dev/null 2>&1 || die "no Docker daemon answers (hack/build-images.sh starts one)"
  ensure_docker_runtime
  timed "node rootfs" rootfs_image rootfs "${NODE_PACKAGES}" >/dev/null
  timed "tools rootfs" rootfs_image tools "${TOOLS_PACKAGES}" >/dev/null
}

need() { for b in "$@"; do [[ -x "${b}" ]] || die "missing ${b}: run hack/build-k8s.sh and hack/build-node-binaries.sh (make k8s-binaries node-binaries)"; done; }

node_image() {
  local tag
  tag="$(node_image_tag)"
  if ${DOCKER} image inspect "${tag}" >/dev/null 2>&1; then
    log "node image ${tag}: up to date"
    echo "${tag}" >"${KIND_DIR}/node-image"
    return
  fi
  need "${K8S_BIN}"/{kube-apiserver,kube-controller-manager,kube-scheduler,kube-proxy,kubelet,kubectl,kubeadm,etcd,pause,crictl} \
    "${KIND_BIN}"/{coredns,local-path-provisioner}
  ${DOCKER} info >/dev/null 2>&1 || die "no Docker daemon answers (hack/build-images.sh starts one)"
  local t0=${SECONDS} images=() names
  mkdir -p "${WORK}"

  # The names kubeadm asks for, e.g. registry.k8s.io/kube-apiserver:v1.36.3, registry.k8s.io/pause:3.10.2.
  names="$("${K8S_BIN}/kubeadm" config images list --kubernetes-version "${KUBERNETES_VERSION}" 2>/dev/null)" ||
    die "kubeadm config images list failed"
  image_named() { grep -E "/$1:" <<<"${names}" | head -n1; }
  local pause_image
  pause_image="$(image_named pause)"

  local rootfs tools
  rootfs="$(rootfs_image rootfs "${NODE_PACKAGES}")"
  tools="$(rootfs_image tools "${TOOLS_PACKAGES}")"

  log "component images (static binaries, named as kubeadm asks)"
  for c in kube-apiserver kube-controller-manager kube-scheduler; do
    binary_image "$(image_named "${c}")" "${K8S_BIN}/${c}" "/usr/local/bin/${c}" scratch ""
    images+=("$(image_named "${c}")")
  done
  # kube-proxy programs iptables: it runs on a Debian userland (kubeadm starts /usr/local/bin/kube-proxy).
  binary_image "$(image_named kube-proxy)" "${K8S_BIN}/kube-proxy" /usr/local/bin/kube-proxy "${tools}" ""
  binary_image "$(image_named etcd)" "${K8S_BIN}/etcd" /usr/local/bin/etcd scratch ""
  binary_image "$(image_named coredns)" "${KIND_BIN}/coredns" /coredns scratch /coredns
  binary_image "${pause_image}" "${K8S_BIN}/pause" /pause scratch /pause
  images+=("$(image_named kube-proxy)" "$(image_named etcd)" "$(image_named coredns)" "${pause_image}")
  local tools_image="ddp.local/kind-node-tools:${KIND_NODE_SUITE}-${tools##*-}"
  local local_path_image="ddp.local/local-path-provisioner:${LOCAL_PATH_PROVISIONER_VERSION}"
  ${DOCKER} tag "${tools}" "${tools_image}"
  binary_image "${local_path_image}" "${KIND_BIN}/local-path-provisioner" /usr/local/bin/local-path-provisioner "${tools}" ""
  images+=("${tools_image}" "${local_path_image}")
  ${DOCKER} save -o "${WORK}/images.tar" "${images[@]}"
  log "component images saved: $(du -h "${WORK}/images.tar" | cut -f1)"

  # The node's filesystem: our units and configs, the binaries, the files kind reads under /kind.
  local ctx="${WORK}/node-context"
  rm -rf "${ctx}" && mkdir -p "${ctx}/bin" "${ctx}/kind/manifests"
  cp "${HACK_DIR}"/kind/node/* "${ctx}/"
  cp "${K8S_BIN}"/{kubelet,kubeadm,kubectl,crictl} "${ctx}/bin/"
  sed -i "s|@PAUSE_IMAGE@|${pause_image}|" "${ctx}/containerd-config.toml"
  echo "${KUBERNETES_VERSION}" >"${ctx}/kind/version"
  printf '%s\n' "${images[@]}" >"${ctx}/kind/images"
  for m in default-cni default-storage; do
    sed -e "s|@NODE_TOOLS_IMAGE@|${tools_image}|g" -e "s|@LOCAL_PATH_IMAGE@|${local_path_image}|g" \
      "${HACK_DIR}/kind/manifests/${m}.yaml" >"${ctx}/kind/manifests/${m}.yaml"
  done
  docker_build "${tag}-base" "${ctx}" --build-arg "ROOTFS_IMAGE=${rootfs}"

  # Preload: the node's own containerd imports the images into a directory of this host (a real
  # filesystem: overlayfs snapshots cannot live on Docker's overlay root), which becomes the
  # image's /var/lib/containerd. kind puts a volume on /var, which Docker fills from the image.
  local store="${WORK}/preload"
  as_root rm -rf "${store}" && mkdir -p "${store}/containerd"
  local runtime=()
  if host_lacks_capabilities; then runtime=(--runtime=ddp-kind-runc); fi
  ${DOCKER} run --rm --privileged "${runtime[@]}" --network none --entrypoint /bin/bash \
    -v "${store}/containerd:/var/lib/containerd" -v "${WORK}/images.tar:/images.tar:ro" "${tag}-base" -c '
      set -eu
      containerd --config /etc/containerd/config.toml >/tmp/containerd.log 2>&1 &
      pid=$!
      for _ in $(seq 1 100); do ctr version >/dev/null 2>&1 && break; sleep 0.2; done
      ctr -n k8s.io images import --all-platforms --snapshotter overlayfs /images.tar >/dev/null
      ctr -n k8s.io images ls -q
      kill "${pid}"; wait "${pid}" || true' >"${WORK}/preload.log" 2>&1 || { cat "${WORK}/preload.log" >&2; die "preloading images failed"; }
  for i in "${images[@]}"; do
    grep -qxF "${i}" "${WORK}/preload.log" || grep -qxF "docker.io/${i}" "${WORK}/preload.log" ||
      { cat "${WORK}/preload.log" >&2; die "${i} is not in the preloaded store"; }
  done
  printf 'FROM %s\nCOPY containerd /var/lib/containerd\n' "${tag}-base" >"${store}/Dockerfile"
  docker_build "${tag}" "${store}"
  ${DOCKER} rmi "${tag}-base" >/dev/null
  as_root rm -rf "${store}" "${WORK}/images.tar"
  echo "${tag}" >"${KIND_DIR}/node-image"
  log "node image ${tag}: $(${DOCKER} image inspect -f '{{.Size}}' "${tag}" | awk '{printf "%.0f MB", $1/1e6}') in $((SECONDS - t0)) s"
}

mkdir -p "${KIND_BIN}" "${WORK}"
for target in "${@:-all}"; do
  case "${target}" in
    kind) timed kind build_kind ;;
    kubeadm) timed kubeadm build_kubeadm ;;
    coredns) timed coredns build_coredns ;;
    local-path) timed local-path-provisioner build_local_path ;;
    binaries) binaries ;;
    rootfs) rootfs_images ;;
    image) rootfs_images; node_image ;;
    all) binaries; rootfs_images; node_image ;;
    *) die "unknown target ${target} (kind|kubeadm|coredns|local-path|binaries|rootfs|image|all)" ;;
  esac
done
