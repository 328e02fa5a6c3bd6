"""Faults made from a kind node, outside the pod: what a crashed node, the OOM killer or a hung device
does to a pod's processes. The kind e2e suite and the kind benchmarks share them.

Each runs a shell in the node's container (`docker exec <cluster>-control-plane`), where the pod's
processes are visible in the node's PID namespace and `crictl` reaches the node's containerd.
"""

from __future__ import annotations

import subprocess


def node_exec(cluster: str, script: str) -> str:
    """``script`` run by ``sh`` on the kind cluster's node; its stdout."""
    done = subprocess.run(
        ["docker", "exec", f"{cluster}-control-plane", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip()


def container_pid(cluster: str, namespace: str, pod: str, container: str = "trainer") -> int:
    """The PID, in the node's PID namespace, of the main process of the pod's ``container``."""
    sandboxes = node_exec(cluster, f"crictl pods --namespace {namespace} --name '^{pod}$' -q").split()
    if len(sandboxes) != 1:
        raise RuntimeError(f"the sandbox of {namespace}/{pod} on the node: {sandboxes}")
    containers = node_exec(cluster, f"crictl ps --pod {sandboxes[0]} --name '^{container}$' -q").split()
    if len(containers) != 1:
        raise RuntimeError(f"the {container} container of {namespace}/{pod} on the node: {containers}")
    template = "'{{.info.pid}}'"
    return int(
        node_exec(cluster, f"crictl inspect --output go-template --template {template} {containers[0]}")
    )


def kill_container(cluster: str, namespace: str, pod: str) -> int:
    """SIGKILL the pod's trainer container from its node, as the OOM killer of the pod's cgroup or a
    runtime's kill would: its main process (the launcher, PID 1 in the container) dies, its workers with
    it, and the launcher leaves no word. PID 1 ignores SIGKILL from inside its own PID namespace, so the
    kill comes from the node's. Returns the PID killed."""
    pid = container_pid(cluster, namespace, pod)
    node_exec(cluster, f"kill -KILL {pid}")
    return pid


def freeze_pod(cluster: str, namespace: str, pod: str) -> int:
    """SIGSTOP every process of the pod's trainer container from its node, as a hung GPU, a dead NIC or
    a stuck collective leaves them: nothing exits, no socket closes, the metrics endpoint stops
    answering. Every process in the container's PID namespace (its launcher, the forkserver, the
    workers), found by that namespace rather than by parentage (forked workers are not the launcher's
    children). Returns how many were stopped."""
    pid = container_pid(cluster, namespace, pod)
    script = (
        f"ns=$(readlink /proc/{pid}/ns/pid); n=0; for p in /proc/[0-9]*; do "
        'if [ "$(readlink $p/ns/pid 2>/dev/null)" = "$ns" ]; then kill -STOP ${p#/proc/} && n=$((n+1)); fi; '
        "done; echo $n"
    )
    return int(node_exec(cluster, script))


def throttle_cpu(cluster: str, namespace: str, pod: str, percent: int) -> str:
    """Cut the CFS quota of the pod's trainer container, from its node, to ``percent`` of one CPU: what a
    noisy neighbour, thermal throttling or a misconfigured node does to a pod whose spec asks for more.
    Every process of the container (launcher, forkserver, workers) shares its cgroup. cgroup v1 (this
    machine's): the container's directory in the node's hierarchy of the ``cpu`` controller, read from the
    main process's /proc/PID/cgroup. Returns that directory."""
    if not 0 < percent <= 100:
        raise ValueError(f"percent must be in 1..100, got {percent}")
    pid = container_pid(cluster, namespace, pod)
    # The hierarchy whose controllers include cpu (mounted alone or as cpu,cpuacct), and the container's
    # directory in it; any step that fails fails the script (set -e), so no quota is written elsewhere.
    script = (
        "set -e; "
        f'path=$(awk -F: \'{{n = split($2, c, ","); for (i = 1; i <= n; i++) if (c[i] == "cpu") print $3}}\' '
        f"/proc/{pid}/cgroup); "
        'test -n "$path"; '
        "for root in /sys/fs/cgroup/cpu /sys/fs/cgroup/cpu,cpuacct; do "
        'if [ -f "$root$path/cpu.cfs_quota_us" ]; then dir=$root$path; break; fi; done; '
        'test -n "$dir"; '
        'period=$(cat "$dir/cpu.cfs_period_us"); '
        f'echo $((period * {percent} / 100)) > "$dir/cpu.cfs_quota_us"; echo "$dir"'
    )
    return node_exec(cluster, script)


def limit_link(cluster: str, namespace: str, pod: str, rate: str) -> str:
    """Rate-limit the pod's network interface with a ``tbf`` qdisc in its network namespace, from its
    node (this kernel has no ``netem``): a degraded NIC, a flapping link negotiated down, a congested
    port. ``rate``: tc's syntax (``8mbit``). Egress only: the pod's sends go slow, which is what the
    others wait for. Returns the qdisc as ``tc`` then shows it."""
    pid = container_pid(cluster, namespace, pod)
    return node_exec(
        cluster,
        f"nsenter -t {pid} -n tc qdisc replace dev eth0 root tbf rate {rate} burst 32kb latency 200ms && "
        f"nsenter -t {pid} -n tc qdisc show dev eth0",
    )
