"""The renter's and operator's verbs: stop, start, restart, destroy (API side: *ing state + a job).

Which state allows which verb is the instance table's (marketplace.models.renting INSTANCE_TRANSITIONS,
`Instance.allows`), read by the pages' buttons too; here are only the words of each refusal."""

from django.conf import settings
from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from core.errors import Conflict, ValidationFailed
from core.request_guard import has_control_character
from core.validators import CONTROL_CHARACTERS_MESSAGE
from marketplace.models import (
    Gpu,
    GpuStatus,
    Instance,
    Node,
    NodeState,
    Runtime,
)
from marketplace.services.email_verification import email_verified_required
from marketplace.services.funds import _check_funds
from marketplace.services.offer_rules import NODE_STATE_REASONS, SIMULATED_NOT_TAKEN, node_simulated_not_taken
from marketplace.validators import NAME_MAX_LENGTH
from notifications.services.notify import Kind
from provisioning.models import Job, JobKind
from provisioning.services.jobs import job_create

from .allocation import _allocate, _lock_free_gpus, _lock_node_for_booking, gpus_held_and_free, node_nvlink_islands
from .common import (
    WAITING,
    S,
    _gpus_text,
    _leave_running,
    _save,
    instance_notify_by_operator,
    instance_release_gpus,
)
from .mig import reallocate_slices, slices_start_refusal
from .worker import OPERATOR_STOP, instance_mark_destroyed, instance_mark_stopped
from .worker import QUARANTINED_REASON as _QUARANTINED_REASON
from .worker import STOPPED_ON_QUARANTINED_NODE as _STOPPED_UNREACHED

# ---------------------------------------------------------------------------- verbs (API side)

# Why no job can reach a node now (_node_reach).
_UNREACHABLE, _QUARANTINED = "unreachable", "quarantined"
# The states in which no job of the instance is under way (a destroy asked in another one follows its open job).
_NO_JOB_UNDER_WAY = (S.RUNNING, S.FAILED)


_FINAL_REFUSALS: dict[str, str] = {
    S.DESTROYING: "The instance is being destroyed.",
    S.DESTROYED: "The instance is already destroyed.",
    S.FAILED: "The instance failed; it can only be destroyed.",
    S.INTERRUPTED: ("The instance is interrupted: its server cannot be reached. It resumes by itself when the "
                    "server answers again (nothing is billed meanwhile), or destroy it now at no charge."),
}
_REFUSALS: dict[str, dict[str, str]] = {
    "stop": {
        S.REQUESTED: "The instance is still being provisioned; stop it once it is running, or destroy it.",
        S.PROVISIONING: "The instance is still being provisioned; stop it once it is running, or destroy it.",
        S.STARTING: "The instance is starting; stop it once it is running.",
        S.STOPPED: "The instance is already stopped.",
    },
    "start": {
        S.REQUESTED: "The instance is still being provisioned; it starts by itself.",
        S.PROVISIONING: "The instance is still being provisioned; it starts by itself.",
        S.RUNNING: "The instance is already running; use restart to reboot it.",
        S.STOPPING: "The instance is stopping; start it once it is stopped.",
    },
    "restart": {
        S.REQUESTED: "The instance is still being provisioned; restart it once it is running.",
        S.PROVISIONING: "The instance is still being provisioned; restart it once it is running.",
        S.STOPPING: "The instance is stopping; start it once it is stopped.",
        S.STOPPED: "The instance is stopped; use start.",
    },
}


# A start refused on a quarantined node (_start_node_refusal): what makes it possible, not "try again later".
_START_ON_QUARANTINED_NODE = (
    f"The instance cannot start now: {_QUARANTINED_REASON}. It stays stopped with its disk kept; start it once the "
    "new key is accepted (its provider asks the platform's operators to confirm it), or destroy it.")
# Any verb but destroy of an instance its node's quarantine interrupted (node_quarantine), in the same words.
_INTERRUPTED_ON_QUARANTINED_NODE = (
    f"The instance is interrupted: {_QUARANTINED_REASON}. It resumes by itself if its VM is still running once the "
    "new key is accepted (its provider asks the platform's operators to confirm it; nothing is billed meanwhile), "
    "or destroy it now at no charge.")
# Worded as the booking's refusal (offer_rules.node_refusal), with what becomes of the instance.
_PROVIDER_DEACTIVATED = (
    "The instance cannot start: its server's provider account was deactivated by the platform's operators, so the "
    "server takes no new load. The instance stays stopped with its disk kept as it is (billed as storage while you "
    "keep it); destroy it if you no longer need it, or keep it: it can start again if that account is reactivated.")


def _refuse(verb: str, instance: Instance) -> Conflict:
    if instance.status == S.INTERRUPTED and _node_reach(instance.node_id) == _QUARANTINED:
        return Conflict(_INTERRUPTED_ON_QUARANTINED_NODE)  # not "when the server answers again": it answers
    message = _REFUSALS.get(verb, {}).get(instance.status) or _FINAL_REFUSALS.get(instance.status)
    return Conflict(message or f"Cannot {verb} an instance that is {instance.status}.")


def _queue(instance: Instance, status: str, what: str, kind: str, note: str = "") -> Instance:
    """Leave `running` (its last seconds are billed), take the *ing state, and queue the job that does it; `note`,
    why it was queued, is its log's first line."""
    now = timezone.now()
    _leave_running(instance, now)
    instance.transition_to(status, f"{WAITING} to {what}")
    _save(instance)
    job = job_create(kind=kind, node=_node_of(instance), instance=instance)
    if note:  # operators read the log; not the job's step, which the provider sees
        Job.objects.filter(pk=job.pk).update(log=[{"at": now.isoformat(), "message": note}])
    return instance


def _node_of(instance: Instance) -> Node:
    return Node.objects.get(pk=instance.node_id)


@transaction.atomic
def instance_stop(*, instance: Instance, operator_reason: str | None = None) -> Instance:
    """running → stopping, and queue the stop. Stop keeps the disk; the worker frees the GPUs.

    On a quarantined node (_node_reach), which no job reaches, stopped at once, its GPUs held until the node is back
    (vm_cleanup_pending). Asking again while stopping changes nothing (no second job).
    `operator_reason` (not None): an operator's stop (instance_end_by_operator), told to the renter once stopped
    (worker.instance_mark_stopped, from the job's log: OPERATOR_STOP) in place of the generic notice.
    """
    instance = Instance.objects.select_for_update().get(pk=instance.pk)
    if instance.status == S.STOPPING:
        return instance
    if not instance.allows("stop"):
        raise _refuse("stop", instance)
    if _node_reach(instance.node_id) == _QUARANTINED:
        # No job reaches it (its stop would fail at once on the changed key, and the instance go back to running,
        # "stop it again", for good): stopped for the renter now, as by a stop job that gave up before the node
        # confirmed it (vms.vm_failed): its GPUs held until the reconciler finds the VM stopped, or stops it, once
        # the node is back.
        _leave_running(instance, timezone.now())
        instance.transition_to(S.STOPPING, "Stopping it")
        _save(instance)
        return instance_mark_stopped(instance_id=instance.pk, cleanup_pending=True, message=_STOPPED_UNREACHED,
                                     operator_reason=operator_reason)
    return _queue(instance, S.STOPPING, "stop it", JobKind.INSTANCE_STOP,
                  note="" if operator_reason is None else f"{OPERATOR_STOP}{operator_reason}")


@transaction.atomic
def instance_start(*, instance: Instance) -> Instance:
    """stopped → starting: take GPUs again on the same node (the same ones when free; else, a VM, as a booking
    takes them: allocation._lock_free_gpus), queue the start.

    Raises Conflict when the node cannot run it now or has too few free GPUs.
    Asking again while starting changes nothing.
    """
    # The node's row first (share), then the instance's: every writer of a node (a verification cutting or raising
    # its renters' prices, a retire ending its stopped instances) locks the node, then its instances. Taken after
    # the instance's, a start deadlocked with a verification concluding on its node (found by review: "deadlock
    # detected ... in relation marketplace_node", a 500). A node id never changes: the caller's copy names it.
    # With its provider's account read under that row's key-share lock, as a booking reads it: a deactivation
    # committing meanwhile is waited for and seen (marketplace.services.account_status). Not the wallet with it
    # (no `wallet_of`): the disk's posting below locks it, in id order with the other accounts.
    node = _lock_node_for_booking(instance.node_id)
    assert node is not None  # an instance's node outlives it (PROTECT)
    instance = Instance.objects.select_for_update().get(pk=instance.pk)
    if instance.status == S.STARTING:
        return instance
    if not instance.allows("start"):
        raise _refuse("start", instance)
    # Taking GPUs again is renting, as booking is (an operator changed the address: proven again first).
    email_verified_required(user=instance.renter)
    now = timezone.now()
    # Its disk is billed up to now first: that posting locks the renter's wallet in id order with the other
    # accounts, as the meter does; the funds check locking the wallet first and the posting then the others
    # deadlocked with a tick (found by review). The check sees the balance after the disk's charge.
    _leave_running(instance, now)
    # `provider_active`: set by _lock_node_for_booking, under the node's row lock.
    refusal = _start_node_refusal(node, provider_active=node.provider_active)  # type: ignore[attr-defined]
    if refusal:
        raise Conflict(refusal)
    # After the node's refusals: no top-up is asked for a start that could not happen anyway. The wallet is locked
    # after the node's row, as a booking locks them (or already, by the disk's posting above).
    _check_funds(instance.renter_id, instance.price_per_hour_micros, "Starting this instance", starting=instance.pk)
    # Live only when a stop or start did not get the node's confirmation (vm_cleanup_pending): the start job
    # takes the VM over, on the GPUs taken again below (the same ones first).
    instance_release_gpus(instance=instance, at=now)
    instance.vm_cleanup_pending = False
    if instance.mig_profile:  # a MIG VM keeps the slices it was created with (their UUIDs are in its spec)
        if not reallocate_slices(instance, now):
            raise Conflict(slices_start_refusal(instance))
        instance.transition_to(S.STARTING, f"{WAITING} to start it on its MIG {instance.mig_profile} slices")
        _save(instance, "vm_cleanup_pending")
        job_create(kind=JobKind.INSTANCE_START, node=node, instance=instance)
        return instance
    previous = _last_gpu_ids(instance)  # released just above: those of its last run
    # Its GPUs again when all are free. Else a VM may move (not a container: below), and takes them as a booking
    # would: one NVLink island when one has enough free (keeping as many of its own as that allows); by index only,
    # a start took its remaining card and the next by index, across islands beside a whole free one (found by
    # review).
    islands = node_nvlink_islands(node) if node.runtime != Runtime.DOCKER else None
    gpus = _lock_free_gpus(node.pk, instance.num_gpus, prefer=previous, islands=islands)
    if node.runtime == Runtime.DOCKER and {g.pk for g in gpus} != set(previous):
        # A container keeps the GPUs it was created with (the agent cannot move it to others).
        raise Conflict(_container_gpus_refusal(set(previous) - {g.pk for g in gpus}))
    if len(gpus) < instance.num_gpus:
        have = "No GPUs are" if not gpus else f"Only {_gpus_text(len(gpus))} of the {instance.num_gpus} it needs are"
        raise Conflict(f"{have} free on this node now; try again later, or destroy the instance.")
    if instance.require_nvlink:
        _refuse_start_across_islands(instance, node, gpus)
    _allocate(instance, gpus, now)
    indices = ", ".join(str(g.index) for g in sorted(gpus, key=lambda g: g.index))
    instance.transition_to(S.STARTING, f"{WAITING} to start it on GPU{'s' if len(gpus) > 1 else ''} {indices}")
    _save(instance, "vm_cleanup_pending")
    job_create(kind=JobKind.INSTANCE_START, node=node, instance=instance)
    return instance


def _refuse_start_across_islands(instance: Instance, node: Node, gpus: list[Gpu]) -> None:
    """409 (the start rolled back: the instance stays stopped, no GPU taken) where an instance booked with
    require_nvlink would start on GPUs of different NVLink islands: the ranking took one island when one had them
    free, so none has. Before, the start took them across islands (PCIe between them), the booking's promise
    forgotten. Says how many free GPUs share one island now."""
    islands = [set(island) for island in node_nvlink_islands(node)]
    if any({g.index for g in gpus} <= island for island in islands):
        return
    if islands:
        _, free = gpus_held_and_free(instance, node.pk)  # it holds none now: released above
        most = max(len(free & island) for island in islands)
        why = f"no {instance.num_gpus} free GPUs of its server share an NVLink island now (at most {most} do)"
    else:  # its server's last check found no NVLink
        why = "its server's last check found no NVLink islands"
    raise Conflict(f"The instance was booked with its GPUs on one NVLink island (require_nvlink), and {why}, so it "
                   "cannot start on GPUs joined by NVLink. It stays stopped with its disk kept; try again later, or "
                   "destroy it.", field="require_nvlink")


def _start_node_refusal(node: Node, *, provider_active: bool) -> str:
    """Why a stopped instance on `node` cannot start now for the node's sake, in instance_start's words; '' when
    its node takes the start (the renter's e-mail, funds and free GPUs are asked by the start itself)."""
    if node.state == NodeState.RETIRED:  # for good: "later" would never come
        return ("The instance cannot start: its node was retired by its provider and never comes back. "
                "Destroy it, and rent another server.")
    if not provider_active:
        # A start takes GPUs again: new load, refused as a booking is; what runs there already is left alone.
        return _PROVIDER_DEACTIVATED
    if node.state == NodeState.QUARANTINED:
        # Not "try again later": no later time helps until the new key is accepted (before, it said so).
        return _START_ON_QUARANTINED_NODE
    if node.state != NodeState.ACTIVE:
        reason = NODE_STATE_REASONS.get(node.state, f"its node is {node.state}")
        return f"The instance cannot start now: {reason}. Try again later, or destroy it."
    if node.health_failures:  # the start job would not reach it either
        return ("The instance cannot start now: its node did not answer its last health check. Try again "
                "in a few minutes, or destroy it.")
    if node_simulated_not_taken(node):
        # A sim node registered before the platform stopped taking simulated GPUs: a start takes its GPUs again,
        # new load on hardware that is no GPU, refused as a booking is (before, it started). What runs there already
        # is left alone (a restart keeps the GPUs it holds), as for a deactivated provider.
        return (f"The instance cannot start: {SIMULATED_NOT_TAKEN}. It stays stopped with its disk kept as "
                "it is; destroy it, and rent a server with real GPUs.")
    return ""


def instance_start_refusal(*, instance: Instance) -> str:
    """instance_start's refusal for the sake of the instance's node, read now without locks ('' when the node takes
    the start): for pages, so that they offer Start only where the service would (found by review: a stopped
    instance on a node in maintenance was offered Start, and the click refused). A container's own GPUs not free
    too (review r55 LOW-1: Start was offered while another instance held its GPU); a VM may move to others."""
    node = Node.objects.select_related("provider").get(pk=instance.node_id)
    refusal = _start_node_refusal(node, provider_active=node.provider.is_active)
    if refusal or node.runtime != Runtime.DOCKER or instance.mig_profile:
        return refusal
    if instance.allocations.filter(released_at__isnull=True).exists():
        return ""  # it still holds its GPUs (a stop its node did not confirm: vm_cleanup_pending); the start frees them
    previous = set(_last_gpu_ids(instance))
    missing = previous - set(Gpu.objects.filter(pk__in=previous, status=GpuStatus.FREE).values_list("pk", flat=True))
    return _container_gpus_refusal(missing) if missing else ""


def _last_gpu_ids(instance: Instance) -> list[int]:
    """The GPUs of the instance's last run: those it holds, else those it released last. A container starts on
    these only (instance_start, after releasing any it holds; instance_start_refusal, read without locks)."""
    held = list(instance.allocations.filter(released_at__isnull=True).values_list("gpu_id", flat=True))
    if held:
        return held
    last_release = instance.allocations.aggregate(at=Max("released_at"))["at"]
    return list(instance.allocations.filter(released_at=last_release).values_list("gpu_id", flat=True))


def instance_restart_refusal(*, instance: Instance) -> str:
    """instance_restart's refusal for the sake of the instance's node ('' when none): no job reaches a quarantined
    node, so its restart job would fail at once on the changed key. Read without locks; pages ask it too."""
    if _node_reach(instance.node_id) == _QUARANTINED:
        return (f"The instance cannot restart now: {_QUARANTINED_REASON}. Stop or destroy it, or restart it once "
                "the new key is accepted (its provider asks the platform's operators to confirm it).")
    return ""


def _container_gpus_refusal(missing: set[int]) -> str:
    """Why a container cannot start: which of the GPUs it was created with are not free, and why each. A card lost
    or taken out of service may never come back (destroy), one rented by another instance comes free (later)."""
    reasons = []
    for index, status, lost_at in (Gpu.objects.filter(pk__in=missing).order_by("index")
                                   .values_list("index", "status", "lost_at")):
        if lost_at is not None:
            reasons.append(f"GPU {index} is missing from its server (its health check lost it)")
        elif status == GpuStatus.UNAVAILABLE:
            reasons.append(f"GPU {index} is out of service (it failed a check, or its provider took it out)")
        elif status == GpuStatus.MIG:
            reasons.append(f"GPU {index} is split into MIG slices now")
        else:
            reasons.append(f"GPU {index} is rented by another instance now")
    out_for_good = any(not r.endswith("rented by another instance now") for r in reasons)
    then = ("It may not come back: destroy the instance and rent another server, or try again once its provider "
            "has brought the card back." if out_for_good else "Try again later, or destroy the instance.")
    return (f"A container can only start on the GPUs it was created with, and {'; '.join(reasons)}. {then}")


@transaction.atomic
def instance_restart(*, instance: Instance) -> Instance:
    """running → starting with the same GPUs, and queue a restart (a reboot of the VM).

    Raises Conflict on a quarantined node (_node_reach), which no job reaches."""
    instance = Instance.objects.select_for_update().get(pk=instance.pk)
    if instance.status == S.STARTING:
        return instance
    if not instance.allows("restart"):
        raise _refuse("restart", instance)
    refusal = instance_restart_refusal(instance=instance)  # its restart job would fail at once on the changed key
    if refusal:
        raise Conflict(refusal)
    # Billing pauses for the restart and resumes when it is running again.
    return _queue(instance, S.STARTING, "restart it", JobKind.INSTANCE_RESTART)


@transaction.atomic
def instance_destroy(*, instance: Instance) -> Instance:
    """Any state but destroying/destroyed → destroying, and queue the destroy.

    An interrupted instance, a stopped one whose node is unreachable, or a stopped, running or failed one whose
    node is quarantined (_node_reach), is destroyed at once for the renter (no job can reach the node); its VM is
    removed by the reconciler when the node answers again.

    Asking again while destroying changes nothing (no second job); a destroyed instance is a conflict.
    GPUs stay allocated until the worker confirms the VM is gone (instance_mark_destroyed).
    """
    instance = Instance.objects.select_for_update().get(pk=instance.pk)
    if instance.status == S.DESTROYING:
        return instance
    if not instance.allows("destroy"):
        raise _refuse("destroy", instance)
    reach = _node_reach(instance.node_id)
    if instance.status == S.INTERRUPTED or (instance.status == S.STOPPED and reach) or (
            instance.status in _NO_JOB_UNDER_WAY and reach == _QUARANTINED):
        # No job can reach its node: end the renter's side now; the reconciler removes the VM when it answers.
        if instance.status in _NO_JOB_UNDER_WAY:  # not straight to destroyed from these (the instance table)
            _leave_running(instance, timezone.now())
            instance.transition_to(S.DESTROYING, "Destroying it")
            _save(instance)
        return instance_mark_destroyed(instance_id=instance.pk, cleanup_pending=True)
    return _queue(instance, S.DESTROYING, "destroy it", JobKind.INSTANCE_DESTROY)


# ---------------------------------------------------------------------------- an operator's stop and destroy

# What the renter reads when an operator destroys their instance from the admin (marketplace/admin/renting.py), with
# the operator's reason: before, a destroy told them nothing (there is no notice of a renter's own destroy). An
# operator's stop is told once the instance is stopped, in place of the generic notice (worker.instance_mark_stopped):
# told when asked, the renter got both, and "its disk is kept" even for a stop that then failed (review r53).
_DESTROYED_BY_OPERATOR = "Its VM and its disk are deleted, with the data on the disk: it cannot be brought back."


@transaction.atomic
def instance_end_by_operator(*, instance: Instance, action: str, reason: str = "") -> Instance:
    """An operator's stop or destroy (`action`): the renter's own service (instance_stop, instance_destroy: its
    rules, its Conflicts), and the renter told that an operator did it and why (instance_stopped_by_operator once it
    is stopped, instance_destroyed_by_operator now, on the channels they chose), once per change: asked again while
    it is on its way, nothing is told. `reason` is the operator's, cleaned by the caller; the operator is in the
    admin's log."""
    if action == "stop":
        return instance_stop(instance=instance, operator_reason=reason)
    if action != "destroy":
        raise ValueError(f"no such operator's action: {action!r}")
    before = Instance.objects.select_for_update().values_list("status", flat=True).get(pk=instance.pk)
    after = instance_destroy(instance=instance)
    if after.status != before:
        instance_notify_by_operator(after, Kind.INSTANCE_DESTROYED_BY_OPERATOR, timezone.now().isoformat(),
                                    "destroyed", _DESTROYED_BY_OPERATOR, reason)
    return after


def instance_label(*, instance: Instance, label: str) -> Instance:
    """Rename an instance (any state but destroyed): a label is the renter's note, no rule of the lifecycle."""
    if len(label) > NAME_MAX_LENGTH:
        raise ValidationFailed(f"A label has at most {NAME_MAX_LENGTH} characters.", field="label")
    if has_control_character(label):
        raise ValidationFailed(CONTROL_CHARACTERS_MESSAGE, field="label")
    if instance.status == S.DESTROYED:
        raise Conflict("The instance is destroyed.")
    Instance.objects.filter(pk=instance.pk).update(label=label, updated_at=timezone.now())
    instance.label = label
    return instance

def _node_reach(node_id: int) -> str:
    """Why no job can reach the node now; '' when one may.

    _QUARANTINED: its SSH host key changed. Neither a health check nor a job talks to it until an operator accepts
    the new key (provisioning.services.nodes.node_quarantine; billing.services.metering.UNSEEN_NODE_STATES): a job
    would fail at once on the changed key, counted against the node, and quarantine it again. Accepted, it is
    verified again and, with a VM still to remove, watched and reconciled (selectors.node_in_use_q), which removes
    the VM of an instance destroyed meanwhile (vm_cleanup_pending). (Before, only _UNREACHABLE was asked: a stopped
    instance's destroy on a quarantined node queued a job that failed at once.)
    _UNREACHABLE: it is offline, or has missed enough health checks in a row that its instances are interrupted."""
    state, failures = Node.objects.values_list("state", "health_failures").get(pk=node_id)
    if state == NodeState.QUARANTINED:
        return _QUARANTINED
    if state == NodeState.OFFLINE or failures >= settings.NODE_INTERRUPT_AFTER_FAILED_CHECKS:
        return _UNREACHABLE
    return ""
