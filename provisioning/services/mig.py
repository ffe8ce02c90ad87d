"""MIG slices from a check: the slices a verification proved become rentable units, the rest unavailable."""
from collections import Counter
from collections.abc import Collection
from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Q

from core.sql import constraint_violated
from marketplace.mig import layout_by_gpu
from marketplace.models import Gpu, GpuAllocation, GpuStatus, MigSlice, MigSliceAllocation, Node, NodeState, SliceStatus
from marketplace.models.nodes import LISTABLE_VERDICTS
from provisioning.models import NodeEvent, VerificationRun
from provisioning.services.nodes import node_event
from provisioning.verification.mig import card_configuration

# How many of the node's last listed checks cards_last_judged reads back (a card pending in each is not known).
RUNS_LOOKED_AT = 20


def layout_changed_gpus(declared: list[dict[str, Any]] | None, judged: list[dict[str, Any]] | None) -> list[int]:
    """The GPUs whose declared MIG profiles differ between two layouts (the one a check judged, the one declared
    now): split, no longer split, or split otherwise. The order of a GPU's profiles is no change."""
    now, then = layout_by_gpu(declared), layout_by_gpu(judged)
    return sorted(g for g in set(now) | set(then) if sorted(now.get(g, [])) != sorted(then.get(g, [])))


def cards_last_judged(node: Node) -> dict[int, tuple[list[str] | None, datetime]]:
    """Each card's configuration (verification.mig.card_configuration: None whole) as the last check that listed
    the node saw it, where that check judged it (its layout not pending), with that check's time: on a listed node
    a card was configured as then declared, or the check would have rejected it. Read back from the stored runs,
    newest first."""
    found: dict[int, tuple[list[str] | None, datetime]] = {}
    runs = (VerificationRun.objects.filter(node=node, verdict__in=LISTABLE_VERDICTS).order_by("-created_at", "-pk")
            .values_list("inventory", "figures", "created_at")[:RUNS_LOOKED_AT])
    for inventory, figures, at in runs:
        devices: dict[int, list[dict[str, Any]]] = {}
        for dev in (inventory or {}).get("mig") or []:
            devices.setdefault(dev.get("gpu"), []).append(dev)
        skipped = set((figures or {}).get("mig_pending") or [])
        for card in (inventory or {}).get("gpus") or []:
            index = card.get("index")
            if isinstance(index, int) and index not in found and index not in skipped:
                found[index] = (card_configuration(card, devices.get(index, [])), at)
        if len(found) >= node.gpu_count:
            break
    return found


def cards_awaiting(node: Node, layout: dict[int, list[str]]) -> dict[int, list[str] | None]:
    """The cards rented since they were last judged whose declared layout (`layout`, by index) is another than the
    configuration they were judged in, each with that configuration: what verification.mig.pending_layout leaves
    pending, once nobody holds them, while the server still shows them so (the provider re-splits a card by hand,
    and only once its renters left). Derived from the stored checks and allocations: no flag to keep in step.
    A card nobody rented since is not: its provider could configure it before declaring, and a check finding it
    otherwise rejects it, as before."""
    awaiting: dict[int, list[str] | None] = {}
    for index, (then, at) in cards_last_judged(node).items():
        if (sorted(layout[index]) if index in layout else None) == then:
            continue
        since = Q(released_at__isnull=True) | Q(released_at__gt=at)
        if (GpuAllocation.objects.filter(since, gpu__node=node, gpu__index=index).exists()
                or MigSliceAllocation.objects.filter(since, mig_slice__node=node,
                                                     mig_slice__gpu__index=index).exists()):
            awaiting[index] = then
    return awaiting


def node_apply_mig_slices(*, node: Node, slices: list[dict[str, Any]], listable: bool,
                          judged_layout: list[dict[str, Any]] | None = None,
                          pending: Collection[int] = ()) -> list[int]:
    """Make the node's slice rows what the check found (call inside the check's transaction, node row locked).

    A proven slice of a listable node is free to rent (created at its first proof); a slice not proven, not seen
    again, or on a node the check did not list is unavailable. A rented slice is left as it is: its renter keeps
    it. A declared GPU becomes `mig` (never rented whole) once free; a GPU no longer declared split goes back to
    `free` when none of its slices is allocated, under its row lock (booking a slice holds a share lock on it).

    `judged_layout`: the layout the check judged (None: the one declared now). A GPU whose layout the provider
    changed since (node_update during the check: layout_changed_gpus) is not judged by this check: its slices are
    unavailable (but rented ones) and its status stays as it was, neither made whole nor split. Before, the
    declared layout was applied to what the check saw of the old one: a card taken out of the layout mid-check was
    listed whole while still in MIG mode on the server (found by review). Returns those GPUs' indices.

    `pending`: the cards whose declared layout the check left pending (verification.mig.pending_layout): one
    declared whole stays `mig` (a free card declared whole again, still in MIG mode on the server, is not offered
    whole); one declared split becomes `mig` as any other, never booked whole meanwhile."""
    if Node.objects.filter(pk=node.pk, state=NodeState.RETIRED).exists():
        # Retired while its check ran (under the node's lock, which the caller holds): node_retire let go of its
        # slices' UUIDs, and claimed again they would block the same server's slices registered again.
        return []
    layout = layout_by_gpu(node.mig_layout)
    changed = set(layout_changed_gpus(node.mig_layout, node.mig_layout if judged_layout is None else judged_layout))
    layout = {gpu: profiles for gpu, profiles in layout.items() if gpu not in changed}
    # Locked in id order, as every other lock of several GPU rows (the admin's node page, a MIG release's share
    # lock): by index, once an inventory had numbered the cards anew, it deadlocked with them (found by review).
    locked = Gpu.objects.select_for_update().filter(node=node).order_by("pk")
    gpus = {g.index: g for g in sorted(locked, key=lambda g: g.index)}
    live = set(MigSliceAllocation.objects.filter(mig_slice__node=node, released_at__isnull=True)
               .values_list("mig_slice_id", flat=True))
    existing = {s.uuid: s for s in MigSlice.objects.filter(node=node)}
    # A UUID the check found on two slices proves neither (verification.mig names it): keyed by UUID, one of them
    # would have had no row.
    counted = Counter(s["uuid"] for s in slices)
    proven = {s["uuid"]: s for s in slices if s.get("proven") and listable and s["gpu"] in layout and s["gpu"] in gpus
              and counted[s["uuid"]] == 1}
    for uuid, row in existing.items():
        if row.pk in live or uuid in proven:
            continue
        if row.status != SliceStatus.UNAVAILABLE:
            row.status = SliceStatus.UNAVAILABLE
            row.save(update_fields=["status"])
    try:
        with transaction.atomic():
            for uuid, found in proven.items():
                known = existing.get(uuid)
                if known is None:
                    MigSlice.objects.create(node=node, gpu=gpus[found["gpu"]], profile=found["profile"],
                                            device=found["device"], uuid=uuid, memory_mib=found["memory_mib"] or 0)
                elif known.pk not in live:
                    known.gpu, known.profile, known.device = gpus[found["gpu"]], found["profile"], found["device"]
                    known.memory_mib, known.status = found["memory_mib"] or 0, SliceStatus.FREE
                    known.save(update_fields=["gpu", "profile", "device", "memory_mib", "status"])
    except IntegrityError as exc:  # a MIG UUID another node's slice holds: the same card listed twice
        if constraint_violated(exc) != "mig_slice_unique_uuid":  # by name, never in the text (core.sql)
            raise
        node_event(node=node, kind="mig_slices_duplicate",
                   message="A MIG device of this node belongs to another node's slices; "
                           "none of its slices is listed.", level=NodeEvent.Level.WARNING)
    for index, gpu in gpus.items():
        if index in changed:
            continue  # the next check judges it under the layout declared now
        # A card declared split is never rented whole, slices or none: before, one the check left without a slice
        # row (a MIG UUID repeated across two cards, one another node's slices hold) stayed free, bookable whole
        # while in MIG mode on the server (found by review).
        if index in layout and gpu.status == GpuStatus.FREE:
            gpu.status = GpuStatus.MIG
            gpu.save(update_fields=["status"])
        elif (index not in layout and index not in pending and gpu.status == GpuStatus.MIG
              and not MigSliceAllocation.objects.filter(mig_slice__gpu=gpu, released_at__isnull=True).exists()):
            MigSlice.objects.filter(gpu=gpu).exclude(status=SliceStatus.UNAVAILABLE).update(
                status=SliceStatus.UNAVAILABLE)
            gpu.status = GpuStatus.FREE
            gpu.save(update_fields=["status"])
    return sorted(changed)
