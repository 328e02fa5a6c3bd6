#!/usr/bin/env bash
# Builds the operator and trainer images on this machine without pulling from any registry.
#
#   hack/build-images.sh [all|base|operator|trainer]...     (default: all)
#
# 1. Docker: installs Debian's docker.io when dockerd is missing and starts dockerd (overlay2,
#    log in $IMAGES_CACHE/dockerd.log) when no daemon answers. Needs root for both.
# 2. Base image: debootstraps a minimal Debian bookworm with python3, caches the rootfs tarball
#    under $IMAGES_CACHE and `docker import`s it as ddp-base:<suite>-<hash>.
# 3. Both images: built on that base (--build-arg BASE_IMAGE). pip inside the build uses the
#    host's CA bundle and the wheels this machine already downloaded (torch and its CUDA
#    libraries are ~2.8 GB): a throwaway HTTP server on 127.0.0.1 serves them to `docker build
#    --network host`, so they never enter the build context or any image layer.
# Tags are the package version (never :latest). Prints build times and image sizes.
#
# Environment: DDP_CACHE (~/.cache/ddp-operator), DDP_WHEELS ($DDP_CACHE/wheels),
# DEBIAN_MIRROR (the first deb URI in apt's sources, else deb.debian.org), HOST_CA_BUNDLE
# (/etc/ssl/certs/ca-certificates.crt), OPERATOR_REPOSITORY (ddp-operator),
# TRAINER_REPOSITORY (ddp-trainer), DOCKER_BUILD_FLAGS (extra flags, e.g. --no-cache),
# TRAINER_DOCKERFILE (build the trainer from another Dockerfile), ASSETS_PORT (28479).
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${DDP_CACHE:-$HOME/.cache/ddp-operator}
IMAGES_CACHE=$CACHE/images
WHEELS=${DDP_WHEELS:-$CACHE/wheels}
HOST_CA_BUNDLE=${HOST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
SUITE=bookworm
# python3-venv brings ensurepip, so `python3 -m venv` works in the image as it does on python:*-slim.
BASE_PACKAGES=python3,python3-venv,ca-certificates,tini
VERSION=$(sed -n 's/^version *= *"\(.*\)"/\1/p' "$REPO_ROOT/pyproject.toml" | head -n1)
OPERATOR_IMAGE=${OPERATOR_REPOSITORY:-ddp-operator}:$VERSION
TRAINER_IMAGE=${TRAINER_REPOSITORY:-ddp-trainer}:$VERSION
DOCKER=${DOCKER:-docker}

log() { printf '>>> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo "$@"
  else die "need root (or sudo) to run: $*"
  fi
}

debian_mirror() {
  if [ -n "${DEBIAN_MIRROR:-}" ]; then echo "$DEBIAN_MIRROR"; return; fi
  local uri
  uri=$(grep -hoE '^URIs: *[^ ]+/debian$' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1 | awk '{print $2}')
  [ -n "$uri" ] || uri=$(grep -hoE '^deb +[^ ]+/debian ' /etc/apt/sources.list 2>/dev/null | head -n1 | awk '{print $2}')
  echo "${uri:-http://deb.debian.org/debian}"
}

ensure_docker() {
  local missing=()
  command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
  command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
  [ ${#missing[@]} -eq 0 ] && return
  log "installing ${missing[*]} from Debian"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

ensure_dockerd() {
  if $DOCKER info >/dev/null 2>&1; then return; fi
  mkdir -p "$IMAGES_CACHE"
  log "starting dockerd (overlay2), log: $IMAGES_CACHE/dockerd.log"
  # setsid: the daemon must outlive this script and not receive the terminal's signals.
  as_root setsid dockerd --storage-driver overlay2 >"$IMAGES_CACHE/dockerd.log" 2>&1 < /dev/null &
  for _ in $(seq 1 60); do
    $DOCKER info >/dev/null 2>&1 && return
    sleep 1
  done
  tail -n 30 "$IMAGES_CACHE/dockerd.log" >&2 || true
  die "dockerd did not answer within 60 s (log above)"
}

# The base image's tag names what is in it, so a changed package list makes a new one.
base_image_tag() {
  local digest
  digest=$(printf '%s %s' "$SUITE" "$BASE_PACKAGES" | sha256sum | cut -c1-12)
  echo "ddp-base:$SUITE-$digest"
}

build_base() {
  local tag tarball rootfs started
  tag=$(base_image_tag)
  tarball=$IMAGES_CACHE/${tag//:/-}.tar.gz
  if $DOCKER image inspect "$tag" >/dev/null 2>&1; then
    log "base image $tag exists"
    echo "$tag"
    return
  fi
  mkdir -p "$IMAGES_CACHE"
  if [ ! -s "$tarball" ]; then
    started=$SECONDS
    rootfs=$(mktemp -d "$IMAGES_CACHE/rootfs.XXXXXX")
    log "debootstrap $SUITE ($BASE_PACKAGES) from $(debian_mirror)"
    as_root debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$rootfs" "$(debian_mirror)" \
      >"$IMAGES_CACHE/debootstrap.log" 2>&1 || { tail -n 30 "$IMAGES_CACHE/debootstrap.log" >&2; die "debootstrap failed"; }
    # What a container never needs: package indexes, docs, man pages, caches.
    as_root rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/usr/share/doc/* \
      "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/* "$rootfs"/var/log/*
    as_root tar --numeric-owner -C "$rootfs" -czf "$tarball.tmp" .
    as_root rm -rf "$rootfs"
    mv "$tarball.tmp" "$tarball"
    log "base rootfs cached: $tarball ($(du -h "$tarball" | cut -f1), $((SECONDS - started)) s)"
  fi
  $DOCKER import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    "$tarball" "$tag" >/dev/null
  log "imported $tag"
  echo "$tag"
}

# A build context holding only what the images need (the repo may hold GBs of other things).
stage_context() {
  local context=$1
  rm -rf "$context"
  mkdir -p "$context/operator" "$context/trainer_image"
  cp "$REPO_ROOT/pyproject.toml" "$REPO_ROOT/README.md" "$context/"
  cp -r "$REPO_ROOT/operator/ddp_operator" "$context/operator/"
  cp -r "$REPO_ROOT/trainer_image/ddp_trainer" "$context/trainer_image/"
  local dockerfile
  for dockerfile in operator/Dockerfile trainer_image/Dockerfile; do
    [ ! -f "$REPO_ROOT/$dockerfile" ] || cp "$REPO_ROOT/$dockerfile" "$context/$dockerfile"
  done
  # TRAINER_DOCKERFILE: try another trainer Dockerfile without editing the repository's.
  [ -z "${TRAINER_DOCKERFILE:-}" ] || cp "$TRAINER_DOCKERFILE" "$context/trainer_image/Dockerfile"
  find "$context" -name '__pycache__' -prune -exec rm -rf {} +
  find "$context" -exec touch -h -d @0 {} +  # stable mtimes keep the layer cache warm across stagings
}

SERVER_PID=
stop_asset_server() { [ -z "$SERVER_PID" ] || kill "$SERVER_PID" 2>/dev/null || true; }

# Serves the wheels and the CA bundle to the builds on 127.0.0.1; sets ASSETS_URL. Runs in this
# shell (not in $(...)), or the server would die with the subshell.
ASSETS_URL=
start_asset_server() {
  local assets=$IMAGES_CACHE/assets port
  rm -rf "$assets" && mkdir -p "$assets/wheels"
  [ -r "$HOST_CA_BUNDLE" ] && cp "$HOST_CA_BUNDLE" "$assets/ca-certificates.crt"
  if [ -d "$WHEELS" ]; then
    # Hard links cost nothing; fall back to symlinks across filesystems (http.server follows them).
    cp -al "$WHEELS"/. "$assets/wheels/" 2>/dev/null || cp -as "$WHEELS"/. "$assets/wheels/"
  fi
  # A fixed port keeps BUILD_ASSETS_URL, and so the layer cache keys, the same from build to build. It
  # lies below the kernel's ephemeral range (32768-60999), where any outgoing connection of a test
  # running beside the build could hold it; the probe binds with SO_REUSEADDR like http.server does,
  # or the previous build's server, gone but with connections in TIME_WAIT, would count as taking it
  # (both happened: `make kind` rebuilt the trainer with no cache hits, then kind loaded it again).
  port=${ASSETS_PORT:-28479}
  if ! python3 -c "import socket, sys; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', int(sys.argv[1])))" "$port" 2>/dev/null; then
    log "port $port is taken: serving build assets on a random port (no layer cache hits this time)"
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  fi
  python3 -m http.server --bind 127.0.0.1 --directory "$assets" "$port" >"$IMAGES_CACHE/assets-server.log" 2>&1 &
  SERVER_PID=$!
  trap stop_asset_server EXIT
  for _ in $(seq 1 50); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/')" 2>/dev/null && break
    sleep 0.1
  done
  ASSETS_URL=http://127.0.0.1:$port
}

declare -A BUILD_SECONDS=()

host_torch() { # the host virtualenv's torch version, without its local tag (2.15.0+cu132 -> 2.15.0)
  "${DDP_VENV:-$CACHE/venv}/bin/python" -c 'import importlib.metadata as m; print(m.version("torch").split("+")[0])'
}

build_image() {
  local image=$1 dockerfile=$2 base=$3 assets_url=$4 context=$5 started
  started=$SECONDS
  local extra=()
  # The trainer image the tests load into kind runs on CPUs: without triton it is ~1 GB smaller
  # (trainer_image/Dockerfile says why that is safe).
  # It carries the torch the host's tests ran on (its wheels are served to the build): the newest in
  # pyproject's range when the host's virtualenv was made.
  [[ $dockerfile == trainer_image/* ]] && extra=(--build-arg DROP_TRITON=1 --build-arg TORCH_VERSION="$(host_torch)")
  log "building $image on $base"
  local replaced
  replaced=$($DOCKER image inspect -f '{{.Id}}' "$image" 2>/dev/null || true)
  # shellcheck disable=SC2086
  DOCKER_BUILDKIT=0 $DOCKER build --network host ${DOCKER_BUILD_FLAGS:-} \
    --build-arg BASE_IMAGE="$base" \
    --build-arg BUILD_ASSETS_URL="$assets_url" "${extra[@]}" \
    --label org.opencontainers.image.version="$VERSION" \
    -f "$context/$dockerfile" -t "$image" "$context" >"$IMAGES_CACHE/build-${image%%:*}.log" 2>&1 \
    || { tail -n 40 "$IMAGES_CACHE/build-${image%%:*}.log" >&2; die "building $image failed (log above)"; }
  # The image this build replaced under the tag, with its untagged layers: each code change of the
  # trainer leaves ~5 GB behind otherwise, and a machine that builds every run fills its disk (a CI run
  # here once failed with "no space left on device" in `kind load`). One still in use stays.
  if [[ -n $replaced && $replaced != "$($DOCKER image inspect -f '{{.Id}}' "$image")" ]]; then
    $DOCKER image rm "$replaced" >/dev/null 2>&1 || log "kept the image $image replaced ($replaced): still in use"
  fi
  BUILD_SECONDS[$image]=$((SECONDS - started))
}

report() {
  printf '\n%-28s %12s %10s\n' image size build_s
  local image
  for image in "$@"; do
    $DOCKER image inspect "$image" >/dev/null 2>&1 || continue
    printf '%-28s %12s %10s\n' "$image" \
      "$($DOCKER image inspect -f '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1/1e6}')" \
      "${BUILD_SECONDS[$image]:--}"
  done
}

main() {
  local targets=("$@") base context built=()
  [ ${#targets[@]} -gt 0 ] || targets=(all)
  for target in "${targets[@]}"; do
    case $target in all|base|operator|trainer) ;; *) die "unknown target '$target' (all|base|operator|trainer)";; esac
  done
  [ -n "$VERSION" ] || die "no version in pyproject.toml"
  ensure_docker
  ensure_dockerd
  local started=$SECONDS
  base=$(build_base)
  BUILD_SECONDS[$base]=$((SECONDS - started))
  built+=("$base")
  if [[ " ${targets[*]} " =~ \ (all|operator|trainer)\  ]]; then
    context=$IMAGES_CACHE/context
    stage_context "$context"
    start_asset_server
    if [[ " ${targets[*]} " =~ \ (all|operator)\  ]]; then
      build_image "$OPERATOR_IMAGE" operator/Dockerfile "$base" "$ASSETS_URL" "$context"
      built+=("$OPERATOR_IMAGE")
    fi
    if [[ " ${targets[*]} " =~ \ (all|trainer)\  ]]; then
      build_image "$TRAINER_IMAGE" trainer_image/Dockerfile "$base" "$ASSETS_URL" "$context"
      built+=("$TRAINER_IMAGE")
    fi
  fi
  report "${built[@]}"
}

main "$@"
