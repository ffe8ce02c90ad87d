"""MIG slices for instances: allocation by the same rules as whole GPUs (one statement, FOR UPDATE SKIP LOCKED,
a unique index on live allocations) plus the parent rule: a slice is taken only while its GPU is split (`mig`) and
not lost (`lost_at`: fallen off the bus, provisioning.services.gpu_presence), read under a share lock on the GPU's
row, so that the GPU cannot go back to whole renting meanwhile (provisioning.services.mig takes that row FOR UPDATE
and finds the allocation). The offers count the same slices (marketplace.selectors.free_slices)."""
from collections import Counter
from datetime import datetime
from typing import Any

from django.db import IntegrityError, connection
from django.utils import timezone

from core.errors import Conflict
from core.sql import constraint_violated
from marketplace.mig import layout_by_gpu
from marketplace.models import (
    Gpu,
    GpuAllocation,
    GpuStatus,
    Instance,
    MigSlice,
    MigSliceAllocation,
    Node,
    SliceStatus,
)
from notifications.services.notify import Kind, notify

_LIVE_INDEX = "mig_slice_in_at_most_one_live_allocation"


def free_slice_count(node_id: int, profile: str) -> int:
    """The node's free slices of `profile` that a booking may take (a priced profile, asked first by the booking)."""
    return MigSlice.objects.filter(node_id=node_id, profile=profile, status=SliceStatus.FREE,
                                   gpu__status=GpuStatus.MIG, gpu__lost_at__isnull=True).count()


def free_slices_ctes(node_id: int, profile: str, count: int) -> tuple[str, list[Any]]:
    """The CTEs of a booking's statement (allocation._allocate_free_units) that take up to `count` free slices of
    `profile` on the node whose GPU is split and not lost: their GPUs' rows under a share lock, the slices FOR UPDATE
    SKIP LOCKED, marked rented; `rented` holds their ids. PostgreSQL."""
    q = connection.ops.quote_name
    gpu, sl = (q(m._meta.db_table) for m in (Gpu, MigSlice))
    sources = sorted(MigSlice.transitions.action_sources("rent"))
    sql = (f"parents AS (SELECT id FROM {gpu} WHERE node_id = %s AND status = %s AND lost_at IS NULL "  # noqa: S608
           f"ORDER BY id FOR SHARE), "
           f"picked AS (SELECT s.id FROM {sl} s JOIN parents p ON p.id = s.gpu_id WHERE s.node_id = %s "
           f"AND s.status = %s AND s.profile = %s ORDER BY s.gpu_id, s.device LIMIT %s FOR UPDATE OF s SKIP LOCKED), "
           f"rented AS (UPDATE {sl} s SET status = %s FROM picked WHERE s.id = picked.id AND s.status = ANY(%s) "
           f"RETURNING s.id)")
    return sql, [node_id, GpuStatus.MIG, node_id, SliceStatus.FREE, profile, count, SliceStatus.RENTED, sources]


def allocate_free_slices_orm(instance: Instance, node_id: int, profile: str, count: int, at: datetime) -> int:
    """SQLite (the demo), where writes are serialised anyway: the same allocation through the ORM. Returns how many
    it took (fewer: the caller raises and rolls back)."""
    parents = list(Gpu.objects.select_for_update().filter(node_id=node_id, status=GpuStatus.MIG, lost_at__isnull=True)
                   .values_list("pk", flat=True))
    picked = list(MigSlice.objects.filter(node_id=node_id, profile=profile, status=SliceStatus.FREE,
                                          gpu_id__in=parents).order_by("gpu_id", "device")[:count])
    if len(picked) == count:
        MigSlice.transition_rows(MigSlice.objects.filter(pk__in=[s.pk for s in picked]), SliceStatus.RENTED,
                                 action="rent")
        MigSliceAllocation.objects.bulk_create(
            MigSliceAllocation(instance=instance, mig_slice=s, allocated_at=at) for s in picked)
    return len(picked)


SLICES_TAKEN_MESSAGE = "The MIG slices were taken by another booking meanwhile; try again."
LIVE_SLICE_INDEX = _LIVE_INDEX


def instance_release_slices(*, instance: Instance, at: datetime | None = None) -> list[str]:
    """End the instance's live slice allocations and free the slices (a slice made unavailable meanwhile stays
    so); the UUIDs released. A slice of a lost GPU (gone from the node's nvidia-smi) becomes unavailable, as a lost
    whole GPU does (instances.common.instance_release_gpus): provisioning.services.gpu_presence frees it when the
    card is listed again. Idempotent. Call with the instance's row locked."""
    live = list(MigSliceAllocation.objects.filter(instance_id=instance.pk, released_at__isnull=True)
                .select_related("mig_slice__gpu"))
    if not live:
        return []
    _lock_parents_shared(sorted({a.mig_slice.gpu_id for a in live}))
    MigSliceAllocation.objects.filter(pk__in=[a.pk for a in live]).update(released_at=at or timezone.now())
    released = MigSlice.objects.filter(pk__in=[a.mig_slice_id for a in live])
    MigSlice.transition_rows(released.filter(gpu__lost_at__isnull=False), SliceStatus.UNAVAILABLE)
    withheld, due = _slices_outside_declaration([a.mig_slice for a in live])
    MigSlice.transition_rows(released.filter(pk__in=withheld), SliceStatus.UNAVAILABLE)
    MigSlice.transition_rows(released, SliceStatus.FREE, action="release")
    # The card's other free slices too: the provider re-splits the whole card, which a renter booking one of its
    # old slices meanwhile would hold up again.
    MigSlice.transition_rows(MigSlice.objects.filter(gpu_id__in=due, status=SliceStatus.FREE), SliceStatus.UNAVAILABLE)
    layout_due_notify(instance.node_id, sorted(Gpu.objects.filter(pk__in=due).values_list("index", flat=True)))
    return sorted(a.mig_slice.uuid for a in live)


def _slices_outside_declaration(released: list[MigSlice]) -> tuple[list[int], list[int]]:
    """(the released slices the card's declared layout no longer has room for, the GPUs whose last renter left and
    whose declared layout is other than their slices): the former are not offered again (unavailable until the
    check judges the card); the latter are withheld whole, their layout due (layout_due_notify). Before, such a
    slice came back free on release and the declaration waited for the periodic check (days): a card declared
    whole again was still rented by the slice."""
    layout = layout_by_gpu(Node.objects.filter(pk=released[0].node_id).values_list("mig_layout", flat=True).first())
    withheld: list[int] = []
    due: list[int] = []
    for gpu_id in sorted({s.gpu_id for s in released}):
        mine = [s for s in released if s.gpu_id == gpu_id]
        declared = layout.get(mine[0].gpu.index, [])
        others = Counter(MigSlice.objects.filter(gpu_id=gpu_id, status__in=[SliceStatus.FREE, SliceStatus.RENTED])
                         .exclude(pk__in=[s.pk for s in mine]).values_list("profile", flat=True))
        room = Counter(declared) - others
        kept, out = [], []
        for s in sorted(mine, key=lambda s: s.device):
            if room[s.profile] > 0:
                room[s.profile] -= 1
                kept.append(s.profile)
            else:
                out.append(s.pk)
        withheld += out
        left = not MigSliceAllocation.objects.filter(mig_slice__gpu_id=gpu_id, released_at__isnull=True).exists()
        if left and (out or sorted(declared) != sorted([*others.elements(), *kept])):
            withheld += [s.pk for s in mine if s.pk not in out]
            due.append(gpu_id)
    return withheld, due


def hold_cards_declared_split(gpu_ids: list[int], node_id: int) -> None:
    """Whole cards just released (free again) that their provider declared split meanwhile (the layout waited for
    the renter: verification.mig.pending_layout): `mig`, which whole booking never takes, with no slice until a
    check proves the declared ones; their layout due (layout_due_notify). Before, they went back free, bookable
    whole, until the periodic check (days later)."""
    layout = layout_by_gpu(Node.objects.filter(pk=node_id).values_list("mig_layout", flat=True).first())
    if not layout:
        return
    cards = Gpu.objects.filter(pk__in=gpu_ids, status=GpuStatus.FREE, index__in=list(layout))
    indices = sorted(cards.values_list("index", flat=True))
    if Gpu.transition_rows(cards, GpuStatus.MIG):
        layout_due_notify(node_id, indices)


def layout_due_notify(node_id: int, indices: list[int]) -> None:
    """Tell the provider that these cards, declared anew while rented, are free now: they configure them as declared
    (the agent never does) and press Verify now, which lists the new slices. Nothing is queued: until then the check
    leaves such a card pending (verification.mig.pending_layout, `awaiting`), withheld, not rejected. Before, the
    release queued the node's check at once, which found the card in its old configuration and rejected the whole
    node (found by review)."""
    if not indices:
        return
    node = Node.objects.select_related("provider").get(pk=node_id)
    layout = layout_by_gpu(node.mig_layout)
    for index in indices:
        todo = (f"Configure it as declared ({', '.join(layout[index])}), then press Verify now: its new slices are "
                "listed once the check sees them." if index in layout else
                f"Turn its MIG mode off (`nvidia-smi -i {index} -mig 0`), as declared, then press Verify now: it is "
                "listed whole once the check sees it so.")
        notify(user=node.provider, kind=Kind.NODE_MIG_LAYOUT_DUE,
               dedupe_key=f"node_mig_layout_due:{node.pk}:{index}:{timezone.now().isoformat()}",
               payload={"node": node.pk, "name": node.name, "gpu": index, "declared": layout.get(index, []),
                        "message": f"Node {node.name}: GPU {index} is free now. {todo} Until then the card is "
                                   "withheld from the offers; the rest of the server stays listed."})


def node_cards_pending_layout(node_id: int) -> list[dict[str, Any]]:
    """The node's cards whose declared MIG layout waits for their renters (as verification.mig.pending_layout
    finds them, read from the rows): a card held whole and declared split, or one with rented slices declared whole
    again or split otherwise than its slices (free and rented) are. Each as {"gpu": index, "declared": [profiles]
    ([]: whole), "now": [profiles] ([]: whole), "renters": the instances holding it, "free": False}, by index.
    Also the cards freed for their layout (_cards_freed_for_layout), each with "free": True, "renters": 0 and
    "now": None (the rows no longer say how the server shows it). Read-only, for the provider's node page, which
    did not say it (only the check's steps, an event and the API's last_error did)."""
    layout = layout_by_gpu(Node.objects.filter(pk=node_id).values_list("mig_layout", flat=True).first())
    holders: dict[int, set[int]] = {}
    whole: set[int] = set()
    for index, instance_id in (GpuAllocation.objects.filter(gpu__node_id=node_id, released_at__isnull=True)
                               .values_list("gpu__index", "instance_id")):
        holders.setdefault(index, set()).add(instance_id)
        whole.add(index)
    for index, instance_id in (MigSliceAllocation.objects.filter(mig_slice__node_id=node_id,
                                                                 released_at__isnull=True)
                               .values_list("mig_slice__gpu__index", "instance_id")):
        holders.setdefault(index, set()).add(instance_id)
    configured: dict[int, list[str]] = {}
    for index, profile in (MigSlice.objects.filter(node_id=node_id, status__in=[SliceStatus.FREE,
                                                                                SliceStatus.RENTED])
                           .values_list("gpu__index", "profile")):
        configured.setdefault(index, []).append(profile)
    pending = []
    for index in sorted(holders):
        now = [] if index in whole else sorted(configured.get(index, []))
        declared = layout.get(index, [])
        if (index in whole and declared) or (index not in whole and sorted(declared) != now):
            pending.append({"gpu": index, "declared": list(declared), "now": now, "renters": len(holders[index]),
                            "free": False})
    for index in _cards_freed_for_layout(node_id, set(holders), set(configured)):
        pending.append({"gpu": index, "declared": list(layout.get(index, [])), "now": None, "renters": 0,
                        "free": True})
    return sorted(pending, key=lambda c: c["gpu"])


def _cards_freed_for_layout(node_id: int, held: set[int], configured: set[int]) -> list[int]:
    """The node's cards whose last renter left with their declared layout due (layout_due_notify): withheld whole
    (`mig`, no free or rented slice, not lost), nobody holding them, rented before. They wait for the provider to
    re-split them and press Verify now (provisioning.services.mig.cards_awaiting), which lists their slices or
    makes them whole. Before, the node page listed only cards renters hold: such a card showed nowhere. Bounded:
    three queries, whatever the card count."""
    withheld = set(Gpu.objects.filter(node_id=node_id, status=GpuStatus.MIG, lost_at__isnull=True)
                   .exclude(index__in=held | configured).values_list("index", flat=True))
    if not withheld:
        return []
    rented = set(GpuAllocation.objects.filter(gpu__node_id=node_id, gpu__index__in=withheld)
                 .values_list("gpu__index", flat=True).distinct())
    rented |= set(MigSliceAllocation.objects.filter(mig_slice__node_id=node_id, mig_slice__gpu__index__in=withheld)
                  .values_list("mig_slice__gpu__index", flat=True).distinct())
    return sorted(withheld & rented)


def _lock_parents_shared(gpu_ids: list[int]) -> None:
    """The slices' GPUs under a share lock (in id order, card before slices as bookings and gpu_presence take them),
    so that whether a card is lost is read as committed: read unlocked, a card found back meanwhile
    (gpu_presence.gpus_returned, which saw the allocation still live and left the slice) was taken as lost and the
    slice stayed unavailable on a card that is back, off the offers until the next check (found by review)."""
    if connection.vendor != "postgresql":
        return  # SQLite serialises writes
    table = connection.ops.quote_name(Gpu._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT id FROM {table} WHERE id = ANY(%s) ORDER BY id FOR SHARE", [gpu_ids])  # noqa: S608


def instance_slice_uuids(*, instance: Instance) -> list[str]:
    """The MIG-... UUIDs the instance holds now (from `live_slices` when instances_for_user prefetched them)."""
    live = getattr(instance, "live_slices", None)
    if live is not None:
        return sorted(a.mig_slice.uuid for a in live)
    return sorted(MigSliceAllocation.objects.filter(instance=instance, released_at__isnull=True)
                  .values_list("mig_slice__uuid", flat=True))


def instance_slice_gpu_indices(*, instance: Instance) -> list[int]:
    """The indices of the GPUs its slices are on (what the agent's `gpu_indices` names for a MIG VM)."""
    live = getattr(instance, "live_slices", None)
    if live is not None:
        return sorted({a.mig_slice.gpu.index for a in live})
    return sorted(set(MigSliceAllocation.objects.filter(instance=instance, released_at__isnull=True)
                      .values_list("mig_slice__gpu__index", flat=True)))


def _last_slices(instance: Instance) -> list[int]:
    """The ids of the slices the instance held last (its allocations released together, at its stop)."""
    last = MigSliceAllocation.objects.filter(instance=instance).order_by("-released_at").values_list(
        "released_at", flat=True).first()
    return list(MigSliceAllocation.objects.filter(instance=instance, released_at=last)
                .values_list("mig_slice_id", flat=True))


def slices_start_refusal(instance: Instance) -> str:
    """Why a stopped MIG instance cannot take its slices back (reallocate_slices said False), in words a renter can
    act on, card by card. A stop frees its slices as it frees any GPU, so a layout its provider declared for the
    card meanwhile (verification.mig.pending_layout) is applied once its last renter has stopped: those slices
    never come back, and the renter is told so, not "try again later" (left over from c845497: before, the start
    said "in use by another instance now or no longer listed; try again later" for a slice nobody holds)."""
    mine = list(MigSlice.objects.filter(pk__in=_last_slices(instance)).select_related("gpu")
                .order_by("gpu__index", "device"))
    layout = layout_by_gpu(Node.objects.filter(pk=instance.node_id).values_list("mig_layout", flat=True).first())
    taken = set(MigSliceAllocation.objects.filter(mig_slice__in=mine, released_at__isnull=True)
                .exclude(instance=instance).values_list("mig_slice_id", flat=True))
    reasons: list[str] = []
    for_good = False
    for index in sorted({s.gpu.index for s in mine}):
        own = [s for s in mine if s.gpu.index == index]
        gpu = own[0].gpu
        others = MigSlice.objects.filter(gpu=gpu, status__in=[SliceStatus.FREE, SliceStatus.RENTED]).exclude(
            pk__in=[s.pk for s in own]).values_list("profile", flat=True)
        if gpu.lost_at is not None:
            reasons.append(f"GPU {index} is missing from its server (its health check lost it)")
        elif index not in layout:
            for_good = True
            reasons.append(f"its provider declared GPU {index} whole again, so its slices are no longer offered")
        elif sorted(layout[index]) != sorted([*others, *(s.profile for s in own)]):
            for_good = True
            reasons.append(f"its provider declared a new MIG layout for GPU {index} ({', '.join(layout[index])}), "
                           "so the slices it was created with are no longer offered")
        elif any(s.pk in taken for s in own):
            reasons.append(f"its slice of GPU {index} is in use by another instance now")
        elif any(s.status == SliceStatus.UNAVAILABLE for s in own):
            for_good = True
            reasons.append(f"its slice of GPU {index} is out of service (its last check did not prove it)")
    if not reasons:
        return ("Its MIG slices are in use by another instance now or no longer listed; try again later, or "
                "destroy the instance.")
    if all(r.endswith("in use by another instance now") for r in reasons):
        return "Its MIG slices are in use by another instance now; try again later, or destroy the instance."
    then = ("They do not come back: destroy the instance, and book a slice of the server's current layout."
            if for_good else "Try again later, or destroy the instance.")
    return f"Its MIG slices cannot be taken again: {'; '.join(reasons)}. {then}"


def reallocate_slices(instance: Instance, at: datetime) -> bool:
    """A stopped MIG instance takes back the slices it last held (locked as at booking); False when one of them
    is taken, unavailable, or its GPU no longer split or lost. Call with the instance's row locked."""
    previous = _last_slices(instance)
    if not previous:
        return False
    parents = list(Gpu.objects.select_for_update(of=("self",)).filter(
        mig_slices__in=previous, status=GpuStatus.MIG, lost_at__isnull=True).order_by("pk")
        .values_list("pk", flat=True))
    slices = list(MigSlice.objects.select_for_update(skip_locked=True).filter(
        pk__in=previous, status=SliceStatus.FREE, gpu_id__in=parents))
    if len(slices) != len(previous):
        return False
    MigSlice.transition_rows(MigSlice.objects.filter(pk__in=previous), SliceStatus.RENTED, action="rent")
    try:
        MigSliceAllocation.objects.bulk_create(
            MigSliceAllocation(instance=instance, mig_slice=s, allocated_at=at) for s in slices)
    except IntegrityError as exc:
        if constraint_violated(exc) == _LIVE_INDEX:  # by name, never in the text (core.sql)
            raise Conflict(SLICES_TAKEN_MESSAGE) from None
        raise
    return True
