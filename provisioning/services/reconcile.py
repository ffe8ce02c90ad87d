"""Reconciling one node: its VMs, as the agent lists them, against the database's instances.

Run by the fleet's reconcile batches (provisioning.services.fleet), and by the health check for a node that
answers again after failures."""
from __future__ import annotations

import re
from typing import Any

from django.db.models import Q

from marketplace.models import Instance, InstanceStatus, Node
from marketplace.services import instances as instance_svc
from provisioning.models import NodeEvent
from provisioning.services.nodes import node_event, node_session
from provisioning.ssh_pool import SshPool

_VM_ID = re.compile(r"^inst-(\d+)$")


def node_reconcile(node: Node, *, pool: SshPool | None = None) -> dict[str, int]:
    """Compare the node's VMs with the database, and act on every difference:

    - a VM no instance owns is removed (an orphan), as is the VM of an instance destroyed while the node was
      unreachable (whose GPUs are then freed);
    - an interrupted instance resumes when its VM runs, is started again when its VM is stopped, and fails
      when its VM is gone; a running instance whose VM vanished fails;
    - a failed instance's VM that still runs is stopped (its GPUs were released).

    With a `pool`, over the worker's kept connection to the node (provisioning.ssh_pool).
    """
    counts = {"orphans_destroyed": 0, "instances_failed": 0, "resumed": 0, "restarted": 0, "cleaned_up": 0}
    with node_session(node, pool=pool) as session:
        vms = session.agent("vm", "list", {"runtime": node.runtime})["vms"]
        # Read the database after the node, so an instance created meanwhile is known.
        known: dict[int | None, Instance] = {
            i.pk: i for i in Instance.objects.filter(node=node).exclude(status=InstanceStatus.DESTROYED)}
        destroyed = set(Instance.objects.filter(node=node, status=InstanceStatus.DESTROYED)
                        .filter(Q(allocations__released_at__isnull=True) | Q(pk__in=_vm_instance_ids(vms)))
                        .values_list("pk", flat=True).distinct())
        seen = {}
        for vm in vms:
            match = _VM_ID.match(vm.get("vm_id", ""))
            instance_id = int(match.group(1)) if match else None
            instance = known.get(instance_id)
            if instance is None:
                session.agent("vm", "destroy", {"runtime": node.runtime, "vm_id": vm["vm_id"]})
                if instance_id in destroyed:
                    node_event(node, "vm_cleaned_up", f"Removed VM {vm['vm_id']}: its instance was destroyed "
                                                      "while the node was unreachable.")
                else:
                    node_event(node, "orphan_destroyed", f"Destroyed VM {vm['vm_id']}, which no instance owns.",
                               NodeEvent.Level.WARNING)
                    counts["orphans_destroyed"] += 1
                continue
            seen[instance.pk] = vm
            if instance.status == InstanceStatus.FAILED and vm.get("state") == "running":
                # A failed instance holds no GPUs any more: its VM must not keep using them.
                session.agent("vm", "stop", {"runtime": node.runtime, "vm_id": vm["vm_id"]})
        for instance_id in destroyed:
            counts["cleaned_up"] += bool(instance_svc.instance_cleanup_done(instance_id=instance_id))
        for instance in known.values():
            vm = seen.get(instance.pk)
            if instance.status == InstanceStatus.INTERRUPTED:
                if vm is None:
                    instance_svc.instance_mark_failed(
                        instance_id=instance.pk,
                        message="Its server answered again, but the VM was gone; the GPUs were released.")
                    counts["instances_failed"] += 1
                elif vm.get("state") == "running":
                    counts["resumed"] += instance_svc.instance_resume(instance_id=instance.pk) is not None
                else:
                    counts["restarted"] += instance_svc.instance_restart_interrupted(instance_id=instance.pk) \
                        is not None
            elif instance.status == InstanceStatus.RUNNING and vm is None:
                instance_svc.instance_mark_failed(
                    instance_id=instance.pk, message="The VM disappeared from the node; the GPUs were released."
                )
                node_event(node, "vm_vanished", f"The VM of instance {instance.pk} vanished.",
                           NodeEvent.Level.WARNING)
                counts["instances_failed"] += 1
    return counts


def _vm_instance_ids(vms: list[dict[str, Any]]) -> list[int]:
    return [int(m.group(1)) for vm in vms if (m := _VM_ID.match(vm.get("vm_id", "")))]
