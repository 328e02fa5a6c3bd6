"""The one module of the operator that talks to the Kubernetes API.

Everything else hands it plain dicts. The official client's transport (auth, TLS, token refresh) is used,
but not its generated models: the body of a pod goes out as the builder's dict and comes back as JSON, so
a 1024-rank job does not pay for 2048 model conversions. Blocking calls run on a bounded thread pool, so
children are created concurrently (`concurrency` requests in flight) while the asyncio loop stays free.

It knows paths, verbs and how answers map to errors, nothing of what a DDPJob means. Idempotence, as
docs/operator.md ("Idempotence") states it: a 409 on create is success when the caller's `accept_existing` says what exists is
its own (ownership.py decides that) and `ForeignObjectExists` otherwise; a 404 on delete is success. A
403 on pod create is `PodCreateForbidden`, a 400/422 on any create `ChildInvalid`, both carrying the
apiserver's message.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack
from urllib.parse import quote, urlencode

from ddp_operator import names

logger = logging.getLogger(__name__)

JsonDict = dict[str, Any]
# (the object wanted, the object found under its name) -> whether the found one will do.
AcceptExisting = Callable[[Mapping[str, Any], Mapping[str, Any]], bool]

DDP_GROUP = names.API_GROUP
DDP_VERSION = names.API_VERSION
DDP_PLURAL = names.PLURAL

# kind -> REST plural for the core/v1 children the operator creates.
_CORE_PLURALS: dict[str, str] = {
    "Pod": "pods",
    "Service": "services",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "Event": "events",
}
# kind -> (group/version, REST plural) for the children of named API groups.
_GROUP_PLURALS: dict[str, tuple[str, str]] = {
    "NetworkPolicy": ("networking.k8s.io/v1", "networkpolicies"),
    # The in-tree gang (gang.py writes the one version it supports).
    "Workload": ("scheduling.k8s.io/v1alpha2", "workloads"),
    "PodGroup": ("scheduling.k8s.io/v1alpha2", "podgroups"),
    # Kueue's objects the operator reads (kueue.py) and the group's Workload it deletes with the job.
    "KueueWorkload": ("kueue.x-k8s.io/v1beta2", "workloads"),
    "LocalQueue": ("kueue.x-k8s.io/v1beta2", "localqueues"),
}


class ApiError(Exception):
    """A non-2xx answer; `message` is the apiserver's own Status message when it sent one."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.failed_object: Mapping[str, Any] | None = None


class PodCreateForbidden(ApiError):
    """The apiserver refused to create a rank pod (403): Pod Security admission, a ResourceQuota..."""


class ChildInvalid(ApiError):
    """The apiserver refused a child as invalid (400, 422): the job's spec yields an object it rejects."""


class ForeignObjectExists(ApiError):
    """A child's name is taken by an object that is not this job's (another owner UID or attempt)."""


class Conflict(ApiError):
    """409 on an update: the object changed since it was read (its resourceVersion is older)."""


class ResourceVersionGone(ApiError):
    """410: the watch's resourceVersion is too old; the caller lists again."""


@dataclass
class CreateReport:
    """What `create_children` did: objects it created, objects that were already ours, the first error."""

    created: list[JsonDict] = field(default_factory=list)
    existing: list[JsonDict] = field(default_factory=list)
    error: ApiError | None = None
    failed: Mapping[str, Any] | None = None  # the object whose create raised `error`


def _status_message(status: int, reason: str, body: bytes | str | None) -> ApiError:
    message = ""
    status_reason = reason
    if body:
        try:
            decoded = json.loads(body)
        except ValueError:
            message = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
        else:
            if isinstance(decoded, dict):
                message = str(decoded.get("message", ""))
                status_reason = str(decoded.get("reason", reason) or reason)
    if status == 410:
        return ResourceVersionGone(status, status_reason, message)
    return ApiError(status, status_reason, message)


def merge_patch_for(old: Mapping[str, Any], new: Mapping[str, Any]) -> JsonDict:
    """A JSON merge patch (RFC 7386) turning `old` into `new`. The server merges objects key by key at
    every depth, so a key gone from `new` is sent as null wherever it was, in a nested object too (sent
    whole, a nested object would keep its old keys: status.progress.healthCheck kept a slowRank the
    last check no longer had). Lists are replaced whole."""
    patch: JsonDict = {}
    for key, value in new.items():
        before = old.get(key)
        if before == value:
            continue
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            patch[key] = merge_patch_for(before, value)
        else:
            patch[key] = value
    for key in old:
        if key not in new:
            patch[key] = None
    return patch


class _Payload(TypedDict, total=False):
    """What a request carries besides its verb and path: the query (None values left out), the body
    and its content type (JSON unless said)."""

    query: Mapping[str, Any] | None
    body: Any
    content_type: str


def _child_path(namespace: str, kind: str, name: str | None = None) -> str:
    """The REST path of a namespaced child kind: /api/v1/... for core kinds, /apis/<group>/... otherwise."""
    if kind in _GROUP_PLURALS:
        group_version, plural = _GROUP_PLURALS[kind]
        prefix = f"/apis/{group_version}"
    else:
        prefix, plural = "/api/v1", _CORE_PLURALS[kind]
    path = f"{prefix}/namespaces/{quote(namespace, safe='')}/{plural}"
    return f"{path}/{quote(name, safe='')}" if name else path


def _job_path(namespace: str, name: str, subresource: str = "") -> str:
    path = f"/apis/{DDP_GROUP}/{DDP_VERSION}/namespaces/{quote(namespace, safe='')}/{DDP_PLURAL}/{quote(name, safe='')}"
    return f"{path}/{subresource}" if subresource else path


def _lease_path(namespace: str, name: str | None = None) -> str:
    path = f"/apis/coordination.k8s.io/v1/namespaces/{quote(namespace, safe='')}/leases"
    return f"{path}/{quote(name, safe='')}" if name else path


def _pods_path(namespace: str | None) -> str:
    return f"/api/v1/namespaces/{quote(namespace, safe='')}/pods" if namespace else "/api/v1/pods"


class PodLogStream:
    """An open pod log: its lines (bytes decoded, newline dropped) as they arrive; ``close()`` from
    another thread ends the iteration (a follower switching to a newer pod of the rank)."""

    def __init__(self, response: Any) -> None:
        self._response = response
        self._closed = False

    def lines(self) -> Iterator[str]:
        pending = b""
        try:
            for chunk in self._response.stream(4096, decode_content=True):
                pending += chunk
                *complete, pending = pending.split(b"\n")
                for line in complete:
                    yield line.decode("utf-8", errors="replace")
            if pending:
                yield pending.decode("utf-8", errors="replace")
        except Exception:  # the connection closed under the read: by close(), or the kubelet went
            if not self._closed:
                raise
        finally:
            self._closed = True
            self._response.release_conn()

    def close(self) -> None:
        """End the read; nothing when it has ended already (its connection is back in the pool)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._response.shutdown()
        except AttributeError:  # urllib3 before 2.3: closing the connection ends the read too
            self._response.close()
        except RuntimeError:  # the read ended meanwhile and released its connection: nothing to end
            pass


class KubeApi:
    """Blocking request primitives plus their asyncio wrappers on a bounded pool of `concurrency` threads."""

    def __init__(self, api_client: Any, concurrency: int = 32) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self._client = api_client
        self.concurrency = concurrency
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=concurrency, thread_name_prefix="kube-api"
        )

    @classmethod
    def connect(
        cls, kubeconfig: str | None = None, concurrency: int = 32, context: str | None = None
    ) -> KubeApi:
        """In-cluster service account when there is one and neither a kubeconfig nor a context was
        named, else the kubeconfig ($KUBECONFIG or ~/.kube/config when None) and its ``context`` (None:
        its current context)."""
        from kubernetes import client, config

        configuration = client.Configuration()
        if kubeconfig is None and context is None:
            try:
                config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            except config.ConfigException:
                config.load_kube_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=kubeconfig, context=context, client_configuration=configuration
            )
        # One connection per worker thread, so `concurrency` requests really are in flight together.
        configuration.connection_pool_maxsize = concurrency + 4
        api_client = client.ApiClient(configuration)
        api_client.user_agent = "ddp-operator"
        return cls(api_client, concurrency=concurrency)

    def connection(self) -> dict[str, Any]:
        """What kopf needs to log in with the same credentials: server, CA, client cert or bearer token."""
        configuration = self._client.configuration
        header = configuration.get_api_key_with_prefix(
            "BearerToken"
        ) or configuration.get_api_key_with_prefix("authorization")
        scheme, _, token = (header or "").rpartition(" ")
        return {
            "server": configuration.host,
            "ca_path": configuration.ssl_ca_cert,
            "insecure": not configuration.verify_ssl,
            "certificate_path": configuration.cert_file,
            "private_key_path": configuration.key_file,
            "scheme": scheme or ("Bearer" if token else None),
            "token": token or None,
        }

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    # ---- blocking primitives -------------------------------------------------------------------

    def _send(
        self,
        method: str,
        path: str,
        *,
        timeout: float | tuple[float, float | None] | None = 60.0,
        **what: Unpack[_Payload],
    ) -> Any:
        """One request; returns the raw response (not read) or raises ApiError for a non-2xx answer."""
        query, body = what.get("query"), what.get("body")
        headers = {"Accept": "application/json", "Content-Type": what.get("content_type", "application/json")}
        method, url, headers, _, _ = self._client.param_serialize(
            method=method, resource_path=path, header_params=headers, auth_settings=["BearerToken"]
        )
        if query:
            url += "?" + urlencode({key: value for key, value in query.items() if value is not None})
        response = self._client.call_api(
            method,
            url,
            header_params=headers,
            body=body,
            _request_timeout=timeout,
        )
        if not 200 <= response.status < 300:
            raise _status_message(response.status, response.reason, response.read())
        return response

    def request(self, method: str, path: str, **what: Unpack[_Payload]) -> JsonDict:
        """One request, its JSON answer decoded ({} for an empty one)."""
        data = self._send(method, path, **what).read()
        decoded: JsonDict = json.loads(data) if data else {}
        return decoded

    def create_child_blocking(
        self, obj: Mapping[str, Any], accept_existing: AcceptExisting
    ) -> tuple[JsonDict, bool]:
        """Create one child; (object, True) when created, (existing, False) when `accept_existing` took it."""
        meta = obj["metadata"]
        namespace, name, kind = meta["namespace"], meta["name"], obj["kind"]
        try:
            return self.request("POST", _child_path(namespace, kind), body=obj), True
        except ApiError as error:
            if error.status == 403 and kind == "Pod":
                raise PodCreateForbidden(error.status, error.reason, error.message) from None
            if error.status in (400, 422):
                raise ChildInvalid(error.status, error.reason, error.message) from None
            if error.status != 409:
                raise
        existing = self.request("GET", _child_path(namespace, kind, name))
        if not accept_existing(obj, existing):
            raise ForeignObjectExists(
                409, "AlreadyExists", f"{kind} {namespace}/{name} exists and does not belong to this job"
            )
        return existing, False

    def patch_child_blocking(
        self, namespace: str, kind: str, name: str, patch: Mapping[str, Any]
    ) -> JsonDict:
        """Merge-patch one child."""
        return self.request(
            "PATCH",
            _child_path(namespace, kind, name),
            body=dict(patch),
            content_type="application/merge-patch+json",
        )

    def resize_cpu_blocking(self, namespace: str, pod: str, container: str, cpu: str) -> JsonDict:
        """Set one container's CPU request through the pod's resize subresource (in-place resize: the
        kubelet changes the running container's CPU shares; no restart)."""
        patch = {"spec": {"containers": [{"name": container, "resources": {"requests": {"cpu": cpu}}}]}}
        return self.request(
            "PATCH",
            f"{_child_path(namespace, 'Pod', pod)}/resize",
            body=patch,
            content_type="application/strategic-merge-patch+json",
        )

    def delete_blocking(
        self, namespace: str, kind: str, name: str, grace_seconds: int | None = None
    ) -> JsonDict | None:
        """Delete one child; the object as the apiserver left it (deletionTimestamp set), None when gone.

        ``grace_seconds=0``: at once, without waiting for a kubelet to confirm (a force delete).
        """
        body: JsonDict = {"propagationPolicy": "Background"}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        try:
            result = self.request("DELETE", _child_path(namespace, kind, name), body=body)
        except ApiError as error:
            if error.status == 404:
                return None
            raise
        # A pod with a grace period comes back as the pod; one deleted at once comes back as a Status.
        return result if result.get("kind") not in (None, "Status") else None

    def get_lease_blocking(self, namespace: str, name: str) -> JsonDict | None:
        """The coordination.k8s.io Lease, None when there is none."""
        try:
            return self.request("GET", _lease_path(namespace, name))
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    def write_lease_blocking(self, lease: Mapping[str, Any], create: bool) -> JsonDict:
        """Create the Lease, or replace it (its metadata.resourceVersion is the precondition).

        Raises `Conflict` when someone else created or changed it first.
        """
        meta = lease["metadata"]
        try:
            if create:
                return self.request("POST", _lease_path(meta["namespace"]), body=dict(lease))
            return self.request("PUT", _lease_path(meta["namespace"], meta["name"]), body=dict(lease))
        except ApiError as error:
            if error.status == 409:
                raise Conflict(error.status, error.reason, error.message) from None
            raise

    def list_pods_blocking(self, namespace: str | None, label_selector: str) -> tuple[list[JsonDict], str]:
        """All pods matching the selector (paged), and the list's resourceVersion to watch from."""
        items: list[JsonDict] = []
        continue_token: str | None = None
        while True:
            page = self.request(
                "GET",
                _pods_path(namespace),
                query={"labelSelector": label_selector, "limit": 500, "continue": continue_token},
            )
            items.extend(page.get("items") or [])
            list_meta = page.get("metadata") or {}
            continue_token = list_meta.get("continue")
            if not continue_token:
                return items, str(list_meta.get("resourceVersion", ""))

    def watch_pods_blocking(
        self, namespace: str | None, label_selector: str, resource_version: str, timeout_seconds: int = 300
    ) -> Iterator[JsonDict]:
        """Watch events (type, object) from `resource_version`, bookmarks included; ends at the timeout."""
        from kubernetes.watch.watch import iter_resp_lines

        response = self._send(
            "GET",
            _pods_path(namespace),
            query={
                "watch": "true",
                "labelSelector": label_selector,
                "resourceVersion": resource_version,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": timeout_seconds,
            },
            # No read timeout beyond the server's own: bookmarks arrive about once a minute.
            timeout=(10.0, float(timeout_seconds + 30)),
        )
        try:
            for line in iter_resp_lines(response.response):  # type: ignore[no-untyped-call]
                event: JsonDict = json.loads(line)
                if event.get("type") == "ERROR":
                    status = event.get("object") or {}
                    raise _status_message(int(status.get("code", 500)), str(status.get("reason", "")), line)
                yield event
        finally:
            response.response.release_conn()

    # ---- what the job commands read (`ddpjob get|describe|logs|top|wait`, docs/cli.md) ----------

    def get_job_blocking(self, namespace: str, name: str) -> JsonDict | None:
        """The DDPJob as stored, None when there is none."""
        try:
            return self.request("GET", _job_path(namespace, name))
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    def list_jobs_blocking(self, namespace: str | None) -> list[JsonDict]:
        """Every DDPJob of ``namespace`` (None: of every namespace)."""
        prefix = f"/apis/{DDP_GROUP}/{DDP_VERSION}"
        path = (
            f"{prefix}/namespaces/{quote(namespace, safe='')}/{DDP_PLURAL}"
            if namespace
            else f"{prefix}/{DDP_PLURAL}"
        )
        items: list[JsonDict] = self.request("GET", path).get("items") or []
        return items

    def list_events_blocking(
        self, namespace: str, kind: str, name: str, uid: str | None = None
    ) -> list[JsonDict]:
        """The core/v1 Events about one object (its kind and name, and its UID when given: a deleted
        and recreated job's Events are not its own)."""
        selector = f"involvedObject.kind={kind},involvedObject.name={name}"
        if uid:
            selector += f",involvedObject.uid={uid}"
        items: list[JsonDict] = (
            self.request("GET", _child_path(namespace, "Event"), query={"fieldSelector": selector}).get(
                "items"
            )
            or []
        )
        return items

    def pod_log_stream(
        self,
        namespace: str,
        pod: str,
        container: str,
        *,
        follow: bool,
        since_time: str | None = None,
        tail_lines: int | None = None,
    ) -> PodLogStream:
        """A container's log through the kubelet, each line with the kubelet's RFC 3339 timestamp;
        with ``follow``, open until the container stops or ``close()``."""
        query: dict[str, Any] = {
            "container": container,
            "timestamps": "true",
            "follow": "true" if follow else None,
            "sinceTime": since_time,
            "tailLines": tail_lines,
        }
        response = self._send(
            "GET",
            f"{_child_path(namespace, 'Pod', pod)}/log",
            query=query,
            # No read timeout while following: a quiet rank writes nothing for minutes.
            timeout=(10.0, None) if follow else 60.0,
        )
        return PodLogStream(response.response)

    def pod_proxy_text(self, namespace: str, pod: str, port: int, path: str, timeout: float = 5.0) -> str:
        """GET ``path`` of a pod's ``port`` through the apiserver's pod proxy (RBAC: pods/proxy get),
        for a client that cannot reach the pod network."""
        target = f"{_child_path(namespace, 'Pod')}/{quote(pod, safe='')}:{port}"
        response = self._send("GET", f"{target}/proxy{path}", timeout=timeout)
        text: str = response.read().decode("utf-8", errors="replace")
        return text

    # ---- asyncio wrappers ----------------------------------------------------------------------

    async def resize_cpu(self, namespace: str, pod: str, container: str, cpu: str) -> JsonDict:
        result: JsonDict = await self._run(self.resize_cpu_blocking, namespace, pod, container, cpu)
        return result

    async def core_resources(self) -> list[str]:
        """The core API's resources and subresources the apiserver serves (discovery), e.g. "pods/resize"."""
        answer: JsonDict = await self._run(lambda: self.request("GET", "/api/v1"))
        return [str(resource.get("name")) for resource in answer.get("resources") or []]

    async def group_versions(self) -> list[str]:
        """Every API group version the apiserver serves (discovery), e.g. "scheduling.k8s.io/v1alpha2"."""
        answer: JsonDict = await self._run(lambda: self.request("GET", "/apis"))
        return [
            str(version.get("groupVersion"))
            for group in answer.get("groups") or []
            for version in group.get("versions") or []
        ]

    async def dry_run_create(self, obj: Mapping[str, Any]) -> JsonDict:
        """What the apiserver would store for ``obj`` (a create with ``dryRun=All``: nothing is kept)."""
        meta = obj["metadata"]
        path = _child_path(meta["namespace"], obj["kind"])
        answer: JsonDict = await self._run(
            lambda: self.request("POST", path, query={"dryRun": "All"}, body=obj)
        )
        return answer

    async def warm_up(self) -> None:
        """Start every worker thread and open its connection now (best effort).

        Otherwise the first job after a start pays for `concurrency` thread starts and TLS handshakes
        inside its creates: at 64 ranks on a loaded 2-core machine that was a fifth of a second. The
        workers meet at a barrier first, so each request runs on its own thread and connection.
        """
        barrier = threading.Barrier(self.concurrency)

        def touch() -> None:
            try:
                barrier.wait(timeout=10)
                self._send("GET", "/version", timeout=5.0).read()
            except Exception as error:  # urllib3's errors too: a cold pool is slower, never broken
                logger.debug("warm-up request failed: %s", error)

        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self._pool, touch) for _ in range(self.concurrency)))

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def create_children(
        self,
        objects: Sequence[Mapping[str, Any]],
        accept_existing: AcceptExisting,
        on_result: Callable[[JsonDict, bool], None] | None = None,
    ) -> CreateReport:
        """Create children concurrently; stop starting new ones after the first error.

        `on_result(obj, created)` runs on the loop as each answer arrives, so the caller's cache learns
        of every pod at once instead of waiting for the watch (and a second reconcile does not create
        them again).
        """
        report = CreateReport()
        stop = False

        def create_one(obj: Mapping[str, Any]) -> tuple[JsonDict, bool] | None:
            if stop:
                return None
            try:
                return self.create_child_blocking(obj, accept_existing)
            except ApiError as error:
                error.failed_object = obj
                raise

        loop = asyncio.get_running_loop()
        futures = [loop.run_in_executor(self._pool, create_one, obj) for obj in objects]
        for next_done in asyncio.as_completed(futures):
            try:
                result = await next_done
            except ApiError as error:
                stop = True
                if report.error is None:
                    report.error = error
                    report.failed = error.failed_object
                continue
            if result is None:
                continue
            obj, created = result
            (report.created if created else report.existing).append(obj)
            if on_result is not None:
                on_result(obj, created)
        return report

    async def delete_children(
        self, namespace: str, kind: str, names: Sequence[str], grace_seconds: int | None = None
    ) -> list[tuple[str, JsonDict | None]]:
        """Delete children concurrently; (name, object-after-delete or None when gone) per name."""
        results = await asyncio.gather(
            *(self._run(self.delete_blocking, namespace, kind, n, grace_seconds) for n in names)
        )
        return list(zip(names, results, strict=True))

    async def node_labels(self, name: str) -> dict[str, str] | None:
        """A node's labels, None when the node is gone."""
        try:
            node: JsonDict = await self._run(
                lambda: self.request("GET", f"/api/v1/nodes/{quote(name, safe='')}")
            )
        except ApiError as error:
            if error.status == 404:
                return None
            raise
        labels = (node.get("metadata") or {}).get("labels") or {}
        return {str(key): str(value) for key, value in labels.items()}

    async def get_child(self, namespace: str, kind: str, name: str) -> JsonDict | None:
        """One object, None when it (or its API) is not there."""
        try:
            result: JsonDict = await self._run(
                lambda: self.request("GET", _child_path(namespace, kind, name))
            )
        except ApiError as error:
            if error.status == 404:
                return None
            raise
        return result

    async def remove_finalizer(
        self, namespace: str, kind: str, name: str, finalizers: Sequence[str], finalizer: str
    ) -> bool:
        """Drop ``finalizer`` from an object whose finalizers were ``finalizers``; False when the object
        is gone or its finalizers changed meanwhile (the JSON patch tests them first: nobody else's
        finalizer is ever dropped)."""
        if finalizer not in finalizers:
            return False
        patch = [
            {"op": "test", "path": "/metadata/finalizers", "value": list(finalizers)},
            {
                "op": "replace",
                "path": "/metadata/finalizers",
                "value": [f for f in finalizers if f != finalizer],
            },
        ]
        try:
            await self._run(
                lambda: self.request(
                    "PATCH",
                    _child_path(namespace, kind, name),
                    body=patch,
                    content_type="application/json-patch+json",
                )
            )
        except ApiError as error:
            if error.status in (404, 409, 422):
                return False
            raise
        return True

    async def patch_job_status(self, namespace: str, name: str, status_patch: Mapping[str, Any]) -> JsonDict:
        """Merge-patch the DDPJob's status subresource; returns the job as stored afterwards."""
        result: JsonDict = await self._run(
            lambda: self.request(
                "PATCH",
                _job_path(namespace, name, "status"),
                body={"status": dict(status_patch)},
                content_type="application/merge-patch+json",
            )
        )
        return result

    async def get_job(self, namespace: str, name: str) -> JsonDict | None:
        """The DDPJob as stored, None when there is none."""
        result: JsonDict | None = await self._run(self.get_job_blocking, namespace, name)
        return result

    async def delete_job(self, namespace: str, name: str, uid: str) -> None:
        """Delete the DDPJob (TTL); its children go by garbage collection. 404 and a new UID are success."""
        body = {"propagationPolicy": "Background", "preconditions": {"uid": uid}}
        try:
            await self._run(lambda: self.request("DELETE", _job_path(namespace, name), body=body))
        except ApiError as error:
            if error.status not in (404, 409):
                raise

    async def patch_child(self, namespace: str, kind: str, name: str, patch: Mapping[str, Any]) -> JsonDict:
        result: JsonDict = await self._run(self.patch_child_blocking, namespace, kind, name, patch)
        return result

    async def create_event(self, event: Mapping[str, Any]) -> None:
        """Post a core/v1 Event (builders.build_event makes one)."""
        namespace = str((event.get("metadata") or {}).get("namespace", "default"))
        await self._run(lambda: self.request("POST", _child_path(namespace, "Event"), body=dict(event)))

    async def list_pods(self, namespace: str | None, label_selector: str) -> tuple[list[JsonDict], str]:
        result: tuple[list[JsonDict], str] = await self._run(
            self.list_pods_blocking, namespace, label_selector
        )
        return result
