"""Node-side use cases: open a pinned session, record contact, quarantine, the health probe, inventory.
(Applying a health check's result: fleet_record.nodes_record_health.)"""
from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from core import metrics
from core.sql import constraint_violated
from marketplace.models import (
    Gpu,
    GpuAllocation,
    GpuModel,
    Instance,
    InstanceStatus,
    InterruptionCause,
    MigSliceAllocation,
    Node,
    NodeState,
)
from marketplace.models.renting import vm_id_of
from marketplace.selectors import node_in_use_q
from marketplace.services import instances as instance_svc
from marketplace.services.nodes import node_private_key
from provisioning.concurrency import NodeBusy, node_slot
from provisioning.models import JobFault, NodeEvent
from provisioning.services.gpu_presence import gpus_presence, gpus_returned, node_gpus_presence
from provisioning.ssh import SERVED_COMMANDS, Endpoint, NodeSession, Timeouts
from provisioning.ssh_errors import (
    AddressRefused,
    AgentFailed,
    AgentMissing,
    AuthFailed,
    HostKeyMismatch,
    NodeError,
    NodeUnreachable,
    PlatformKeyUnreadable,
)
from provisioning.ssh_pool import SshPool
from provisioning.verification.health_answer import HOST_SEES_GPUS, health_problem
from provisioning.verification.identity import duplicate_address, duplicate_gpus, duplicate_host_key
from provisioning.verification.model import Finding

log = logging.getLogger(__name__)

OFFLINE_AFTER_FAILED_CHECKS = 3
# The state the agent lists (`vm list`, `vm status`, the health answer's `vms`) for a VM it has a record of whose
# container or domain is gone (removed on the node: `docker container prune`, `virsh undefine`). The platform takes
# it as a VM gone, as one not listed at all: it cannot run again, and no disk of it is left to bill.
VM_MISSING = "missing"
# The state the agent lists for a VM its engine has but cannot give the state of now (libvirt: a defined domain whose
# domstate fails), with the engine's words as `error` (`vm list`) or in `vm_errors` (the health answer). Left
# unjudged: neither interrupted, resumed, restarted, stopped nor failed, its GPUs held (one such domain failed the
# whole list and health answer: every renter on the node interrupted, then the node offline; found by review).
VM_UNKNOWN = "unknown"
# A container whose command exits and that the engine runs again (docker's "restarting"): not running for its
# renter, but it holds its GPUs like a running VM, so a VM that must not run is stopped when it restarts too.
VM_RESTARTING = "restarting"
VM_HOLDING_GPUS = ("running", VM_RESTARTING)
# States in which the platform talks to a node on its own (health checks, reconciling).
WATCHED_STATES = (NodeState.ACTIVE, NodeState.OFFLINE, NodeState.MAINTENANCE)


def watched_nodes() -> QuerySet[Node]:
    """The nodes the fleet's health checks and reconciler visit: those in WATCHED_STATES, and one being verified
    while renters are on it (verified again from offline or maintenance). Left out for the check's length, such a
    node's interrupted instances waited for it to end to be resumed, and a VM lost meanwhile went unnoticed."""
    return Node.objects.filter(Q(state__in=WATCHED_STATES) | Q(node_in_use_q(), state=NodeState.VERIFYING))


class HostKeyStillChanged(HostKeyMismatch):
    """The changed host key the node is quarantined for already (the same key seen again): a job opened before the
    quarantine met it. Nothing new about the node: the quarantine counted it once (its critical event; a job that met
    it first failed by the node's fault), so this job's failure is not held against it again. A key other than both
    the pinned and the recorded one is new, and is a plain HostKeyMismatch (quarantined again, counted)."""

    # faults.error_fault: the node's changed key, counted once by its quarantine. Not the platform's either (it was:
    # the operators' count of the platform's own failures took every such job).
    fault = JobFault.HOST_KEY

    def __init__(self, expected: str, seen: str):
        super().__init__(expected, seen)
        self.message = self.message.rstrip() + " The node is quarantined for this key already."
        self.args = (self.message,)


class DuplicateHardware(NodeError):
    """The server's host key, its address and port, or one of its GPUs, belongs to another live node (one that
    proved it controls the server, for the first two): the same hardware registered twice. Nothing was pinned or
    claimed; a verification rejects the node with `finding`. Not retried."""

    fault = JobFault.NODE  # the provider registered it twice (faults.error_fault)

    def __init__(self, finding: Finding):
        super().__init__(finding.message)
        self.finding = finding
        self.code = finding.code


# A node the platform never reached: unproven (control_proven_at null) and never judged past its first check.
# A node listed once is reached (nodes from before control_proven_at was recorded are too): its other key is a change.
NEVER_CONTACTED: dict[str, Any] = {"control_proven_at__isnull": True,
                                   "state__in": (NodeState.PENDING, NodeState.VERIFYING)}


class DeclaredHostKeyWrong(HostKeyMismatch):
    """At the node's first contact (never proven: control_proven_at null) the server showed another host key than
    the fingerprint its provider gave at registration: a mistake in the registration (a typo, or the fingerprint of
    another of the server's keys, RSA or ECDSA, which ssh-keyscan and cloud consoles list too), not a key that
    changed. Nothing was sent. The node is not quarantined: the check fails by the node's fault (the node back to
    pending), saying what the server presented, and its provider corrects the fingerprint (or clears it: the key
    seen at first contact is then pinned) and verifies again. Before, the node was quarantined as if its key had
    changed, and only an operator could release it (found by review)."""

    code = "declared_host_key_mismatch"

    def __init__(self, expected: str, seen: str, key_type: str = ""):
        super().__init__(expected, seen, key_type)
        kind = key_type or "ed25519"
        shown = f"{seen} ({key_type})" if key_type else seen
        self.message = (
            f"The server presented the SSH host key {shown}, not the fingerprint given at registration "
            f"({expected}). Nothing was sent. Give the fingerprint of the server's {kind} host key (`ssh-keygen -lf "
            f"/etc/ssh/ssh_host_{kind}_key.pub` on the server) in the node's settings, or clear it to have the key "
            "recorded at first contact, then verify again.")
        self.args = (self.message,)


def node_endpoint(node: Node) -> Endpoint:
    return Endpoint(
        address=node.address, port=node.ssh_port, user=node.ssh_user,
        private_key=node_private_key(node=node), host_key_fingerprint=node.host_key_fingerprint,
    )


def node_event(*, node: Node, kind: str, message: str, level: str = NodeEvent.Level.INFO) -> NodeEvent:
    return NodeEvent.objects.create(node=node, kind=kind, message=message, level=level)


DISK_LIMIT_NOT_ENFORCED = "disk_limit_not_enforced"


def disk_limit_not_enforced_noted(*, node: Node, what: str) -> None:
    """A warning node event, once per node, when the node answers that a disk it made (an instance's disk_gb: the
    agent's "disk_limit", a volume's size: its "size_limit") is "not_enforced". The answer was dropped (review r53
    #2): on such a node one renter can fill the docker data root whatever they booked, and booking's disk room
    counts only what was booked; operators (the node's events) now see it. Once: each later instance would
    repeat the same line. Two first answers at once may both record it."""
    if NodeEvent.objects.filter(node=node, kind=DISK_LIMIT_NOT_ENFORCED).exists():
        return
    node_event(node=node, kind=DISK_LIMIT_NOT_ENFORCED, level=NodeEvent.Level.WARNING, message=(
        f"{what} was made without an enforced size limit: the node answered \"not_enforced\" (its docker storage "
        "or volume driver cannot limit sizes, e.g. overlay2 or the local volume driver off xfs with pquota; or the "
        "image declares a VOLUME outside the limit). A renter can fill this node's disk beyond what they booked. "
        "Recorded once per node."))


@contextlib.contextmanager
def node_session(node: Node, timeouts: Timeouts | None = None, *, pool: SshPool | None = None,
                 slot_held: bool = False, slot_wait_s: float | None = None) -> Iterator[NodeSession]:
    """A pinned SSH session to `node` inside the per-node concurrency cap.

    On first contact the host key is recorded and pinned from then on (one given at registration that the server
    does not show there: DeclaredHostKeyWrong, no quarantine); a changed
    key quarantines the node and re-raises HostKeyMismatch (HostKeyStillChanged, not the node's fault again, when
    it is quarantined for that key already); a key another live node
    has is not pinned and raises DuplicateHardware.

    With a `pool` (provisioning.ssh_pool), the node's kept connection is used when there is one (the per-node
    slot is still taken for the block); every new connection is pinned as above. `session.fresh` says whether
    the connection was opened for this block. `slot_held`: the caller holds one of the node's slots already
    (a fleet batch takes them all at once). `slot_wait_s`: how long to wait for a slot (default: node_slot's).
    """
    if slot_held:
        slot: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    else:
        slot = node_slot(node.pk) if slot_wait_s is None else node_slot(node.pk, wait_s=slot_wait_s)
    with slot:
        if pool is None:
            session = _session_connect(node, timeouts)
            try:
                session.fresh = True
                yield session
            finally:
                session.close()
            return
        connect = lambda: _session_connect(node, timeouts)  # noqa: E731
        with pool.borrow(node.pk, connection_identity(node), connect) as (session, fresh):
            session.timeouts = timeouts or Timeouts()
            session.fresh = fresh
            yield session


def connection_identity(node: Node) -> tuple[Any, ...]:
    """What a kept connection was opened with: changed, it is not reused."""
    return (node.address, node.ssh_port, node.ssh_user, node.host_key_fingerprint,
            bytes(node.ssh_private_key_encrypted or b""))


def first_contact_failed(node: Node) -> str:
    """What the provider of a node that never proved control is told when the platform could not log in there:
    one message, whatever the server at that address and port did (see _first_contact_error)."""
    return (f"Could not log in to {node.address}:{node.ssh_port} as {node.ssh_user} with the platform's key: check "
            "that the server is up, that the address and SSH port are right and that the node's install command was "
            f"run as {node.ssh_user}, then verify again.")


def _first_contact_error(node: Node, exc: NodeUnreachable | AuthFailed) -> None:
    """A node that never proved control (control_proven_at null) failed to connect or log in: its provider is told
    first_contact_failed, the same text for every cause, and the try is not retried at once (no `attempts` that
    tell one cause from another). Before, the precise cause reached the job's error and the node's last_error:
    "Connection refused", "Connection reset by peer" after a banner, "No SSH answer within 10s", "refused the
    platform's key" told any provider what listens at any public host and port, asked from the platform's own
    addresses (review r54). The cause is kept for operators in the server log."""
    log.warning("first contact with node %s at %s:%s failed: %s", node.pk, node.address, node.ssh_port, exc.message)
    exc.message = first_contact_failed(node)
    exc.args = (exc.message,)
    exc.transient = False


def _session_connect(node: Node, timeouts: Timeouts | None) -> NodeSession:
    session = NodeSession(node_endpoint(node), timeouts)
    try:
        session.connect()
    except (NodeUnreachable, AuthFailed) as exc:
        if (not isinstance(exc, AddressRefused | PlatformKeyUnreadable)
                and Node.objects.filter(pk=node.pk, control_proven_at__isnull=True).exists()):
            _first_contact_error(node, exc)
        raise
    except HostKeyMismatch as exc:
        if Node.objects.filter(pk=node.pk, **NEVER_CONTACTED).exists():
            # Never contacted: the fingerprint given at registration is wrong, no key changed (DeclaredHostKeyWrong).
            raise DeclaredHostKeyWrong(exc.expected, exc.seen, exc.key_type) from None
        if not node_quarantine(node_id=node.pk, seen=exc.seen):
            raise HostKeyStillChanged(exc.expected, exc.seen) from None
        raise
    try:
        # Its first contact (a declared key too), or a node with no key pinned: one marked proven without a key
        # (migration 0034's backfill of a node 0008 had cleared the key of) connected with an empty pin, which
        # takes any key, and never recorded one: any server at its address was taken for it.
        if (node.control_proven_at is None or not node.host_key_fingerprint) and session.seen_fingerprint:
            _pin_host_key(node, session.seen_fingerprint, key_type=session.seen_key_type)
    except BaseException:
        session.close()
        raise
    return session


def _pin_host_key(node: Node, fingerprint: str, *, key_type: str = "") -> None:
    """First contact: the platform logged in to the server with the node's own key (only whoever controls the
    server could install it), and the server showed host key `fingerprint` (one given at registration was checked by
    the connection already). The node now proves control of its server: the key is pinned and control_proven_at set,
    from which on the node holds its address and port and its host key (node_unique_live_endpoint,
    node_unique_live_host_key). Either one another proven live node holds is the same server listed twice: the
    constraint refuses it (race-free: of two first contacts at once, the second waits for the first to commit, then
    fails), nothing is pinned, and DuplicateHardware says which. Only the first writer pins; a concurrent session
    that saw another key loses (quarantined). A node marked proven with no key pinned is pinned the same way.
    A node still unproven whose declared key is another now (changed meanwhile) is DeclaredHostKeyWrong, no
    quarantine."""
    was_proven = node.control_proven_at is not None
    try:
        with transaction.atomic():
            pinned = (Node.objects.filter(pk=node.pk)
                      .filter(Q(control_proven_at__isnull=True) | Q(host_key_fingerprint=""))
                      .filter(Q(host_key_fingerprint="") | Q(host_key_fingerprint=fingerprint))
                      .update(host_key_fingerprint=fingerprint, control_proven_at=timezone.now()))
    except IntegrityError as exc:
        # Read by name from PostgreSQL's report, not found in the message's text: "node_unique_live_host_key" is
        # no substring of "node_unique_own_live_host_key" (the key declared by another live node of the same
        # provider, proven or not), which was re-raised, an internal error at every retry of the node's first
        # contact.
        violated = constraint_violated(exc)
        if violated in ("node_unique_live_host_key", "node_unique_own_live_host_key"):
            raise DuplicateHardware(duplicate_host_key(fingerprint)) from None
        if violated == "node_unique_live_endpoint":
            raise DuplicateHardware(duplicate_address(node.address, node.ssh_port)) from None
        raise
    declared = node.host_key_fingerprint == fingerprint
    node.refresh_from_db(fields=["host_key_fingerprint", "control_proven_at"])
    if pinned:
        said = ("given at registration, confirmed" if declared else "recorded") + (
            " (the node had none pinned)" if was_proven and not declared else " on first contact")
        node_event(node=node, kind="host_key_pinned",
                   message=f"Host key {fingerprint} {said} and pinned: the platform logged in with "
                           "this node's key, so the server is this node's.")
    elif node.host_key_fingerprint != fingerprint:
        if node.control_proven_at is None and node.state in NEVER_CONTACTED["state__in"]:
            raise DeclaredHostKeyWrong(node.host_key_fingerprint, fingerprint, key_type)
        if not node_quarantine(node_id=node.pk, seen=fingerprint):
            raise HostKeyStillChanged(node.host_key_fingerprint, fingerprint)
        raise HostKeyMismatch(node.host_key_fingerprint, fingerprint)


def node_quarantine(*, node_id: int, seen: str) -> bool:
    """The server showed host key `seen`, not the pinned one: the node is quarantined (a critical event, its running
    instances interrupted). False when it is quarantined for that very key already (a job opened before the
    quarantine met it, or two sessions met it at once): nothing is recorded again, the caller raises
    HostKeyStillChanged. Before, each such job wrote another critical event for the one change and failed by the
    node's fault, held against its reliability once more. A third key (neither pinned nor recorded) is recorded."""
    with transaction.atomic():
        node = Node.objects.select_for_update(no_key=True).get(pk=node_id)
        if node.state == NodeState.QUARANTINED and node.seen_host_key_fingerprint == seen:
            known = True
        else:
            known = False
            node.seen_host_key_fingerprint = seen
            node.last_error = (
                f"The server's SSH host key changed (expected {node.host_key_fingerprint}, got {seen}). "
                "The node is quarantined until an operator confirms the new key."
            )
            if node.state != NodeState.QUARANTINED and node.can_transition_to(NodeState.QUARANTINED):
                node.transition_to(NodeState.QUARANTINED)
            node.save()
            node_event(node=node, kind="host_key_changed", message=node.last_error,
                       level=NodeEvent.Level.CRITICAL)
    # No check or job talks to it from now: its running instances are interrupted as those of a node that stopped
    # answering, billed up to its last healthy check (before, they stayed `running`, their renters never told, as
    # its checks stopped before they could interrupt them). After the node's row is released: the interruptions
    # need no lock on it (where both are locked, the node's comes first: verification, retire, a start).
    instance_svc.node_instances_interrupt(
        node_id=node_id, since=node.last_seen_at, cause=InterruptionCause.NODE_LOST,
        detail="its SSH host key changed; the platform no longer talks to it until an operator confirms the key")
    return not known


@dataclass
class HealthResult:
    node_id: int
    ok: bool
    error: str = ""
    seconds: float = 0.0
    inventory_hash: str | None = None  # the agent's digest of its GPUs (a change triggers a re-verification)
    vms: dict[str, str] | None = None  # vm_id -> state ("running", "stopped", VM_MISSING) as the agent saw them
    # The GPUs nvidia-smi lists now, where the host sees every card (HOST_SEES_GPUS); None where it does not.
    gpu_uuids: list[str] | None = None
    probed_at: datetime | None = None  # when the probe began: instances running since then are not judged by it
    # The platform's own SSH sessions to the node were all taken (NodeBusy): nothing was learned either way (ok is
    # False only for that). Not a failed check: the health loop should count it and record nothing.
    busy: bool = False


def running_vm_ids_by_node(*, node_ids: list[int], probed_before: datetime | None) -> dict[int, set[str]]:
    """For each node, the VM ids of its instances that were running before `probed_before` (one query)."""
    running = Instance.objects.filter(node_id__in=node_ids, status=InstanceStatus.RUNNING)
    if probed_before is not None:
        running = running.filter(started_at__lt=probed_before)
    found: dict[int, set[str]] = {}
    for node_id, pk in running.values_list("node_id", "pk"):
        found.setdefault(node_id, set()).add(vm_id_of(pk))
    return found


HEALTH_TIMEOUTS = Timeouts(connect=5, command=20, attempts=1)


@metrics.observes_ssh_probe  # SSH probe latency for Prometheus (core/metrics.py)
def node_health_probe(node: Node, timeouts: Timeouts | None = None, *, pool: SshPool | None = None,
                      slot_held: bool = False) -> HealthResult:
    """One `health` round trip to the node (no database writes), over the pool's kept connection if given."""
    start = time.monotonic()
    probed_at = timezone.now()
    try:
        answer = node_agent_call(node, "health", timeouts=timeouts or HEALTH_TIMEOUTS, pool=pool,
                                 slot_held=slot_held)
        return health_result(node, answer, seconds=time.monotonic() - start, probed_at=probed_at)
    except NodeBusy as exc:
        return HealthResult(node.pk, False, exc.message, time.monotonic() - start, probed_at=probed_at, busy=True)
    except NodeError as exc:
        return HealthResult(node.pk, False, exc.message, time.monotonic() - start, probed_at=probed_at)


def health_result(node: Node, answer: Any, *, seconds: float, probed_at: datetime) -> HealthResult:
    """What a `health` answer tells about the node: a failed check, naming why, unless it shows the node able to
    host its VMs (provisioning.verification.health_answer); before, any answer passed, one without its VM list or
    with its runtime down included, and its renters stayed billed."""
    problem = health_problem(answer, runtime=node.runtime)
    if problem:
        return HealthResult(node.pk, False, f"The node answers, but {problem}.", seconds, probed_at=probed_at)
    return HealthResult(node.pk, True, seconds=seconds, inventory_hash=answer.get("inventory_hash"),
                        vms=answer["vms"], probed_at=probed_at,
                        gpu_uuids=answer["gpu_uuids"] if node.runtime in HOST_SEES_GPUS else None)


def node_agent_call(node: Node, command: str, sub: str | None = None, request: dict[str, Any] | None = None, *,
                    timeouts: Timeouts | None = None, pool: SshPool | None = None,
                    slot_held: bool = False) -> dict[str, Any]:
    """One agent command in its own session (node_session). Over a pooled connection it tries once more on a
    new connection when the kept one broke (the node's sshd restarted meanwhile), and checks (re-uploads) the
    agent once when the node says it is not there or does not know the command (the recorded hash was stale)."""
    for attempt in (1, 2):
        fresh = True  # a failed connect is not a kept connection that broke
        try:
            with node_session(node, timeouts, pool=pool, slot_held=slot_held) as session:
                fresh = session.fresh
                # Over a kept connection, the commands the long-lived agent serves need no exec of their own.
                call = session.served if pool is not None and sub is None and command in SERVED_COMMANDS \
                    else (lambda c, r: session.agent(c, sub, r))
                try:
                    return call(command, request)
                except (AgentMissing, AgentFailed) as exc:
                    if pool is None or (isinstance(exc, AgentFailed) and exc.field != "command"):
                        raise
                    pool.forget_agent(node.pk)
                    session._agent_path = None  # ensure_agent checks it over SFTP (and uploads it) again
                    return call(command, request)
        except NodeUnreachable:
            if fresh or attempt == 2:
                raise
            log.info("node %s: a kept SSH connection broke; trying a new one", node.pk)
    raise AssertionError("not reached: the loop returns or raises")


def node_apply_inventory(*, node: Node, inventory: dict[str, Any], looked_at: datetime | None = None) -> bool:
    """Store the agent's inventory and update the node's GPU rows with what was read. False, nothing stored or
    claimed, when the node is retired (its provider retired it while its check ran): node_retire let go of its GPUs'
    UUIDs, and claimed now they were held by a node no check or reconcile visits again, its server refused at every
    later registration as "already another live node" (found by review).

    The GPUs' UUIDs are claimed under the unique constraint `gpu_unique_uuid` (no check-then-insert: of two
    nodes claiming a GPU at once, the second waits for the first to commit, then fails). If another live node
    holds one of them, this node claims none, the rest is stored, and DuplicateHardware says which GPUs.

    A card of a node whose host sees every card (HOST_SEES_GPUS) that the inventory no longer lists is lost first,
    by the health check's rule (gpu_presence): a verification may see it before a health check does. Before, the
    row let go of its UUID here, so no health check judged it again and its renter paid on for a card that was gone.
    `looked_at`: when the inventory was asked for; with it, a holder of a missing card whose billing a stop, restart
    or destroy closed since then is given back what it was billed after the node's last health check (gpu_presence).
    """
    if Node.objects.filter(pk=node.pk, state=NodeState.RETIRED).exists():
        return False  # checked again under the node's lock (_apply_inventory): a retire may commit meanwhile
    if node.runtime in HOST_SEES_GPUS:
        listed = [g["uuid"] for g in inventory.get("gpus", []) if g.get("uuid")]
        presence = gpus_presence({node.pk: listed}).get(node.pk)
        if presence is not None:
            last_seen = Node.objects.filter(pk=node.pk).values_list("last_seen_at", flat=True).first()
            node_gpus_presence(node=node, presence=presence, last_seen=last_seen, looked_at=looked_at)
    try:
        return _apply_inventory(node.pk, inventory, claim=True)
    except IntegrityError as exc:
        if constraint_violated(exc) != "gpu_unique_uuid":  # by name, never in the text (core.sql)
            raise
    if not _apply_inventory(node.pk, inventory, claim=False):
        return False
    reported = {g["uuid"]: g.get("index") for g in inventory.get("gpus", []) if g.get("uuid")}
    held = Gpu.objects.filter(uuid__in=reported).exclude(node_id=node.pk).values_list("uuid", flat=True)
    raise DuplicateHardware(duplicate_gpus(sorted((reported[uuid], uuid) for uuid in held)))


@transaction.atomic
def _apply_inventory(node_id: int, inventory: dict[str, Any], *, claim: bool) -> bool:
    node = Node.objects.select_for_update(no_key=True).get(pk=node_id)
    if node.state == NodeState.RETIRED:
        return False  # under the lock node_retire takes: what it let go of stays free (node_apply_inventory)
    node.inventory = inventory
    fields = ["inventory", "updated_at"]
    # Its last healthy moment, which the meter bills up to: not while its health checks fail (an offline node may be
    # verified), else the meter billed the outage's storage up to this answer (found by review); nor while renters
    # run on it. A verification does not look at the VMs, and last_seen_at is also the last sighting of every
    # running VM (vm_last_seen_at): moved here, the meter billed a VM gone since the last health check up to this
    # verification, and the check that found it gone interrupted it from here, a verification inside that check's
    # wait (fleet_record) included. Its health checks, which list the VMs, move it for those nodes. Nor while a
    # stopped instance's disk is on it: the storage meter bills that disk up to last_seen_at, its last sighting, and
    # the check that found the VM and its disk gone billed the disk up to this verification (found in round 50).
    if node.health_failures == 0 and not Instance.objects.filter(
            node_id=node_id, status__in=(InstanceStatus.RUNNING, InstanceStatus.STOPPED)).exists():
        node.last_seen_at = timezone.now()
        fields.append("last_seen_at")
    node.save(update_fields=fields)
    reported = inventory.get("gpus", [])
    uuids = [g["uuid"] for g in reported if g.get("uuid")]
    claim = claim and len(uuids) == len(set(uuids))  # one UUID on two GPUs: claimed by none, the policy rejects it
    models = {m.smi_name: m for m in GpuModel.objects.filter(smi_name__in={g.get("name") for g in reported})}
    rows = sorted(node.gpus.all(), key=lambda gpu: gpu.index)
    before = {gpu.pk: gpu.uuid for gpu in rows}
    # Held: a whole card rented, or a slice of a split one (its renter waits for the card just the same; found by
    # review: a verification while a split card was lost let go of its UUID, and no health check saw it back).
    held = set(GpuAllocation.objects.filter(gpu__node=node, released_at__isnull=True).values_list("gpu_id", flat=True))
    held |= set(MigSliceAllocation.objects.filter(mig_slice__gpu__node=node, released_at__isnull=True)
                .values_list("mig_slice__gpu_id", flat=True))
    # A lost card a renter holds (gpu_presence) whose UUID the server does not report keeps its row and UUID even
    # when a UUID repeats (no card is claimed then): before, matched by index it let go of its UUID, no health check
    # judged it again, and when the cards answered each with its own UUID it was never matched back (a lost held row
    # takes no unknown card): lost for good, its renter interrupted for good (found in round 50).
    waiting = {gpu.pk for gpu in rows
               if gpu.lost_at is not None and gpu.pk in held and gpu.uuid and gpu.uuid not in uuids}
    matched = _match_cards(rows, reported, held) if claim else {
        gpu.pk: info for gpu in rows if gpu.pk not in waiting for info in reported if info.get("index") == gpu.index}
    # A GPU the server no longer reports is no longer claimed, but a lost one a renter holds (gpu_presence) keeps
    # its UUID: the health checks go on judging it (its renter waits), and know it when it is back.
    after = {gpu.pk: gpu.uuid if gpu.lost_at is not None and gpu.pk in held and (claim or gpu.pk in waiting) else ""
             for gpu in rows}
    changed = []
    for gpu in rows:
        gpu_info = matched.get(gpu.pk)
        if gpu_info is None:
            continue
        gpu.uuid = after[gpu.pk] = (gpu_info.get("uuid") or "") if claim else ""
        gpu.pci_bus_id = gpu_info.get("pci_bus_id") or ""
        gpu.memory_mib = gpu_info.get("memory_total_mib") or gpu.memory_mib
        gpu.gpu_model = models.get(gpu_info.get("name") or "") or gpu.gpu_model
        changed.append(gpu)
    _renumber(rows, {pk: info.get("index") for pk, info in matched.items()})
    # Let go of the UUIDs that change first: a UUID moving between this node's own rows (one UPDATE, checked
    # row by row) must not collide with itself.
    stale = [pk for pk, uuid in before.items() if uuid and uuid != after[pk]]
    if stale:
        Gpu.objects.filter(pk__in=stale).update(uuid="")
    Gpu.objects.bulk_update(changed, ["uuid", "pci_bus_id", "memory_mib", "gpu_model"])
    # A lost card the server reports again (its row claims a UUID): no longer lost (gpu_presence).
    gpus_returned(gpu_ids=[gpu.pk for gpu in changed if gpu.uuid and gpu.lost_at is not None])
    return True


def _match_cards(rows: list[Gpu], reported: list[dict[str, Any]], held: set[int]) -> dict[int, dict[str, Any]]:
    """Which card the server lists each GPU row is now (row id -> the card's answer). A card keeps the row that
    holds its UUID, wherever nvidia-smi lists it: when one leaves the bus the others are numbered anew, and matched
    by index a lost card's row took another card's UUID and was marked back (its renter resumed and billed for a
    card that was gone), a renter's row another's card. A card no row knows (a new node's, or one put in) takes a
    row whose card is not listed, at its own index first, never a lost card a renter still holds (it waits)."""
    by_uuid = {gpu.uuid: gpu for gpu in rows if gpu.uuid}
    matched: dict[int, dict[str, Any]] = {}
    unknown = []
    for info in reported:
        gpu = by_uuid.get(info.get("uuid") or "")
        if gpu is not None:
            matched[gpu.pk] = info
        else:
            unknown.append(info)
    listed = {info.get("uuid") for info in reported if info.get("uuid")}
    open_rows = [gpu for gpu in rows if gpu.pk not in matched and gpu.uuid not in listed
                 and not (gpu.lost_at is not None and gpu.pk in held)]
    for info in unknown:
        if not open_rows:
            break  # more GPUs than declared: the verification reports it
        gpu = next((g for g in open_rows if g.index == info.get("index")), open_rows[0])
        open_rows.remove(gpu)
        matched[gpu.pk] = info
    return matched


def _renumber(rows: list[Gpu], index_of: dict[int, Any]) -> None:
    """Give each matched row its card's nvidia-smi index (the agent addresses a card by it); a row whose card is not
    listed keeps its index unless a listed card took it, else gets the lowest one left. Through indices out of the
    way first: (node, index) is unique, checked row by row."""
    final = {pk: index for pk, index in index_of.items() if isinstance(index, int) and not isinstance(index, bool)}
    if len(set(final.values())) != len(final):
        return  # one index twice: a malformed answer, which the verification names; the rows stay as they are
    used = set(final.values())
    rest = [gpu for gpu in rows if gpu.pk not in final]
    for gpu in rest:
        if gpu.index not in used:
            final[gpu.pk] = gpu.index
            used.add(gpu.index)
    for gpu in rest:
        if gpu.pk not in final:
            final[gpu.pk] = next(i for i in itertools.count() if i not in used)
            used.add(final[gpu.pk])
    moving = [gpu for gpu in rows if final[gpu.pk] != gpu.index]
    if not moving:
        return
    for n, gpu in enumerate(moving):
        gpu.index = 30000 + n
    Gpu.objects.bulk_update(moving, ["index"])
    for gpu in moving:
        gpu.index = final[gpu.pk]
    Gpu.objects.bulk_update(moving, ["index"])


def vm_state_unknown_reported(*, node: Node, vm_id: str, error: str = "") -> None:
    """One warning event per VM whose state the node cannot give (VM_UNKNOWN), naming it, for operators."""
    shown = ascii(vm_id[:80])
    prefix = f"The node cannot read the state of VM {shown}"
    if NodeEvent.objects.filter(node=node, kind="vm_state_unknown", message__startswith=prefix).exists():
        return
    node_event(node=node, kind="vm_state_unknown",
               message=f"{prefix} (left as it is, unjudged, until it can): {str(error)[:500]}".rstrip(": "),
               level=NodeEvent.Level.WARNING)
