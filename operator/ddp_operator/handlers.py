"""kopf wiring: thin handlers that hand events to the controller.

Only event handlers (`@kopf.on.event`) and operator activities are registered. That is deliberate:
- no `@kopf.on.delete`, no daemons or timers: kopf adds a finalizer for those, and a DDPJob must stay
  deletable with the operator uninstalled (children go by garbage collection);
- no `@kopf.on.create/update/resume`: those keep progress and a diff base in annotations, one more write
  per change; the controller is level-triggered instead (every event, including kopf's initial listing
  after a restart, ends in the same reconcile from the job's status and its pods), which covers create,
  update and resume without storing anything but `status`.
Rank pods are not watched through kopf (it would watch every pod of a namespace and filter labels on the
client): the controller's pod cache watches them with a server-side label selector.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddp_operator import names

if TYPE_CHECKING:
    from ddp_operator.controller import Controller


def build_registry(controller: Controller) -> Any:
    import kopf

    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> Any:
        # kopf logs in with exactly the credentials kube_api uses (in-cluster token or --kubeconfig).
        return kopf.ConnectionInfo(**controller.api.connection())

    @kopf.on.startup(registry=registry)
    async def start_pod_cache(**_: Any) -> None:
        await controller.start()

    @kopf.on.cleanup(registry=registry)
    async def stop_controller(**_: Any) -> None:
        await controller.stop()

    @kopf.on.event(names.API_GROUP, names.API_VERSION, names.PLURAL, registry=registry)
    async def ddpjob_event(**kwargs: Any) -> None:
        event = kwargs["event"]
        controller.job_event(event.get("type"), event["object"])

    return registry
