"""Node-side use cases: open a pinned session, record contact, quarantine, health, inventory."""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

from django.db import transaction
from django.utils import timezone

from marketplace.models import Gpu, GpuModel, Node, NodeState
from marketplace.models.nodes import LISTABLE_VERDICTS
from marketplace.services.nodes import node_private_key
from provisioning.concurrency import node_slot
from provisioning.models import NodeEvent
from provisioning.ssh import Endpoint, HostKeyMismatch, NodeError, NodeSession, Timeouts

log = logging.getLogger(__name__)

OFFLINE_AFTER_FAILED_CHECKS = 3
# States in which the platform talks to a node on its own (health checks, reconciling).
WATCHED_STATES = (NodeState.ACTIVE, NodeState.OFFLINE, NodeState.MAINTENANCE)


def node_endpoint(node: Node) -> Endpoint:
    return Endpoint(
        address=node.address, port=node.ssh_port, user=node.ssh_user,
        private_key=node_private_key(node=node), host_key_fingerprint=node.host_key_fingerprint,
    )


def node_event(node: Node, kind: str, message: str, level: str = NodeEvent.Level.INFO) -> NodeEvent:
    return NodeEvent.objects.create(node=node, kind=kind, message=message, level=level)


@contextlib.contextmanager
def node_session(node: Node, timeouts: Timeouts | None = None):
    """A pinned SSH session to `node` inside the per-node concurrency cap.

    On first contact the host key is recorded and pinned from then on; a changed
    key quarantines the node and re-raises HostKeyMismatch.
    """
    with node_slot(node.pk):
        session = NodeSession(node_endpoint(node), timeouts)
        try:
            session.connect()
        except HostKeyMismatch as exc:
            node_quarantine(node_id=node.pk, seen=exc.seen)
            raise
        try:
            if not node.host_key_fingerprint and session.seen_fingerprint:
                _pin_host_key(node, session.seen_fingerprint)
            yield session
        finally:
            session.close()


def _pin_host_key(node: Node, fingerprint: str) -> None:
    # Only the first writer pins; a concurrent session that saw another key loses.
    pinned = Node.objects.filter(pk=node.pk, host_key_fingerprint="").update(host_key_fingerprint=fingerprint)
    node.refresh_from_db(fields=["host_key_fingerprint"])
    if pinned:
        node_event(node, "host_key_pinned", f"Host key {fingerprint} recorded on first contact and pinned.")
    elif node.host_key_fingerprint != fingerprint:
        node_quarantine(node_id=node.pk, seen=fingerprint)
        raise HostKeyMismatch(node.host_key_fingerprint, fingerprint)


@transaction.atomic
def node_quarantine(*, node_id: int, seen: str) -> None:
    node = Node.objects.select_for_update().get(pk=node_id)
    node.seen_host_key_fingerprint = seen
    node.last_error = (
        f"The server's SSH host key changed (expected {node.host_key_fingerprint}, got {seen}). "
        "The node is quarantined until an operator confirms the new key."
    )
    if node.state != NodeState.QUARANTINED and node.can_transition_to(NodeState.QUARANTINED):
        node.transition_to(NodeState.QUARANTINED)
    node.save()
    node_event(node, "host_key_changed", node.last_error, NodeEvent.Level.CRITICAL)


@transaction.atomic
def node_accept_host_key(*, node: Node, operator_email: str) -> None:
    """An operator confirms a quarantined node's new host key: pin it and verify again."""
    node = Node.objects.select_for_update().get(pk=node.pk)
    if node.state != NodeState.QUARANTINED or not node.seen_host_key_fingerprint:
        return
    old, node.host_key_fingerprint = node.host_key_fingerprint, node.seen_host_key_fingerprint
    node.seen_host_key_fingerprint = ""
    node.last_error = ""
    node.save()
    node_event(node, "host_key_accepted", f"{operator_email} accepted host key {node.host_key_fingerprint} "
                                          f"(was {old}).", NodeEvent.Level.WARNING)
    from provisioning.services.verification import node_verify_request

    node_verify_request(node=node)


@dataclass
class HealthResult:
    node_id: int
    ok: bool
    error: str = ""
    seconds: float = 0.0
    inventory_hash: str | None = None  # the agent's digest of its GPUs (a change triggers a re-verification)


def node_record_health(*, node_id: int, ok: bool, error: str = "", inventory_hash: str | None = None) -> None:
    """Apply one health check: offline after N failures in a row, back when it answers."""
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node_id)
        now = timezone.now()
        if ok:
            node.health_failures = 0
            node.last_seen_at = now
            if node.state == NodeState.OFFLINE:
                node.transition_to(NodeState.ACTIVE if node.verdict in LISTABLE_VERDICTS else NodeState.PENDING)
                node.last_error = ""
                node_event(node, "back_online", "The node answers health checks again.")
        else:
            node.health_failures += 1
            node.last_error = error
            if node.health_failures >= OFFLINE_AFTER_FAILED_CHECKS and node.can_transition_to(NodeState.OFFLINE) \
                    and node.state != NodeState.OFFLINE:
                node.transition_to(NodeState.OFFLINE)
                node_event(node, "offline", f"{node.health_failures} health checks failed in a row: {error}",
                           NodeEvent.Level.WARNING)
        node.save()
    from provisioning.services.reliability import node_health_observed

    node_health_observed(node_id=node_id, ok=ok, inventory_hash=inventory_hash)


def node_health_probe(node: Node, timeouts: Timeouts | None = None) -> HealthResult:
    """One `health` round trip to the node (no database writes)."""
    start = time.monotonic()
    try:
        with node_session(node, timeouts or Timeouts(connect=5, command=20, attempts=1)) as session:
            answer = session.agent("health")
        return HealthResult(node.pk, True, seconds=time.monotonic() - start,
                            inventory_hash=answer.get("inventory_hash"))
    except NodeError as exc:
        return HealthResult(node.pk, False, exc.message, time.monotonic() - start)


@transaction.atomic
def node_apply_inventory(*, node: Node, inventory: dict) -> None:
    """Store the agent's inventory and update the node's GPU rows with what was read."""
    node = Node.objects.select_for_update().get(pk=node.pk)
    node.inventory = inventory
    node.last_seen_at = timezone.now()
    node.save(update_fields=["inventory", "last_seen_at", "updated_at"])
    reported = inventory.get("gpus", [])
    models = {m.smi_name: m for m in GpuModel.objects.filter(smi_name__in={g.get("name") for g in reported})}
    rows = {gpu.index: gpu for gpu in node.gpus.all()}
    changed = []
    for gpu_info in reported:
        gpu = rows.get(gpu_info.get("index"))
        if gpu is None:
            continue  # more GPUs than declared: the verification reports it
        gpu.uuid = gpu_info.get("uuid") or ""
        gpu.pci_bus_id = gpu_info.get("pci_bus_id") or ""
        gpu.memory_mib = gpu_info.get("memory_total_mib") or gpu.memory_mib
        gpu.gpu_model = models.get(gpu_info.get("name")) or gpu.gpu_model
        changed.append(gpu)
    Gpu.objects.bulk_update(changed, ["uuid", "pci_bus_id", "memory_mib", "gpu_model"])
