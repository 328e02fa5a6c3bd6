#!/usr/bin/env bash
# `make test`: lint, types and the four tiers in two lanes side by side, with the builds the later tiers
# need running beside them instead of before them (docs/testing.md, "How the run is laid out").
#
#   foreground:  venv -> lint, mypy -> unit -> lane A and lane B, side by side:
#     lane A:    trainer tier -> its recovery tests on the lowest torch -> integration, Kueue + gangs +
#                chart --> e2e: Docker + the real node
#     lane B:    (control-plane builds) integration, the rest -> e2e: kind
#   background:  Kubernetes, Kueue -> node binaries, kube-router -> kind -> the kind cluster
#                (beside it) the lowest torch's venv -> Docker and both images -> the kind node's root
#                filesystems
#
# The builds are mostly compiles and downloads; the tiers are mostly processes waiting on each other
# (rendezvous rounds, kubelets' reports, decision windows): a tier alone keeps 2 cores about half busy,
# so two of them and the builds share the machine instead of adding up. The builds run at a lower
# priority, so a tier's processes get the CPU first. A lane's tier starts once what it needs is built; a
# failed build or tier fails the run at once (the other lane is stopped) with its log. Each step's
# seconds are printed at the end, per lane.
set -euo pipefail
cd "$(dirname "$0")/.."

MAKE=${MAKE:-make}
logs=$(mktemp -d "${TMPDIR:-/tmp}/ddp-test-all.XXXXXX")
KIND_CLUSTER=${DDP_E2E_KIND_CLUSTER:-ddp-e2e}
kind_kubeconfig=$logs/kind.kubeconfig

record() { # lane label seconds
  printf '%-7s %-44s %5d s\n' "$1" "$2" "$3" >>"$logs/timings"
}

step() { # lane name command... : timed
  local lane=$1 name=$2 started=$SECONDS
  shift 2
  echo ">>> ${name}"
  "$@"
  record "$lane" "$name" $((SECONDS - started))
}

# Two background chains, so the network- and disk-bound builds (apt, debootstrap, pip into the image,
# docker import) overlap the compiles instead of queueing behind them on a cold machine; each stage
# leaves <stage>.done (or <stage>.failed) in $logs.
stage() { # name command...
  local name=$1 started=$SECONDS
  shift
  if "$@" >"$logs/$name.log" 2>&1; then
    echo "$((SECONDS - started))" >"$logs/$name.done"
  else
    echo "$((SECONDS - started))" >"$logs/$name.failed"
    return 1
  fi
}

# The compiles: Kubernetes and Kueue, the node's and kube-router's binaries, then kind (its node image
# needs both images, so it waits for the other chain) and the kind suite's cluster (create, load both
# images) while the earlier tiers run.
compiles() {
  stage control-plane $MAKE --no-print-directory k8s-binaries kueue-binary &&
    stage node $MAKE --no-print-directory node-binaries kube-router &&
    await_stage assembly &&
    stage kind $MAKE --no-print-directory kind &&
    stage kind-cluster hack/kind-cluster.sh up "$KIND_CLUSTER" "$kind_kubeconfig"
}

# The downloads and assembly: the lowest torch's virtualenv, Docker and both images, then the kind
# node's root filesystems.
assembly() {
  stage venv-lowest $MAKE --no-print-directory venv-lowest &&
    stage images $MAKE --no-print-directory images &&
    stage kind-rootfs hack/build-kind.sh rootfs &&
    touch "$logs/assembly.done"
}

await_stage() { # name: inside a chain, until the other chain's stage is done (1 when it failed)
  until [[ -e $logs/$1.done ]]; do
    [[ -e $logs/venv-lowest.failed || -e $logs/images.failed || -e $logs/kind-rootfs.failed ]] && return 1
    sleep 2
  done
}

builds() {
  assembly &
  local assembler=$! compiled=0
  compiles || compiled=1
  wait "$assembler" || return 1
  return "$compiled"
}

wait_for_builds() { # lane stage
  local lane=$1 name=$2 started=$SECONDS
  while [[ ! -e $logs/$name.done ]]; do
    if [[ -e $logs/$name.failed ]] || ! kill -0 "$builder" 2>/dev/null; then
      [[ -e $logs/$name.done ]] && break
      # The stage that failed: this one, or an earlier one of either chain that this one needed.
      local failed=$logs/$name.failed
      [[ -e $failed ]] || failed=$(ls "$logs"/*.failed 2>/dev/null | head -n 1)
      failed=$(basename "${failed:-$name.failed}" .failed)
      echo "error: the background build '$failed' failed (the $name builds cannot finish); the end of its log ($logs/$failed.log):" >&2
      tail -n 60 "$logs/$failed.log" >&2 || true
      return 1
    fi
    sleep 2
  done
  record "$lane" "waited for the $name builds" $((SECONDS - started))
}

# The integration tier is split between the lanes (the Makefile's INTEGRATION_A): the kind suite makes
# lane B the longer, and lane A's real node waits for its builds anyway.
lane_a() {
  step A "trainer tier" $MAKE --no-print-directory test-trainer
  wait_for_builds A venv-lowest
  step A "trainer tier's recovery tests, lowest torch" $MAKE --no-print-directory test-trainer-lowest
  wait_for_builds A control-plane
  step A "integration tier, Kueue, gangs and the chart" $MAKE --no-print-directory test-integration-a
  wait_for_builds A node
  wait_for_builds A images
  step A "e2e tier: Docker and the real node" $MAKE --no-print-directory test-e2e-node
}

lane_b() {
  wait_for_builds B control-plane
  step B "integration tier, the rest" $MAKE --no-print-directory test-integration-b
  wait_for_builds B kind-cluster
  DDP_E2E_KIND_KUBECONFIG=$kind_kubeconfig step B "e2e tier: kind" $MAKE --no-print-directory test-e2e-kind
}

# A failed step ends the run: whatever still runs beside it (the builds, the other lane) ends with it.
kill_tree() {
  local child
  for child in $(pgrep -P "$1" 2>/dev/null); do kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}

tree_pids() { # pid: it and every descendant
  local child
  echo "$1"
  for child in $(pgrep -P "$1" 2>/dev/null); do tree_pids "$child"; done
}

# The tiers first: a pytest that gets SIGTERM ends like Ctrl-C and tears its fixtures down
# (tests/conftest.py), so no control plane, real node or cluster outlives the run; then the rest.
stop_lanes() {
  local pid tiers=()
  for pid in "$@"; do
    for pid in $(tree_pids "$pid"); do
      [[ $(cat "/proc/$pid/cmdline" 2>/dev/null | tr '\0' ' ') == *" -m pytest "* ]] && tiers+=("$pid")
    done
  done
  if ((${#tiers[@]})); then
    kill "${tiers[@]}" 2>/dev/null || true
    local alive=1
    for _ in $(seq 300); do
      alive=0
      for pid in "${tiers[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
      ((alive)) || break
      sleep 1
    done
  fi
  for pid in "$@"; do kill_tree "$pid"; done
}

started_all=$SECONDS
step - "system packages + virtualenv" $MAKE --no-print-directory venv
builds &
builder=$!
declare -a running=("$builder")
# The kind suite deletes its cluster when done; a run that stops before leaves none behind either.
cleaned=0
clean_up() {
  ((cleaned)) && return 0
  cleaned=1
  stop_lanes "${running[@]}"
  hack/kind-cluster.sh down "$KIND_CLUSTER" || true
}
trap clean_up EXIT

step - "lint + format" $MAKE --no-print-directory lint
step - "mypy --strict" $MAKE --no-print-directory typecheck
step - "unit tier" $MAKE --no-print-directory test-unit

# Each lane's lines carry its letter; a lane's log is also kept whole in $logs.
(set -o pipefail; lane_a 2>&1 | tee "$logs/lane-a.log" | sed -u 's/^/[A] /') &
lane_a_pid=$!
(set -o pipefail; lane_b 2>&1 | tee "$logs/lane-b.log" | sed -u 's/^/[B] /') &
lane_b_pid=$!
running+=("$lane_a_pid" "$lane_b_pid")
lanes_started=$SECONDS
pending=("$lane_a_pid" "$lane_b_pid")
while ((${#pending[@]})); do
  finished=
  if ! wait -n -p finished "${pending[@]}"; then
    # The other lane's teardown prints as it stops, so the failed lane's end is printed after it: the
    # last lines of the run say what failed.
    failed_lane=B failed_log=$logs/lane-b.log
    [[ $finished == "$lane_a_pid" ]] && failed_lane=A failed_log=$logs/lane-a.log
    clean_up
    echo >&2
    echo "error: lane $failed_lane failed and the other was stopped; the end of its log ($failed_log):" >&2
    tail -n 80 "$failed_log" | sed 's/^/['"$failed_lane"'] /' >&2
    exit 1
  fi
  left=()
  for pid in "${pending[@]}"; do [[ $pid == "$finished" ]] || left+=("$pid"); done
  pending=("${left[@]}")
done
record - "lanes A and B side by side" $((SECONDS - lanes_started))

echo
echo "=== make test: seconds per step (lane: A, B, or - for the shared steps; build logs: $logs)"
cat "$logs/timings"
for stage in control-plane node venv-lowest images kind-rootfs kind kind-cluster; do
  record - "($stage builds, in the background)" "$(cat "$logs/$stage.done")"
  tail -n 1 "$logs/timings"
done
printf '%-7s %-44s %5d s\n' - "total" $((SECONDS - started_all))
