"""How much of a node's disk is still free to promise: the lower of two bounds.

- What its server last reported free (`disk_free_gb`, at `host_checked_at`), less what was promised there since,
  which that report could not count: the disks of the instances booked since (not over) and the volumes made since
  (not deleted: one being deleted holds its room until its node deletes it).
- The size of that file system (`disk_total_gb`, reported with it), less every disk and volume promised there
  that is still held, whenever it was promised. A disk or a volume takes its room as it fills, not when it is promised:
  a report after a booking still counts its empty disk as free, and the first bound alone let a server's promises
  grow past its size, report after report (found by review); their renters' disks would then fill up together.
  A server that never reported its size is judged by the first bound only.

An instance's disk is held while it is not over, and after it while its VM is still on the node: failed after it
ran (kept, stopped, until it is destroyed; not once its VM is known gone: `vm_gone`), or still to be removed there
(it holds a GPU or MIG slice, or `vm_cleanup_pending`): selectors.holds_its_disk, the volumes' holders too.
Counting no destroyed or failed instance, a failure gave its whole disk back to the offers with nothing freed on the
node (found by review, r49).

A volume and a booking both refuse what does not fit (409 naming the room left, DiskDoesNotFit).

Three forms of one rule: the ORM's (volumes, SQLite), SQL columns the booking's node statement computes in the
same round trip (instances.allocation), and an annotation the offers show and filter as `disk_free_gb`
(selectors.disk_left_gb): a renter who filters on free disk is shown only offers whose booking that disk fits.
tests/marketplace/test_disk_room.py holds them equal. The partial indexes instance_node_live_idx and
volume_node_held_idx answer a node's live part without reading its history (docs/BENCHMARKS.md); the instances
that are over but hold their disk are a second sum, over the node's history.

Bookings on one node take its row FOR SHARE and run side by side: two at once may each see the room the other
takes (a volume's node lock, FOR NO KEY UPDATE, and theirs wait for each other). What is promised is never more
than the room, plus at most one disk per booking running at that moment.
"""
from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Q, Sum

from core.errors import Conflict
from marketplace.models import GpuAllocation, Instance, InstanceStatus, MigSliceAllocation, Node, Volume
from marketplace.models.renting import FINAL_STATUSES
from marketplace.models.volumes import DISK_VOLUME_STATES
from marketplace.selectors import holds_its_disk


@dataclass(frozen=True)
class DiskRoom:
    reported_gb: int  # free on the server at its last report
    promised_gb: int  # instance disks and volumes promised there since
    left_gb: int
    total_gb: int | None = None  # the file system's size (None: never reported)
    promised_all_gb: int = 0  # every instance disk and volume held there

    @property
    def by_size(self) -> bool:
        """Whether the size bound is the one that limits."""
        return self.total_gb is not None and self.total_gb - self.promised_all_gb < self.reported_gb - self.promised_gb


def node_disk_room(node: Node) -> DiskRoom | None:
    """The node's room left (None when its server never reported its free disk: not judged)."""
    if node.disk_free_gb is None:
        return None
    since = None if node.host_checked_at is None else Q(created_at__gte=node.host_checked_at)  # None: all of it
    live_disks = Instance.objects.filter(holds_its_disk(), node_id=node.pk).order_by()
    held_volumes = Volume.objects.filter(node_id=node.pk, state__in=DISK_VOLUME_STATES).order_by()
    disks = live_disks.aggregate(since=Sum("disk_gb", filter=since), all=Sum("disk_gb"))
    volumes = held_volumes.aggregate(since=Sum("size_gb", filter=since), all=Sum("size_gb"))
    return _room(node.disk_free_gb, (disks["since"] or 0) + (volumes["since"] or 0), node.disk_total_gb,
                 (disks["all"] or 0) + (volumes["all"] or 0))


def disk_room_from_columns(reported: int | None, promised: int | None, total: int | None = None,
                           promised_all: int | None = None) -> DiskRoom | None:
    """The room from the booking statement's columns (DISK_PROMISED_SQL, DISK_PROMISED_ALL_SQL)."""
    return None if reported is None else _room(reported, promised or 0, total, promised_all or 0)


def _room(reported: int, promised: int, total: int | None = None, promised_all: int = 0) -> DiskRoom:
    if total is None:  # its size never reported: the first bound alone
        return DiskRoom(reported_gb=reported, promised_gb=promised, left_gb=max(reported - promised, 0))
    return DiskRoom(reported_gb=reported, promised_gb=promised, total_gb=total, promised_all_gb=promised_all,
                    left_gb=max(min(reported - promised, total - promised_all), 0))


class DiskDoesNotFit(Conflict):
    """A disk larger than the node's room left (409): the figures ride along, so that another API (compat.vast)
    can say it in its own words."""

    def __init__(self, node_id: int, room: DiskRoom, wanted_gb: int, what: str, instead: str, field: str):
        super().__init__(_refusal_text(f"Offer {node_id}'s server", room, wanted_gb, what, instead), field=field)
        self.room, self.wanted_gb, self.what = room, wanted_gb, what

    def reworded(self, server: str, instead: str) -> str:
        """The same refusal naming the server and the way out otherwise."""
        return _refusal_text(server, self.room, self.wanted_gb, self.what, instead)


def _refusal_text(server: str, room: DiskRoom, wanted_gb: int, what: str, instead: str) -> str:
    """The 409's words: the bound that limits (what the server reported and what was promised since, or its disk's
    size and what is promised there), what is left, what to dh."""
    if room.by_size:
        said = (f"{server} has a {room.total_gb} GB disk, and {room.promised_all_gb} GB of it are promised to "
                f"instances and volumes there: {room.left_gb} GB are left")
    elif room.promised_gb:
        said = (f"{server} reported {room.reported_gb} GB of free disk, less {room.promised_gb} GB promised to "
                f"instances and volumes there since: {room.left_gb} GB are left")
    else:
        said = f"{server} reported {room.reported_gb} GB of free disk"
    return f"{said}; {what} of {wanted_gb} GB does not fit. {instead}"


def _promised_sql(since: bool) -> str:
    instance, volume = Instance._meta.db_table, Volume._meta.db_table
    gpus, slices = GpuAllocation._meta.db_table, MigSliceAllocation._meta.db_table
    over = ", ".join(f"'{status}'" for status in FINAL_STATUSES)  # the model's constants, not input
    held = ", ".join(f"'{state}'" for state in DISK_VOLUME_STATES)
    after = " AND (n.host_checked_at IS NULL OR {t}.created_at >= n.host_checked_at)" if since else ""
    # selectors.holds_its_disk: the live ones (their partial index), then those over whose VM is still there.
    failed = InstanceStatus.FAILED.value
    kept = (f"(dh.status = '{failed}' AND dh.started_at IS NOT NULL AND NOT dh.vm_gone) "  # noqa: S608 (ditto)
            "OR dh.vm_cleanup_pending "
            f"OR EXISTS (SELECT 1 FROM {gpus} ga WHERE ga.instance_id = dh.id AND ga.released_at IS NULL) "
            f"OR EXISTS (SELECT 1 FROM {slices} sa WHERE sa.instance_id = dh.id AND sa.released_at IS NULL)")
    return ("CASE WHEN n.disk_free_gb IS NULL THEN NULL ELSE "  # noqa: S608 (the models' tables and constants)
            f"(SELECT COALESCE(SUM(di.disk_gb), 0) FROM {instance} di WHERE di.node_id = n.id "
            f"AND di.status NOT IN ({over}){after.format(t='di')}) + "
            f"(SELECT COALESCE(SUM(dh.disk_gb), 0) FROM {instance} dh WHERE dh.node_id = n.id "
            f"AND dh.status IN ({over}) AND ({kept}){after.format(t='dh')}) + "
            f"(SELECT COALESCE(SUM(dv.size_gb), 0) FROM {volume} dv WHERE dv.node_id = n.id "
            f"AND dv.state IN ({held}){after.format(t='dv')}) END")


# Columns of a statement over the node as `n`: GB promised since its last report, and GB promised there that are
# still held (NULL: its free disk never reported; the second is NULL too while its size was never reported).
DISK_PROMISED_SQL = _promised_sql(since=True)
DISK_PROMISED_ALL_SQL = _promised_sql(since=False).replace(
    "CASE WHEN n.disk_free_gb IS NULL", "CASE WHEN n.disk_free_gb IS NULL OR n.disk_total_gb IS NULL", 1)
