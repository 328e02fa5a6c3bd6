#!/usr/bin/env bash
# `make test`: lint, types and the four tiers, with the builds the later tiers need running beside the
# earlier tiers instead of before them (docs/testing.md, "How the run is laid out").
#
#   foreground:  venv -> lint, mypy -> unit -> trainer -> integration ----------> e2e
#   background:  (niced) Kubernetes, Kueue -> node binaries, kube-router, images, kind
#
# The builds are mostly compiles and downloads; the tiers are mostly processes waiting on each other
# (rendezvous, kubelets' reports, decision windows), so the two share 2 cores well. The builds run at a
# lower priority, so a tier's processes get the CPU first. A tier starts once what it needs is built;
# a failed build fails the run with its log. Each step's seconds are printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

MAKE=${MAKE:-make}
logs=$(mktemp -d "${TMPDIR:-/tmp}/ddp-test-all.XXXXXX")
declare -a timings=()

step() { # name command... : runs in the foreground, timed
  local name=$1 started=$SECONDS
  shift
  echo ">>> ${name}"
  "$@"
  timings+=("$(printf '%-34s %5d s' "$name" $((SECONDS - started)))")
}

# One background chain; each stage leaves <stage>.done (or <stage>.failed) in $logs.
builds() {
  local stage
  for stage in "control-plane:k8s-binaries kueue-binary" "e2e:node-binaries kube-router images kind"; do
    local name=${stage%%:*} targets=${stage#*:} started=$SECONDS
    # shellcheck disable=SC2086
    if nice -n 10 $MAKE --no-print-directory $targets >"$logs/$name.log" 2>&1; then
      echo "$((SECONDS - started))" >"$logs/$name.done"
    else
      echo "$((SECONDS - started))" >"$logs/$name.failed"
      return 1
    fi
  done
}

wait_for_builds() { # stage
  local name=$1 started=$SECONDS
  while [[ ! -e $logs/$name.done ]]; do
    if [[ -e $logs/$name.failed ]] || ! kill -0 "$builder" 2>/dev/null; then
      [[ -e $logs/$name.done ]] && break
      echo "error: the background build '$name' failed; the end of its log ($logs/$name.log):" >&2
      tail -n 60 "$logs/$name.log" >&2 || true
      exit 1
    fi
    sleep 2
  done
  timings+=("$(printf '%-34s %5d s' "waited for the $name builds" $((SECONDS - started)))")
  timings+=("$(printf '%-34s %5d s' "  ($name builds, in the background)" "$(cat "$logs/$name.done")")")
}

# A failed tier ends the run: the builds still running beside it end with it.
kill_tree() {
  local child
  for child in $(pgrep -P "$1" 2>/dev/null); do kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}

started_all=$SECONDS
step "system packages + virtualenv" $MAKE --no-print-directory venv
builds &
builder=$!
trap 'kill_tree "$builder"' EXIT

step "lint + format" $MAKE --no-print-directory lint
step "mypy --strict" $MAKE --no-print-directory typecheck
step "unit tier" $MAKE --no-print-directory test-unit
step "trainer tier" $MAKE --no-print-directory test-trainer
wait_for_builds control-plane
step "integration tier" $MAKE --no-print-directory test-integration
wait_for_builds e2e
step "e2e tier" $MAKE --no-print-directory test-e2e

echo
echo "=== make test: seconds per step (build logs: $logs)"
printf '%s\n' "${timings[@]}"
printf '%-34s %5d s\n' "total" $((SECONDS - started_all))
