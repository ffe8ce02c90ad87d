"""Node-side use cases: open a pinned session, record contact, quarantine, health, inventory."""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from marketplace.models import Gpu, GpuModel, Instance, InstanceStatus, InterruptionCause, Node, NodeState
from marketplace.models.nodes import LISTABLE_VERDICTS
from marketplace.models.renting import vm_id_of
from marketplace.services import instances as instance_svc
from marketplace.services.nodes import NodeConflict, node_private_key
from provisioning.concurrency import NodeBusy, node_slot
from provisioning.models import NodeEvent
from provisioning.ssh import Endpoint, HostKeyMismatch, NodeError, NodeSession, Timeouts
from provisioning.verification.policy import Finding, duplicate_gpus, duplicate_host_key

log = logging.getLogger(__name__)

OFFLINE_AFTER_FAILED_CHECKS = 3
# States in which the platform talks to a node on its own (health checks, reconciling).
WATCHED_STATES = (NodeState.ACTIVE, NodeState.OFFLINE, NodeState.MAINTENANCE)


class DuplicateHardware(NodeError):
    """The server's host key, or one of its GPUs, belongs to another live node: the same hardware registered
    twice. Nothing was pinned or claimed; a verification rejects the node with `finding`. Not retried."""

    def __init__(self, finding: Finding):
        super().__init__(finding.message)
        self.finding = finding
        self.code = finding.code


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
    key quarantines the node and re-raises HostKeyMismatch; a key another live node
    has is not pinned and raises DuplicateHardware.
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
    # Only the first writer pins; a concurrent session that saw another key loses. A key that another live node
    # has is the same server registered twice: the unique constraint refuses it (race-free: of two first
    # contacts at once, the second waits for the first to commit, then fails) and nothing is pinned.
    try:
        with transaction.atomic():
            pinned = Node.objects.filter(pk=node.pk, host_key_fingerprint="").update(
                host_key_fingerprint=fingerprint)
    except IntegrityError as exc:
        if "node_unique_live_host_key" not in str(exc):
            raise
        raise DuplicateHardware(duplicate_host_key(fingerprint)) from None
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
    try:
        with transaction.atomic():
            node.save()
    except IntegrityError as exc:
        if "node_unique_live_host_key" not in str(exc):
            raise
        other = (Node.objects.exclude(pk=node.pk).exclude(state=NodeState.RETIRED)
                 .filter(host_key_fingerprint=node.host_key_fingerprint).values_list("pk", flat=True).first())
        raise NodeConflict(f"Node {node.pk}'s new host key {node.host_key_fingerprint} is pinned on live node "
                           f"{other}: the same server twice. Retire one of them first.") from None
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
    vms: dict[str, str] | None = None  # vm_id -> state ("running", "stopped") as the agent saw them
    probed_at: datetime | None = None  # when the probe began: instances running since then are not judged by it
    # The platform's own SSH sessions to the node were all taken (NodeBusy): nothing was learned either way (ok is
    # False only for that). Not a failed check: the health loop should count it and record nothing.
    busy: bool = False


def node_record_health(*, node_id: int, ok: bool, error: str = "", inventory_hash: str | None = None,
                       vms: dict[str, str] | None = None, probed_at: datetime | None = None,
                       running_vm_ids: set[str] | None = None) -> list[int]:
    """Apply one health check: offline after N failures in a row, back when it answers.

    A running instance is interrupted (billing closed at the node's last healthy moment) when its node has
    missed NODE_INTERRUPT_AFTER_FAILED_CHECKS checks in a row, or when the node answers but its VM is not
    running. Returns the ids of the instances interrupted by this check. `running_vm_ids` (the VM ids of the
    node's instances running since before the probe) saves a query per node when the fleet check has them.
    """
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node_id)
        last_healthy = node.last_seen_at  # before this check: the last moment the node was known to be well
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
    interrupted = []
    if not ok and node.health_failures >= settings.NODE_INTERRUPT_AFTER_FAILED_CHECKS:
        interrupted = instance_svc.node_instances_interrupt(
            node_id=node_id, since=last_healthy, cause=InterruptionCause.NODE_LOST,
            detail=f"{node.health_failures} health checks failed in a row: {error}")
    elif ok and vms is not None:
        stopped = {vm_id for vm_id, state in vms.items() if state != "running"}
        if running_vm_ids is None:
            running_vm_ids = running_vm_ids_by_node([node_id], probed_at).get(node_id, set())
        missing_or_stopped = running_vm_ids - (set(vms) - stopped)
        if missing_or_stopped:
            interrupted = instance_svc.node_instances_interrupt(
                node_id=node_id, since=last_healthy, cause=InterruptionCause.VM_LOST, vm_ids=missing_or_stopped,
                started_before=probed_at, detail="the server answers, but the VM is not running on it")
    if interrupted:
        node_event(node, "instances_interrupted", f"Instance(s) {', '.join(map(str, interrupted))} interrupted: "
                   f"{'the node is unreachable' if not ok else 'their VM is not running'}.", NodeEvent.Level.CRITICAL)
    from provisioning.services.reliability import node_health_observed

    node_health_observed(node_id=node_id, ok=ok, inventory_hash=inventory_hash)
    return interrupted


def running_vm_ids_by_node(node_ids: list[int], probed_before: datetime | None) -> dict[int, set[str]]:
    """For each node, the VM ids of its instances that were running before `probed_before` (one query)."""
    running = Instance.objects.filter(node_id__in=node_ids, status=InstanceStatus.RUNNING)
    if probed_before is not None:
        running = running.filter(started_at__lt=probed_before)
    found: dict[int, set[str]] = {}
    for node_id, pk in running.values_list("node_id", "pk"):
        found.setdefault(node_id, set()).add(vm_id_of(pk))
    return found


def node_health_probe(node: Node, timeouts: Timeouts | None = None) -> HealthResult:
    """One `health` round trip to the node (no database writes)."""
    start = time.monotonic()
    probed_at = timezone.now()
    try:
        with node_session(node, timeouts or Timeouts(connect=5, command=20, attempts=1)) as session:
            answer = session.agent("health")
        return HealthResult(node.pk, True, seconds=time.monotonic() - start,
                            inventory_hash=answer.get("inventory_hash"), vms=answer.get("vms"), probed_at=probed_at)
    except NodeBusy as exc:
        return HealthResult(node.pk, False, exc.message, time.monotonic() - start, probed_at=probed_at, busy=True)
    except NodeError as exc:
        return HealthResult(node.pk, False, exc.message, time.monotonic() - start, probed_at=probed_at)


def node_apply_inventory(*, node: Node, inventory: dict) -> None:
    """Store the agent's inventory and update the node's GPU rows with what was read.

    The GPUs' UUIDs are claimed under the unique constraint `gpu_unique_uuid` (no check-then-insert: of two
    nodes claiming a GPU at once, the second waits for the first to commit, then fails). If another live node
    holds one of them, this node claims none, the rest is stored, and DuplicateHardware says which GPUs.
    """
    try:
        _apply_inventory(node.pk, inventory, claim=True)
        return
    except IntegrityError as exc:
        if "gpu_unique_uuid" not in str(exc):
            raise
    _apply_inventory(node.pk, inventory, claim=False)
    reported = {g["uuid"]: g.get("index") for g in inventory.get("gpus", []) if g.get("uuid")}
    held = Gpu.objects.filter(uuid__in=reported).exclude(node_id=node.pk).values_list("uuid", flat=True)
    raise DuplicateHardware(duplicate_gpus(sorted((reported[uuid], uuid) for uuid in held)))


@transaction.atomic
def _apply_inventory(node_id: int, inventory: dict, *, claim: bool) -> None:
    node = Node.objects.select_for_update().get(pk=node_id)
    node.inventory = inventory
    node.last_seen_at = timezone.now()
    node.save(update_fields=["inventory", "last_seen_at", "updated_at"])
    reported = inventory.get("gpus", [])
    uuids = [g["uuid"] for g in reported if g.get("uuid")]
    claim = claim and len(uuids) == len(set(uuids))  # one UUID on two GPUs: claimed by none, the policy rejects it
    models = {m.smi_name: m for m in GpuModel.objects.filter(smi_name__in={g.get("name") for g in reported})}
    rows = {gpu.index: gpu for gpu in node.gpus.all()}
    before = {gpu.pk: gpu.uuid for gpu in rows.values()}
    after = dict.fromkeys(before, "")  # a GPU the server no longer reports is no longer claimed
    changed = []
    for gpu_info in reported:
        gpu = rows.get(gpu_info.get("index"))
        if gpu is None:
            continue  # more GPUs than declared: the verification reports it
        gpu.uuid = after[gpu.pk] = (gpu_info.get("uuid") or "") if claim else ""
        gpu.pci_bus_id = gpu_info.get("pci_bus_id") or ""
        gpu.memory_mib = gpu_info.get("memory_total_mib") or gpu.memory_mib
        gpu.gpu_model = models.get(gpu_info.get("name")) or gpu.gpu_model
        changed.append(gpu)
    # Let go of the UUIDs that change first: a UUID moving between this node's own rows (one UPDATE, checked
    # row by row) must not collide with itself.
    stale = [pk for pk, uuid in before.items() if uuid and uuid != after[pk]]
    if stale:
        Gpu.objects.filter(pk__in=stale).update(uuid="")
    Gpu.objects.bulk_update(changed, ["uuid", "pci_bus_id", "memory_mib", "gpu_model"])
