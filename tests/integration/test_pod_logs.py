"""Pod logs through the real apiserver for pods on kwok's fake nodes (harness/ddp_harness/kwok_logs.py).

A test makes a pod print with ``Kube.write_pod_log``; clients read `GET /api/v1/namespaces/<ns>/pods/
<pod>/log` as `kubectl logs` does, plain or with ``follow=true``, through the apiserver, which dials
kwok's kubelet-like server over HTTPS. kwok never learns that a container stopped, so its follow
streams stay open after their pod is gone: a client that follows a rank across pod replacements closes
the stream when it sees the pod go, which is what the follow test does. Every wait is on an event (a
watch through `kubectl wait`, a line arriving on the stream), bounded by a timeout.
"""

from __future__ import annotations

import http.client
import queue
import re
import socket
import ssl
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlencode, urlsplit

import pytest
from tests.integration.operator_harness import Kube

from ddp_harness import LocalCluster

pytestmark = pytest.mark.integration

WAIT_S = 30.0
STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z ")  # RFC 3339, trailing zeros cut


@pytest.fixture
def kube(local_cluster: LocalCluster) -> Kube:
    return Kube(local_cluster)


@pytest.fixture
def namespace(kube: Kube) -> Iterator[str]:
    name = kube.create_namespace("logs")
    yield name
    kube.delete_namespace(name)


def log_path(namespace: str, pod: str, **params: str) -> str:
    query = f"?{urlencode(params)}" if params else ""
    return f"/api/v1/namespaces/{namespace}/pods/{pod}/log{query}"


def start_pod(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    """A one-container pod on a fake node, returned once Ready (kwok runs it)."""
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": {"rank": "0"}},
            "spec": {
                "containers": [{"name": "trainer", "image": "registry.invalid/never-pulled:1"}],
                "restartPolicy": "Never",
            },
        },
        namespace,
    )
    kube.run("wait", "-n", namespace, "--for=condition=Ready", f"pod/{name}", f"--timeout={WAIT_S:.0f}s")
    pod: dict[str, Any] = kube.json("get", "pod", name, "-n", namespace)
    return pod


def delete_pod(kube: Kube, namespace: str, name: str) -> None:
    """Delete the pod and return once it is gone (kwok confirms deletions at once)."""
    kube.run("delete", "pod", name, "-n", namespace, "--wait=false")
    kube.run("wait", "-n", namespace, "--for=delete", f"pod/{name}", f"--timeout={WAIT_S:.0f}s")


class LogStream:
    """`GET .../log?follow=true` through the apiserver with the admin's certificate, read line by line on
    a thread: each line arrives on ``lines``, then None once the stream ended."""

    def __init__(self, cluster: LocalCluster, namespace: str, pod: str) -> None:
        context = ssl.create_default_context(cafile=str(cluster.ca_cert))
        context.load_cert_chain(str(cluster.layout.cert("admin")), str(cluster.layout.key("admin")))
        server = urlsplit(cluster.apiserver)
        self._connection = http.client.HTTPSConnection(
            server.hostname or "", server.port, context=context, timeout=WAIT_S
        )
        self._connection.request("GET", log_path(namespace, pod, follow="true"))
        self._socket = self._connection.sock
        response = self._connection.getresponse()
        assert response.status == 200, (response.status, response.read())
        self._socket.settimeout(None)  # the stream is quiet between lines for as long as the pod is
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(response,), daemon=True)
        self._reader.start()

    def _read(self, response: http.client.HTTPResponse) -> None:
        try:
            while line := response.readline():
                self.lines.put(line.decode())
        except (OSError, ValueError, http.client.HTTPException):
            pass  # closed under the reader
        finally:
            self.lines.put(None)

    def next_line(self) -> str | None:
        try:
            return self.lines.get(timeout=WAIT_S)
        except queue.Empty:
            pytest.fail(f"no line on the follow stream within {WAIT_S} s")

    def close(self) -> None:
        """Hang up: the reader sees the end of the stream, and the thread ends."""
        socket.socket.shutdown(self._socket, socket.SHUT_RDWR)  # the TCP socket, under TLS
        self._reader.join(WAIT_S)
        assert not self._reader.is_alive(), "the reader did not see the stream close"
        self._connection.close()


def test_a_log_read_returns_what_the_pod_printed(
    kube: Kube, local_cluster: LocalCluster, namespace: str
) -> None:
    start_pod(kube, namespace, "rank-0")
    api = local_cluster.api()
    # Nothing printed yet: kwok has no log for the pod and says so, as a kubelet does for a container
    # that has not started.
    code, body = api.read_text(log_path(namespace, "rank-0"))
    assert code == 400 and "no logs found" in body, (code, body)

    kube.write_pod_log(namespace, "rank-0", "step 1 loss 2.0\nstep 2 loss 1.5\n")
    assert api.read_text(log_path(namespace, "rank-0")) == (200, "step 1 loss 2.0\nstep 2 loss 1.5\n")

    kube.write_pod_log(namespace, "rank-0", "step 3 loss 1.2")  # the final newline is implied
    code, body = api.read_text(log_path(namespace, "rank-0", container="trainer", tailLines="2"))
    assert (code, body) == (200, "step 2 loss 1.5\nstep 3 loss 1.2\n")
    assert api.read_text(log_path(namespace, "rank-0", limitBytes="6")) == (200, "step 1")
    code, body = api.read_text(log_path(namespace, "rank-0", timestamps="true"))
    lines = body.splitlines()
    assert code == 200 and len(lines) == 3 and all(STAMP.match(line) for line in lines), body
    assert [STAMP.sub("", line) for line in lines] == [
        "step 1 loss 2.0",
        "step 2 loss 1.5",
        "step 3 loss 1.2",
    ]


def test_a_follow_stream_returns_lines_printed_after_it_started_until_the_client_closes_it(
    kube: Kube, local_cluster: LocalCluster, namespace: str
) -> None:
    start_pod(kube, namespace, "rank-0")
    kube.write_pod_log(namespace, "rank-0", "before the client\n")
    stream = LogStream(local_cluster, namespace, "rank-0")
    try:
        assert stream.next_line() == "before the client\n"
        kube.write_pod_log(namespace, "rank-0", "step 1\nstep 2\n")
        assert stream.next_line() == "step 1\n"
        assert stream.next_line() == "step 2\n"
        kube.write_pod_log(namespace, "rank-0", "step 3")
        assert stream.next_line() == "step 3\n"
        # The pod goes: a follower that sees it go (here: the watch of `kubectl wait`) hangs up; what
        # the stream carried until then is all the pod printed.
        delete_pod(kube, namespace, "rank-0")
    finally:
        stream.close()
    assert stream.lines.get_nowait() is None


def test_a_pod_of_the_same_name_has_a_log_of_its_own(
    kube: Kube, local_cluster: LocalCluster, namespace: str
) -> None:
    first = start_pod(kube, namespace, "rank-0")
    kube.write_pod_log(namespace, "rank-0", "first pod\n")
    delete_pod(kube, namespace, "rank-0")
    second = start_pod(kube, namespace, "rank-0")
    assert second["metadata"]["uid"] != first["metadata"]["uid"]

    kube.write_pod_log(namespace, "rank-0", "second pod\n")
    assert local_cluster.api().read_text(log_path(namespace, "rank-0")) == (200, "second pod\n")
    logs = kube.json("get", "logs.kwok.x-k8s.io", "rank-0", "-n", namespace)
    assert [o["uid"] for o in logs["metadata"]["ownerReferences"]] == [second["metadata"]["uid"]]
