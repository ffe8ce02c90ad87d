"""What the instance use cases share: reads, the booking refusal, releasing GPUs, saving and notifying. The funds
check is in funds.py, the booking's statements in allocation.py."""
from datetime import datetime

from django.conf import settings
from django.db.models import F, Prefetch, QuerySet
from django.utils import timezone

from billing.services.metering import NODE_BILLING_FIELDS, node_billable_until, usage_close
from billing.services.storage import instance_disk_close, storage_billed_until
from core.errors import IdempotencyKeyReused
from marketplace.models import (
    Gpu,
    GpuAllocation,
    GpuStatus,
    Instance,
    InstanceStatus,
    MigSliceAllocation,
    User,
    VolumeMount,
)
from notifications.services.notify import notify

from .allocation import parse_islands
from .mig import hold_cards_declared_split, instance_release_slices, instance_slice_gpu_indices

S = InstanceStatus
MAX_DISK_GB = 2000
WAITING = "Waiting for a worker"


# ----------------------------------------------------------------------------------------- reads


def instances_for_user(*, user: User) -> QuerySet[Instance]:
    """A renter's own instances, each with `live_allocations` (the GPUs it holds now) and `live_slices` (the MIG
    slices it holds now, with their GPUs) prefetched: a list reads no row per instance.

    Operators too see only their own here: they see everyone's in the admin.
    """
    live = GpuAllocation.objects.filter(released_at__isnull=True).select_related("gpu").order_by("gpu__index")
    live_slices = MigSliceAllocation.objects.filter(released_at__isnull=True).select_related("mig_slice__gpu")
    return (
        Instance.objects.filter(renter=user)
        .select_related("image", "gpu_model")
        # its node's NVLink islands, in the same query: instance_on_one_nvlink_island reads them
        .annotate(node_nvlink_islands=F("node__benchmark_summary__nvlink__islands"))
        # how far its node's instances are billable (its checks failing?): the live cost_so_far reads them
        .annotate(**NODE_BILLING_FIELDS)
        .prefetch_related(Prefetch("allocations", queryset=live, to_attr="live_allocations"),
                          Prefetch("slice_allocations", queryset=live_slices, to_attr="live_slices"),
                          Prefetch("volume_mounts", queryset=VolumeMount.objects.select_related("volume")))
    )


def instance_gpu_indices(*, instance: Instance) -> list[int]:
    """The node's GPU indices the instance holds now (live allocations), sorted; a MIG instance's: the GPUs its
    slices are on."""
    if instance.mig_profile:
        return instance_slice_gpu_indices(instance=instance)
    live = getattr(instance, "live_allocations", None)
    if live is not None:
        return sorted(a.gpu.index for a in live)
    return sorted(
        GpuAllocation.objects.filter(instance=instance, released_at__isnull=True).values_list("gpu__index", flat=True)
    )


def instance_gpu_uuids(*, instance: Instance) -> list[str | None]:
    """The UUIDs of the GPUs instance_gpu_indices names, in its order; None for a row with no UUID (older data).
    The node's agent starts the VM only if each index still carries its card: nvidia-smi numbers the cards anew
    when one falls off the bus."""
    if instance.mig_profile:
        slices = getattr(instance, "live_slices", None)
        cards = ({a.mig_slice.gpu.index: a.mig_slice.gpu.uuid for a in slices} if slices is not None else dict(
            MigSliceAllocation.objects.filter(instance=instance, released_at__isnull=True)
            .values_list("mig_slice__gpu__index", "mig_slice__gpu__uuid")))
    else:
        live = getattr(instance, "live_allocations", None)
        cards = ({a.gpu.index: a.gpu.uuid for a in live} if live is not None else dict(
            GpuAllocation.objects.filter(instance=instance, released_at__isnull=True)
            .values_list("gpu__index", "gpu__uuid")))
    return [cards[index] or None for index in sorted(cards)]


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





def instance_on_one_nvlink_island(*, instance: Instance) -> bool | None:
    """Whether the GPUs the instance holds are all on one NVLink island of its node (instances_for_user reads the
    islands with it); None for fewer than two GPUs, a node without NVLink, or a MIG instance: MIG slices have no
    peer-to-peer between them (neither NVLink nor PCIe), which is also why booking refuses require_nvlink with a
    mig_profile."""
    if instance.mig_profile:
        return None
    islands = parse_islands(getattr(instance, "node_nvlink_islands", None))
    held = set(instance_gpu_indices(instance=instance))
    if len(held) < 2 or not islands:
        return None
    return any(held <= set(island) for island in islands)




def instance_release_gpus(*, instance: Instance, at: datetime | None = None) -> list[int]:
    """End every live allocation of the instance and free its GPUs; the indices released.

    Call inside the transaction that holds the instance's row lock. A GPU that was marked
    unavailable meanwhile stays unavailable. Idempotent: with nothing live it does nothing.
    """
    at = at or timezone.now()
    if instance.mig_profile:  # its slices, not whole GPUs (instances/mig.py); the parents' indices
        indices = instance_slice_gpu_indices(instance=instance)
        instance_release_slices(instance=instance, at=at)
        return indices
    live = list(
        GpuAllocation.objects.filter(instance_id=instance.pk, released_at__isnull=True)
        .select_related("gpu").order_by("gpu_id")
    )
    if not live:
        return []
    gpu_ids = [a.gpu_id for a in live]
    GpuAllocation.objects.filter(pk__in=[a.pk for a in live]).update(released_at=at)
    # A lost card (gone from the node's nvidia-smi: provisioning.services.gpu_presence) is not offered again
    # until it answers; the others are free.
    Gpu.transition_rows(Gpu.objects.filter(pk__in=gpu_ids, lost_at__isnull=False), GpuStatus.UNAVAILABLE)
    Gpu.transition_rows(Gpu.objects.filter(pk__in=gpu_ids), GpuStatus.FREE, action="release")
    hold_cards_declared_split(gpu_ids, instance.node_id)
    return sorted(a.gpu.index for a in live)


def _locked(instance_id: int) -> Instance | None:
    return Instance.objects.select_for_update().filter(pk=instance_id).first()


def _save(instance: Instance, *fields: str) -> None:
    instance.save(update_fields=["status", "status_message", "updated_at", *fields])


def instance_notify(instance: Instance, kind: str, key: str, message: str = "") -> None:
    """Tell the renter, on the channels they chose, that the instance entered a state (once per `key`)."""
    notify(user=instance.renter, kind=kind, dedupe_key=f"{kind}:{instance.pk}:{key}",
           payload={"instance": instance.pk, "label": instance.label, "status": instance.status,
                    "message": message or instance.status_message})


def instance_notify_by_operator(instance: Instance, kind: str, key: str, done: str, meaning: str,
                                reason: str) -> None:
    """Tell the renter that an operator `done` ("stopped", "destroyed") their instance, what it means and why
    (`reason`, the operator's; none: whom to ask)."""
    label = f" ({instance.label})" if instance.label else ""
    why = f" Reason: {reason}" if reason else " Contact support if you do not know why."
    instance_notify(instance, kind, key, f"An operator of {settings.PLATFORM_NAME} {done} your instance "
                                         f"{instance.pk}{label}. {meaning}{why}")


def _run_begins(instance: Instance, now: datetime) -> datetime:
    """Where a new run of the instance begins (its `started_at`): now, or what was billed when that is later.
    Another host's clock (the tick's, a health check's) may have billed past this one's now; a run begun before
    `billed_until` was billed off its whole-second grid (10 s charged for 10.5, or 11 by the SQL tick)."""
    return max(now, instance.billed_until or now)


def _stop_clock(instance: Instance, now: datetime) -> None:
    """Set stopped_at when an instance that was running (since started_at) ends some other way."""
    if instance.started_at is not None and (instance.stopped_at is None or instance.stopped_at < instance.started_at):
        instance.stopped_at = now


def _leave_running(instance: Instance, now: datetime, *, disk_until: datetime | None = None) -> None:
    """The instance stops being billed: charge its usage up to now (call before it leaves `running`), or its
    disk's while stopped (call before it leaves `stopped`). `disk_until`: a stopped instance's disk is billed no
    further than that (its VM's last sighting, when the node no longer lists it: instance_mark_failed)."""
    if instance.status == S.RUNNING:  # not past its node's last healthy moment while the node is silent
        usage_close(instance=instance, until=node_billable_until(node_id=instance.node_id, now=now))
    elif instance.status == S.STOPPED:  # not past its node's last healthy moment (destroyed during an outage)
        until = storage_billed_until(node_id=instance.node_id, now=now)
        instance_disk_close(instance=instance, until=until if disk_until is None else min(until, disk_until))


def _gpus_text(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"
