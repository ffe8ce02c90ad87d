"""GPUs that vanish from a node that still answers (a card fallen off the bus, Xid 79, a riser that lost contact),
and come back.

The health answer lists the UUIDs nvidia-smi shows (where the host sees every card: HOST_SEES_GPUS). A GPU of the
node missing from that list is lost: marked (`Gpu.lost_at`), kept off the offers (a free one becomes unavailable, a
rented one does when its instance lets it go: instances.common.instance_release_gpus; a split one's free slices are
left out by the offers' and booking's rule, marketplace.selectors.free_slices, and a rented slice becomes unavailable
when its instance lets it go: instances.mig.instance_release_slices), and every running instance
holding it, whole or through a MIG slice, is interrupted at the check before (the last moment the card was seen),
by the interruptions' one rule (billing closed there, the renter told and credited, charged to the provider).
Before, nothing noticed: the node answered, its VM ran, and its renter paid for a card that was gone until a
re-verification (queued by the changed inventory) judged the node, and even then the renter stayed billed.

A verification's inventory is judged by the same rule before it is stored (nodes.node_apply_inventory): it may
see a card gone before any health check does. Each card keeps its row, by UUID, when nvidia-smi numbers the others
anew (nodes._match_cards); a lost card a renter holds keeps its row's UUID (its renter waits for it), a free one
lets it go (another server may claim the card).

Such an instance waits interrupted while its card is lost (the reconciler does not resume it: its VM may run, its
GPU does not); the renter may destroy it at no charge. When the card is listed again (usually after the provider
restarts the server, which stops the VM: the reconciler starts it again), it is no longer lost, a GPU (or MIG slice)
the loss made unavailable is free again, and the instance resumes.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from django.db import transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from marketplace.models import (
    Gpu,
    GpuAllocation,
    GpuStatus,
    Instance,
    InterruptionCause,
    MigSlice,
    MigSliceAllocation,
    Node,
    SliceStatus,
)
from marketplace.services import instances as instance_svc
from provisioning.models import NodeEvent


@dataclass
class Presence:
    missing: list[int] = field(default_factory=list)  # ids of the node's GPUs not in the answer
    newly_missing: list[tuple[int, str]] = field(default_factory=list)  # (index, uuid) of those lost just now
    back: list[int] = field(default_factory=list)  # ids of lost GPUs listed again


def gpus_presence(listed_by_node: Mapping[int, Collection[str]]) -> dict[int, Presence]:
    """Per node whose healthy answer lists its GPUs (their UUIDs), what changed or stays wrong (one query for all
    of them); nodes with every card present and none lost before are left out."""
    listed = {node_id: set(uuids) for node_id, uuids in listed_by_node.items()}
    found: dict[int, Presence] = {}
    if not listed:
        return found
    rows = Gpu.objects.filter(node_id__in=listed).exclude(uuid="").values_list(
        "pk", "node_id", "index", "uuid", "lost_at", "status")
    for pk, node_id, index, uuid, lost_at, status in rows:
        if status == GpuStatus.UNAVAILABLE and lost_at is None:
            continue  # taken out by its provider or an operator: nobody rents it, whether it answers or not
        present = uuid in listed[node_id]
        if present and lost_at is not None:
            found.setdefault(node_id, Presence()).back.append(pk)
        elif not present:
            presence = found.setdefault(node_id, Presence())
            presence.missing.append(pk)
            if lost_at is None:
                presence.newly_missing.append((index, uuid))
    return found


def node_gpus_presence(*, node: Node, presence: Presence, last_seen: datetime | None,
                       looked_at: datetime | None = None) -> list[int]:
    """Act on what one check found about the node's GPUs; the ids of the instances interrupted now. `last_seen`:
    the node's last healthy check before this one (the last moment its missing cards were listed).

    `looked_at`: when the look that found them missing began (a verification's inventory: nodes.node_apply_inventory).
    With it, an instance that held a missing card then but is not interrupted (its renter's stop, restart or destroy
    closed its billing between the look and here, up to that moment) is given back what its run was billed after
    `last_seen` (interruptions.lost_usage_give_back, once: the reversal's key), as the health check
    (fleet_record._usage_after_loss_given_back) and the reconciler do. Before, a verification's inventory gave nothing
    back: the renter paid for the card's loss up to their own stop. The health check passes its probe's start (it
    also gives back in its own steps: fleet_record._usage_after_loss_given_back; once each, by the reversal's key).

    The give-back comes first, right after the look, before any interruption or notice (those of other holders take
    a while), and again for a holder that a stop overtakes just before its own interruption, in the transaction that
    finds it no longer running. Before, it came in the loop with the interruptions: Celery's soft time limit landing
    in an earlier holder's interruption gave nothing back, and no later look can (it begins after the stop)."""
    now = timezone.now()
    detail = "a GPU it holds is no longer listed by nvidia-smi on the server"
    held_then: set[int] = set()  # those that held a missing card when the look began (a stop lets it go)
    if looked_at is not None and presence.missing:
        held_then = _holders_at(gpu_ids=presence.missing, at=looked_at)
        # Given back now, of those billed past the last sighting (one waiting interrupted for its card is not).
        for instance_id in Instance.objects.filter(pk__in=held_then, billed_until__gt=last_seen) \
                .order_by("pk").values_list("pk", flat=True) if last_seen is not None else ():
            instance_svc.lost_usage_give_back(instance_id=instance_id, since=last_seen, looked_at=looked_at,
                                              answered_at=None, detail=detail)
    if presence.back:
        gpus_returned(gpu_ids=presence.back)
        NodeEvent.objects.create(node=node, kind="gpu_back",
                                 message=f"{len(presence.back)} lost GPU(s) listed by nvidia-smi again.")
    if not presence.missing:
        return []
    with transaction.atomic():
        Gpu.objects.filter(pk__in=presence.missing, lost_at__isnull=True).update(lost_at=now)
        # Only a free one is taken out now: a held one stays the instance's until it lets it go (held_stays_rented).
        Gpu.objects.filter(pk__in=presence.missing, status=GpuStatus.FREE).update(status=GpuStatus.UNAVAILABLE)
    if presence.newly_missing:
        cards = ", ".join(f"GPU {index} ({uuid})" for index, uuid in presence.newly_missing)
        NodeEvent.objects.create(node=node, kind="gpu_lost", level=NodeEvent.Level.CRITICAL,
                   message=f"{cards} no longer listed by nvidia-smi while the server answers (fallen off the bus?). "
                           "Taken off the offers; the instances on it are interrupted until it answers again "
                           "(usually after a restart of the server).")
    holders = set(GpuAllocation.objects.filter(gpu_id__in=presence.missing, released_at__isnull=True)
                  .values_list("instance_id", flat=True))
    holders |= set(MigSliceAllocation.objects.filter(mig_slice__gpu_id__in=presence.missing,
                                                     released_at__isnull=True).values_list("instance_id", flat=True))
    interrupted = []
    for instance_id in sorted(holders):
        with transaction.atomic():  # its row locked by the interruption: a stop comes before or after both
            if instance_svc.instance_interrupt(instance_id=instance_id, since=last_seen,
                                               cause=InterruptionCause.GPU_LOST, detail=detail) is not None:
                interrupted.append(instance_id)
            elif looked_at is not None and instance_id in held_then:
                # No longer running: a stop, restart or destroy since the give-back above closed its billing.
                instance_svc.lost_usage_give_back(instance_id=instance_id, since=last_seen, looked_at=looked_at,
                                                  answered_at=None, detail=detail)
    return interrupted


def _holders_at(*, gpu_ids: Collection[int], at: datetime) -> set[int]:
    """The instances that held one of `gpu_ids`, whole or by a MIG slice, at `at` (allocated before it, let go
    after it or not yet)."""
    live = Q(released_at__isnull=True) | Q(released_at__gt=at)
    held = set(GpuAllocation.objects.filter(live, gpu_id__in=gpu_ids, allocated_at__lt=at)
               .values_list("instance_id", flat=True))
    return held | set(MigSliceAllocation.objects.filter(live, mig_slice__gpu_id__in=gpu_ids, allocated_at__lt=at)
                      .values_list("instance_id", flat=True))


def held_when(*, instance_ids: Collection[int], gpu_ids: Collection[int], at: datetime) -> set[int]:
    """Of `instance_ids`, those that held one of `gpu_ids`, whole or by a MIG slice, at `at` (allocated before it,
    let go after it or not yet): the holders a check whose probe began then judged by the cards' loss."""
    if not instance_ids or not gpu_ids:
        return set()
    live = Q(released_at__isnull=True) | Q(released_at__gt=at)
    held = set(GpuAllocation.objects.filter(live, instance_id__in=instance_ids, gpu_id__in=gpu_ids,
                                            allocated_at__lt=at).values_list("instance_id", flat=True))
    return held | set(MigSliceAllocation.objects.filter(
        live, instance_id__in=instance_ids, mig_slice__gpu_id__in=gpu_ids, allocated_at__lt=at)
        .values_list("instance_id", flat=True))


def gpus_returned(*, gpu_ids: Iterable[int]) -> None:
    """Lost GPUs listed again (by a health check, or a verification's inventory): no longer lost, and one the
    loss made unavailable free again, unless an instance still holds it. So for a split GPU's slices: those its
    loss made unavailable (let go by their instance while it was lost: instances.mig.instance_release_slices) are
    free again, unless an instance holds them; those free all along are offered again with the card (the offers
    and booking leave a lost GPU's slices out: marketplace.selectors.free_slices). A slice its last check did not
    prove (unavailable before the loss, and not rented since) stays so."""
    gpu_ids = list(gpu_ids)
    if not gpu_ids:
        return
    with transaction.atomic():
        returned = list(Gpu.objects.select_for_update().filter(pk__in=gpu_ids, lost_at__isnull=False)
                        .order_by("pk").values_list("pk", flat=True))  # id order, as every lock of GPU rows
        held = set(GpuAllocation.objects.filter(gpu_id__in=returned, released_at__isnull=True)
                   .values_list("gpu_id", flat=True))
        Gpu.objects.filter(pk__in=returned, status=GpuStatus.UNAVAILABLE).exclude(pk__in=held).update(
            status=GpuStatus.FREE)
        let_go_while_lost = MigSliceAllocation.objects.filter(mig_slice=OuterRef("pk"),
                                                              released_at__gte=OuterRef("gpu__lost_at"))
        live = MigSliceAllocation.objects.filter(mig_slice=OuterRef("pk"), released_at__isnull=True)
        MigSlice.transition_rows(
            MigSlice.objects.filter(Exists(let_go_while_lost), ~Exists(live), gpu_id__in=returned,
                                    gpu__status=GpuStatus.MIG),
            SliceStatus.FREE)
        Gpu.objects.filter(pk__in=returned).update(lost_at=None)


def holds_lost_gpu() -> Q:
    """A filter on Instance: it holds a lost GPU, whole or by a MIG slice (it waits interrupted for the card)."""
    whole = GpuAllocation.objects.filter(instance=OuterRef("pk"), released_at__isnull=True, gpu__lost_at__isnull=False)
    sliced = MigSliceAllocation.objects.filter(instance=OuterRef("pk"), released_at__isnull=True,
                                               mig_slice__gpu__lost_at__isnull=False)
    return Q(Exists(whole)) | Q(Exists(sliced))


def instance_waits_for_gpu(*, instance_id: int) -> bool:
    """Whether an interrupted instance holds a GPU that is lost (it is not resumed before the card answers)."""
    return Instance.objects.filter(holds_lost_gpu(), pk=instance_id).exists()
