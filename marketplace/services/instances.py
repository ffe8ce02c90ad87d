"""Renting: book GPUs as an instance, and every move of an instance through its lifecycle.

All instance rules live here. Two kinds of callers:

- the API (renters) and the admin (operators): `instance_create` and the verbs `instance_stop`,
  `instance_start`, `instance_restart`, `instance_destroy`. They move the instance into an
  "*ing" state and queue a job (provisioning.services.jobs.job_create, sent to Celery on commit);
- the provisioning tasks (workers): the `instance_mark_*` functions, which record what the node
  did. Each runs in its own short transaction, locks the instance row, and is idempotent.

GPU allocation: one transaction locks the node row FOR SHARE (so a provider's change of the node,
which takes FOR UPDATE, waits for bookings in flight, while bookings on the same node run side by
side) and the free GPUs it takes with FOR UPDATE SKIP LOCKED (concurrent bookings never wait for
each other's GPUs, and never take the same one). The partial unique constraint
`gpu_in_at_most_one_live_allocation` makes a double allocation impossible even if this code had
a bug. Duplicate requests with one Idempotency-Key are decided by the unique constraint
`instance_unique_idempotency_key`, never by "check, then insert".

Money (billing.services): booking and starting need one hour of the instance's price in the renter's
balance (InsufficientFunds, 402); a booking snapshots the price and the platform fee; and wherever an
instance leaves `running` (stop, restart, destroy, failure) its last usage interval is charged in the
same transaction that changes its state (`_leave_running`). The per-minute meter bills the rest.
"""
import hashlib
import json

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Case, IntegerField, Max, Prefetch, QuerySet, Value, When
from django.utils import timezone

from billing.services.ledger import funds_shortfall
from billing.services.metering import platform_fee_bps, usage_close
from marketplace.models import (
    Gpu,
    GpuAllocation,
    GpuStatus,
    Image,
    Instance,
    InstanceStatus,
    InvalidTransition,
    Node,
    NodeState,
    Runtime,
    User,
)
from marketplace.models.nodes import LISTABLE_VERDICTS
from marketplace.models.renting import FINAL_STATUSES
from marketplace.money import micros_to_usd
from provisioning.models import JobKind
from provisioning.services.jobs import job_create

S = InstanceStatus
MAX_DISK_GB = 2000
WAITING = "Waiting for a worker"


class InstanceError(Exception):
    """A request about an instance that cannot be done; `status_code` is the HTTP answer."""

    status_code = 400

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field


class InstanceInvalid(InstanceError):
    """The request itself is wrong (HTTP 400); `field` names the input at fault."""


class InstanceConflict(InstanceError):
    """Valid, but the current state of the instance, node or GPUs forbids it (HTTP 409)."""

    status_code = 409


class InsufficientFunds(InstanceError):
    """The renter's balance does not cover the first hours of the instance (HTTP 402)."""

    status_code = 402


class IdempotencyKeyReused(InstanceError):
    """The Idempotency-Key was used before for a different request (HTTP 422)."""

    status_code = 422


# ----------------------------------------------------------------------------------------- reads


def instances_for_user(*, user: User) -> QuerySet[Instance]:
    """A renter's own instances, each with `live_allocations` (the GPUs it holds now) prefetched.

    Operators too see only their own here: they see everyone's in the admin.
    """
    live = GpuAllocation.objects.filter(released_at__isnull=True).select_related("gpu").order_by("gpu__index")
    return (
        Instance.objects.filter(renter=user)
        .select_related("image", "gpu_model")
        .prefetch_related(Prefetch("allocations", queryset=live, to_attr="live_allocations"))
    )


def instance_gpu_indices(*, instance: Instance) -> list[int]:
    """The node's GPU indices the instance holds now (live allocations), sorted."""
    live = getattr(instance, "live_allocations", None)
    if live is not None:
        return sorted(a.gpu.index for a in live)
    return sorted(
        GpuAllocation.objects.filter(instance=instance, released_at__isnull=True).values_list("gpu__index", flat=True)
    )


def request_fingerprint(data) -> str:
    """SHA-256 of a create request's body in a canonical form (keys sorted, no spaces)."""
    if hasattr(data, "lists"):  # a QueryDict (form data): every value is a list
        data = dict(data.lists())
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def instance_for_idempotency_key(*, renter: User, idempotency_key: str, request_fingerprint: str) -> Instance | None:
    """The instance an earlier request with this key created, or None.

    Raises IdempotencyKeyReused when that request had another body.
    """
    existing = Instance.objects.filter(renter=renter, idempotency_key=idempotency_key).first()
    if existing is not None and existing.request_fingerprint != request_fingerprint:
        raise IdempotencyKeyReused(
            f"This Idempotency-Key was already used for a different request (it created instance {existing.pk}). "
            "Send the same body to get that instance again, or use a new key for a new request."
        )
    return existing


# -------------------------------------------------------------------------------------- helpers


def _lock_node_for_booking(node_id: int) -> Node | None:
    """Read the node and hold a share lock on its row until the transaction ends."""
    if connection.vendor == "postgresql":
        # Django has no FOR SHARE. Only the columns booking reads; the rest stay deferred.
        table = connection.ops.quote_name(Node._meta.db_table)
        sql = (f"SELECT id, state, verdict, listed, runtime, gpu_model_id, price_per_gpu_hour_micros "  # noqa: S608
               f"FROM {table} WHERE id = %s FOR SHARE")
        rows = list(Node.objects.raw(sql, [node_id]))
        return rows[0] if rows else None
    return Node.objects.select_for_update().filter(pk=node_id).first()  # SQLite: writes are serialised anyway


_NODE_STATE_REASONS = {
    NodeState.PENDING: "its node has not been verified yet",
    NodeState.VERIFYING: "its node is being verified",
    NodeState.REJECTED: "its node did not pass the benchmark check",
    NodeState.MAINTENANCE: "its node is in maintenance",
    NodeState.OFFLINE: "its node is offline",
    NodeState.QUARANTINED: "its node is quarantined",
    NodeState.RETIRED: "its node was retired by its provider",
}


def _booking_refusal(node: Node) -> str | None:
    if node.state != NodeState.ACTIVE:
        return _NODE_STATE_REASONS.get(node.state, f"its node is {node.state}")
    if node.verdict not in LISTABLE_VERDICTS:
        return "its node has not passed the benchmark check"
    if not node.listed:
        return "its provider has unlisted it"
    return None


def _lock_free_gpus(node_id: int, count: int, prefer: list[int] | tuple = ()) -> list[Gpu]:
    """Lock up to `count` free GPUs of the node (FOR UPDATE SKIP LOCKED), `prefer` ids first, then by index."""
    gpus = Gpu.objects.select_for_update(skip_locked=True).filter(node_id=node_id, status=GpuStatus.FREE)
    if prefer:
        rank = Case(When(pk__in=list(prefer), then=Value(0)), default=Value(1), output_field=IntegerField())
        gpus = gpus.annotate(_rank=rank).order_by("_rank", "index")
    else:
        gpus = gpus.order_by("index")
    return list(gpus[:count])


def _allocate(instance: Instance, gpus: list[Gpu], at) -> None:
    Gpu.objects.filter(pk__in=[g.pk for g in gpus]).update(status=GpuStatus.RENTED)
    try:
        with transaction.atomic():
            GpuAllocation.objects.bulk_create(GpuAllocation(instance=instance, gpu=g, allocated_at=at) for g in gpus)
    except IntegrityError as exc:  # the database's guarantee caught a GPU marked free while allocated
        if "gpu_in_at_most_one_live_allocation" in str(exc):
            raise InstanceConflict("The GPUs were taken by another booking meanwhile; try again.") from None
        raise


def instance_release_gpus(*, instance: Instance, at=None) -> list[int]:
    """End every live allocation of the instance and free its GPUs; the indices released.

    Call inside the transaction that holds the instance's row lock. A GPU that was marked
    unavailable meanwhile stays unavailable. Idempotent: with nothing live it does nothing.
    """
    at = at or timezone.now()
    live = list(
        GpuAllocation.objects.filter(instance_id=instance.pk, released_at__isnull=True)
        .select_related("gpu").order_by("gpu_id")
    )
    if not live:
        return []
    gpu_ids = [a.gpu_id for a in live]
    GpuAllocation.objects.filter(pk__in=[a.pk for a in live]).update(released_at=at)
    Gpu.objects.filter(pk__in=gpu_ids, status=GpuStatus.RENTED).update(status=GpuStatus.FREE)
    return sorted(a.gpu.index for a in live)


def _locked(instance_id: int) -> Instance | None:
    return Instance.objects.select_for_update().filter(pk=instance_id).first()


def _save(instance: Instance, *fields: str) -> None:
    instance.save(update_fields=["status", "status_message", "updated_at", *fields])


def _stop_clock(instance: Instance, now) -> None:
    """Set stopped_at when an instance that was running (since started_at) ends some other way."""
    if instance.started_at is not None and (instance.stopped_at is None or instance.stopped_at < instance.started_at):
        instance.stopped_at = now


def _check_funds(renter_id: int, price_per_hour_micros: int, what: str) -> None:
    """Renting (or starting again) needs BILLING_FUNDS_REQUIRED_S (one hour) of the instance's price."""
    if not settings.BILLING_REQUIRE_FUNDS:
        return
    missing, required, balance = funds_shortfall(user_id=renter_id, price_per_hour_micros=price_per_hour_micros)
    if missing:
        hours = settings.BILLING_FUNDS_REQUIRED_S / 3600
        span = "one hour" if hours == 1 else f"{hours:g} hours"
        raise InsufficientFunds(
            f"{what} needs at least {span} of its price in your balance: ${micros_to_usd(required)}. "
            f"Your balance is ${micros_to_usd(balance)}; top up at least ${micros_to_usd(missing)} "
            "(POST /api/v1/billing/top-ups/)."
        )


def _leave_running(instance: Instance, now) -> None:
    """The instance stops being billed: charge its usage up to now (call before it leaves `running`)."""
    if instance.status == S.RUNNING:
        usage_close(instance=instance, until=now)


def _gpus_text(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


# ------------------------------------------------------------------------------ booking (API side)


def instance_create(
    *,
    renter: User,
    node_id: int,
    num_gpus: int,
    image: Image,
    ssh_public_keys: list[str],
    disk_gb: int | None = None,
    label: str = "",
    idempotency_key: str = "",
    request_fingerprint: str = "",
) -> tuple[Instance, bool]:
    """Book `num_gpus` GPUs of a node as a new instance and queue its provisioning.

    `ssh_public_keys` are already validated and normalised. Returns (instance, created): with
    an Idempotency-Key seen before (same body), the earlier instance and False.
    Raises InstanceInvalid (400), InstanceConflict (409) or IdempotencyKeyReused (422); on any
    of them nothing was written.
    """
    if idempotency_key:
        existing = instance_for_idempotency_key(
            renter=renter, idempotency_key=idempotency_key, request_fingerprint=request_fingerprint
        )
        if existing is not None:
            return existing, False
    keys = list(dict.fromkeys(ssh_public_keys))
    if not keys:
        raise InstanceInvalid("Give at least one SSH key: `ssh_keys` (ids of your keys) and/or `ssh_public_key`.",
                              field="ssh_keys")
    try:
        with transaction.atomic():
            instance = _book(renter=renter, node_id=node_id, num_gpus=num_gpus, image=image, keys=keys,
                             disk_gb=disk_gb, label=label, idempotency_key=idempotency_key,
                             request_fingerprint=request_fingerprint)
    except IntegrityError:
        # Another request with the same Idempotency-Key won the race (it held the unique index
        # entry; this one waited for it to commit). Answer with the winner.
        if idempotency_key:
            existing = instance_for_idempotency_key(
                renter=renter, idempotency_key=idempotency_key, request_fingerprint=request_fingerprint
            )
            if existing is not None:
                return existing, False
        raise
    return instance, True


def _book(*, renter, node_id, num_gpus, image, keys, disk_gb, label, idempotency_key, request_fingerprint):
    node = _lock_node_for_booking(node_id)
    if node is None:
        raise InstanceInvalid(f"There is no offer {node_id}; pick one from /api/v1/offers/.", field="offer")
    refusal = _booking_refusal(node)
    if refusal:
        raise InstanceConflict(f"Offer {node_id} is not available: {refusal}.")
    total = Gpu.objects.filter(node_id=node.pk).count()
    if num_gpus > total:
        raise InstanceInvalid(f"This node has {_gpus_text(total)}; ask for 1 to {total}.", field="num_gpus")
    if not image.active:
        raise InstanceInvalid(f"The image {image.slug} is no longer offered.", field="image")
    if not image.supports(node.runtime):
        raise InstanceInvalid(
            f"The image {image.slug} cannot run on this node: its runtime is {node.runtime}, and the image "
            f"has a build only for {', '.join(r for r in image.runtimes if r != 'sim')}.",
            field="image",
        )
    disk = image.min_disk_gb if disk_gb is None else disk_gb
    if not image.min_disk_gb <= disk <= MAX_DISK_GB:
        raise InstanceInvalid(f"The {image.slug} image needs {image.min_disk_gb} to {MAX_DISK_GB} GB of disk.",
                              field="disk_gb")
    _check_funds(renter.pk, node.price_per_gpu_hour_micros * num_gpus, "Renting this instance")
    now = timezone.now()
    # The row goes in first: a concurrent request with the same Idempotency-Key blocks here on the
    # unique index until this transaction ends, then fails and answers with this instance.
    instance = Instance.objects.create(
        renter=renter, node=node, gpu_model_id=node.gpu_model_id, num_gpus=num_gpus, image=image, label=label,
        disk_gb=disk, ssh_public_keys=keys, status=S.REQUESTED, status_message=WAITING,
        price_per_gpu_hour_micros=node.price_per_gpu_hour_micros,
        price_per_hour_micros=node.price_per_gpu_hour_micros * num_gpus, platform_fee_bps=platform_fee_bps(),
        idempotency_key=idempotency_key, request_fingerprint=request_fingerprint if idempotency_key else "",
        created_at=now,
    )
    gpus = _lock_free_gpus(node.pk, num_gpus)
    if len(gpus) < num_gpus:
        free = "No GPU is" if not gpus else f"Only {_gpus_text(len(gpus))} {'is' if len(gpus) == 1 else 'are'}"
        raise InstanceConflict(f"{free} free on this node now; you asked for {num_gpus}.")
    _allocate(instance, gpus, now)
    job_create(kind=JobKind.INSTANCE_PROVISION, node=node, instance=instance)
    return instance


# ---------------------------------------------------------------------------- verbs (API side)

_FINAL_REFUSALS = {
    S.DESTROYING: "The instance is being destroyed.",
    S.DESTROYED: "The instance is already destroyed.",
    S.FAILED: "The instance failed; it can only be destroyed.",
}
_REFUSALS = {
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


def _refuse(verb: str, instance: Instance) -> InstanceConflict:
    message = _REFUSALS[verb].get(instance.status) or _FINAL_REFUSALS.get(instance.status)
    return InstanceConflict(message or f"Cannot {verb} an instance that is {instance.status}.")


def _node_of(instance: Instance) -> Node:
    return Node.objects.get(pk=instance.node_id)


@transaction.atomic
def instance_stop(*, instance: Instance) -> Instance:
    """running → stopping, and queue the stop. Stop keeps the disk; the worker frees the GPUs.

    Asking again while stopping changes nothing (no second job).
    """
    instance = _locked(instance.pk)
    if instance.status == S.STOPPING:
        return instance
    if instance.status != S.RUNNING:
        raise _refuse("stop", instance)
    _leave_running(instance, timezone.now())
    instance.transition_to(S.STOPPING, f"{WAITING} to stop it")
    _save(instance)
    job_create(kind=JobKind.INSTANCE_STOP, node=_node_of(instance), instance=instance)
    return instance


@transaction.atomic
def instance_start(*, instance: Instance) -> Instance:
    """stopped → starting: take GPUs again on the same node (the same ones when free), queue the start.

    Raises InstanceConflict when the node cannot run it now or has too few free GPUs.
    Asking again while starting changes nothing.
    """
    instance = _locked(instance.pk)
    if instance.status == S.STARTING:
        return instance
    if instance.status != S.STOPPED:
        raise _refuse("start", instance)
    _check_funds(instance.renter_id, instance.price_per_hour_micros, "Starting this instance")
    node = _lock_node_for_booking(instance.node_id)
    if node.state != NodeState.ACTIVE:
        reason = _NODE_STATE_REASONS.get(node.state, f"its node is {node.state}")
        raise InstanceConflict(f"The instance cannot start now: {reason}. Try again later, or destroy it.")
    now = timezone.now()
    instance_release_gpus(instance=instance, at=now)  # nothing is live when stopped; this only makes sure
    last_release = instance.allocations.aggregate(at=Max("released_at"))["at"]
    previous = list(instance.allocations.filter(released_at=last_release).values_list("gpu_id", flat=True))
    gpus = _lock_free_gpus(node.pk, instance.num_gpus, prefer=previous)
    if node.runtime == Runtime.DOCKER and {g.pk for g in gpus} != set(previous):
        # A container keeps the GPUs it was created with (the agent cannot move it to others).
        raise InstanceConflict("Its GPUs are in use by another instance now; a container can only start on "
                               "the GPUs it was created with. Try again later, or destroy the instance.")
    if len(gpus) < instance.num_gpus:
        have = "No GPUs are" if not gpus else f"Only {_gpus_text(len(gpus))} of the {instance.num_gpus} it needs are"
        raise InstanceConflict(f"{have} free on this node now; try again later, or destroy the instance.")
    _allocate(instance, gpus, now)
    indices = ", ".join(str(g.index) for g in sorted(gpus, key=lambda g: g.index))
    instance.transition_to(S.STARTING, f"{WAITING} to start it on GPU{'s' if len(gpus) > 1 else ''} {indices}")
    _save(instance)
    job_create(kind=JobKind.INSTANCE_START, node=node, instance=instance)
    return instance


@transaction.atomic
def instance_restart(*, instance: Instance) -> Instance:
    """running → starting with the same GPUs, and queue a restart (a reboot of the VM)."""
    instance = _locked(instance.pk)
    if instance.status == S.STARTING:
        return instance
    if instance.status != S.RUNNING:
        raise _refuse("restart", instance)
    _leave_running(instance, timezone.now())  # billing resumes when it is running again
    instance.transition_to(S.STARTING, f"{WAITING} to restart it")
    _save(instance)
    job_create(kind=JobKind.INSTANCE_RESTART, node=_node_of(instance), instance=instance)
    return instance


@transaction.atomic
def instance_destroy(*, instance: Instance) -> Instance:
    """Any state but destroying/destroyed → destroying, and queue the destroy.

    Asking again while destroying changes nothing (no second job); a destroyed instance is a conflict.
    GPUs stay allocated until the worker confirms the VM is gone (instance_mark_destroyed).
    """
    instance = _locked(instance.pk)
    if instance.status == S.DESTROYING:
        return instance
    if instance.status == S.DESTROYED:
        raise InstanceConflict("The instance is already destroyed.")
    _leave_running(instance, timezone.now())
    instance.transition_to(S.DESTROYING, f"{WAITING} to destroy it")
    _save(instance)
    job_create(kind=JobKind.INSTANCE_DESTROY, node=_node_of(instance), instance=instance)
    return instance


# ------------------------------------------------------------------------- worker side (tasks)


@transaction.atomic
def instance_mark_provisioning(*, instance_id: int) -> Instance | None:
    """requested → provisioning. None when the instance is gone or in another state: do nothing then."""
    instance = _locked(instance_id)
    if instance is None or instance.status not in (S.REQUESTED, S.PROVISIONING):
        return None
    if instance.status == S.REQUESTED:
        instance.transition_to(S.PROVISIONING, "Creating the VM on the node")
        _save(instance)
    return instance


@transaction.atomic
def instance_mark_running(*, instance_id: int, ssh_host: str, ssh_port: int, ssh_user: str,
                          message: str = "") -> Instance:
    """provisioning/starting → running, with where to SSH in. Already running: the address is updated.

    Raises InvalidTransition from any other state (e.g. a destroy was asked meanwhile).
    """
    instance = _locked(instance_id)
    if instance is None:
        raise Instance.DoesNotExist(instance_id)
    now = timezone.now()
    fields = ["ssh_host", "ssh_port", "ssh_user"]
    if instance.status == S.RUNNING:
        instance.status_message = (message or instance.status_message)[:500]
    else:
        instance.transition_to(S.RUNNING, message or "Running")
        instance.started_at, instance.stopped_at = now, None
        fields += ["started_at", "stopped_at"]
    instance.ssh_host, instance.ssh_port, instance.ssh_user = ssh_host, ssh_port, ssh_user
    _save(instance, *fields)
    return instance


@transaction.atomic
def instance_mark_stopped(*, instance_id: int, message: str = "") -> Instance:
    """stopping/starting → stopped: the VM is stopped, its disk kept, and its GPUs freed.

    Already stopped: nothing changes. Raises InvalidTransition from any other state.
    """
    instance = _locked(instance_id)
    if instance is None:
        raise Instance.DoesNotExist(instance_id)
    if instance.status != S.STOPPED:
        now = timezone.now()
        instance.transition_to(S.STOPPED, message or "Stopped; the disk is kept. Start it again at any time.")
        instance.stopped_at = now
        instance_release_gpus(instance=instance, at=now)
        _save(instance, "stopped_at")
    return instance


@transaction.atomic
def instance_mark_destroyed(*, instance_id: int) -> Instance:
    """destroying → destroyed: the VM and its disk are gone; its GPUs are freed.

    Already destroyed: nothing changes. Raises InvalidTransition from any other state.
    """
    instance = _locked(instance_id)
    if instance is None:
        raise Instance.DoesNotExist(instance_id)
    if instance.status != S.DESTROYED:
        now = timezone.now()
        instance.transition_to(S.DESTROYED, "Destroyed")
        instance.destroyed_at = now
        _stop_clock(instance, now)
        instance_release_gpus(instance=instance, at=now)
        _save(instance, "destroyed_at", "stopped_at")
    return instance


@transaction.atomic
def instance_mark_failed(*, instance_id: int, message: str) -> Instance:
    """Any state but failed/destroyed → failed, with the reason; its GPUs are freed.

    A failed or destroyed instance stays as it is (the first reason is kept).
    """
    instance = _locked(instance_id)
    if instance is None:
        raise Instance.DoesNotExist(instance_id)
    if instance.status not in FINAL_STATUSES:
        now = timezone.now()
        _leave_running(instance, now)
        instance.transition_to(S.FAILED, message or "Failed")
        _stop_clock(instance, now)
        instance_release_gpus(instance=instance, at=now)
        _save(instance, "stopped_at")
    else:
        instance_release_gpus(instance=instance)  # no-op unless something left one live
    return instance


def instance_set_status_message(*, instance_id: int, message: str) -> None:
    """Progress text for the renter ("Pulling the image"); no state change, none once final."""
    Instance.objects.filter(pk=instance_id).exclude(status__in=FINAL_STATUSES).update(
        status_message=message[:500], updated_at=timezone.now()
    )


__all__ = [
    "IdempotencyKeyReused",
    "InsufficientFunds",
    "InstanceConflict",
    "InstanceError",
    "InstanceInvalid",
    "InvalidTransition",
    "instance_create",
    "instance_destroy",
    "instance_for_idempotency_key",
    "instance_gpu_indices",
    "instance_mark_destroyed",
    "instance_mark_failed",
    "instance_mark_provisioning",
    "instance_mark_running",
    "instance_mark_stopped",
    "instance_release_gpus",
    "instance_restart",
    "instance_set_status_message",
    "instance_start",
    "instance_stop",
    "instances_for_user",
    "request_fingerprint",
]
