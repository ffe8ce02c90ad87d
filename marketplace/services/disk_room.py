"""How much of a node's disk is still free to promise: what its server last reported free (`disk_free_gb`, at
`host_checked_at`), less what was promised there since, which that report could not count: the disks of the
instances booked since (not over) and the volumes made since (not deleted). A volume and a booking both refuse
what does not fit (409 naming the room left); before, only a volume did, and counted only the volumes, so an
instance's disk could be promised beyond the server's free space (its runtime enforces a size limit, not room
that exists: the renters' disks then fill up together).

Three forms of one rule: the ORM's (volumes, SQLite), a SQL column the booking's node statement computes in the
same round trip (instances.allocation), and an annotation the offers show and filter as `disk_free_gb`
(selectors.disk_left_gb): a renter who filters on free disk is shown only offers whose booking that disk fits.
tests/marketplace/test_disk_room.py holds them equal. The partial indexes instance_node_live_idx and
volume_node_held_idx answer a node's part without reading its history (docs/BENCHMARKS.md).

Bookings on one node take its row FOR SHARE and run side by side: two at once may each see the room the other
takes (a volume's node lock is exclusive). The next report of the server corrects the figure; what is promised
is never more than the server reported free, plus at most one disk per booking running at that moment.
"""
from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Q, Sum

from core.errors import Conflict
from marketplace.models import Instance, Node, Volume
from marketplace.models.renting import FINAL_STATUSES
from marketplace.models.volumes import COMMITTED_VOLUME_STATES


@dataclass(frozen=True)
class DiskRoom:
    reported_gb: int  # free on the server at its last report
    promised_gb: int  # instance disks and volumes promised there since
    left_gb: int


def node_disk_room(node: Node) -> DiskRoom | None:
    """The node's room left (None when its server never reported its free disk: not judged)."""
    if node.disk_free_gb is None:
        return None
    since = Q() if node.host_checked_at is None else Q(created_at__gte=node.host_checked_at)
    disks = (Instance.objects.filter(since, node_id=node.pk).exclude(status__in=FINAL_STATUSES).order_by()
             .aggregate(gb=Sum("disk_gb"))["gb"] or 0)
    volumes = (Volume.objects.filter(since, node_id=node.pk, state__in=COMMITTED_VOLUME_STATES).order_by()
               .aggregate(gb=Sum("size_gb"))["gb"] or 0)
    return _room(node.disk_free_gb, disks + volumes)


def disk_room_from_columns(reported: int | None, promised: int | None) -> DiskRoom | None:
    """The room from the booking statement's two columns (DISK_PROMISED_SQL)."""
    return None if reported is None else _room(reported, promised or 0)


def _room(reported: int, promised: int) -> DiskRoom:
    return DiskRoom(reported_gb=reported, promised_gb=promised, left_gb=max(reported - promised, 0))


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
    """The 409's words: what the server reported, what was promised since, what is left, what to do."""
    also = (f", less {room.promised_gb} GB promised to instances and volumes there since: {room.left_gb} GB are "
            "left" if room.promised_gb else "")
    return (f"{server} reported {room.reported_gb} GB of free disk{also}; {what} of {wanted_gb} GB does not fit. "
            f"{instead}")


def _promised_sql() -> str:
    instance, volume = Instance._meta.db_table, Volume._meta.db_table
    over = ", ".join(f"'{status}'" for status in FINAL_STATUSES)  # the model's constants, not input
    held = ", ".join(f"'{state}'" for state in COMMITTED_VOLUME_STATES)
    since = "(n.host_checked_at IS NULL OR {t}.created_at >= n.host_checked_at)"
    return ("CASE WHEN n.disk_free_gb IS NULL THEN NULL ELSE "  # noqa: S608 (the models' tables and constants)
            f"(SELECT COALESCE(SUM(di.disk_gb), 0) FROM {instance} di WHERE di.node_id = n.id "
            f"AND di.status NOT IN ({over}) AND {since.format(t='di')}) + "
            f"(SELECT COALESCE(SUM(dv.size_gb), 0) FROM {volume} dv WHERE dv.node_id = n.id "
            f"AND dv.state IN ({held}) AND {since.format(t='dv')}) END")


# A column of a statement over the node as `n`: GB promised since its last report (NULL: never reported).
DISK_PROMISED_SQL = _promised_sql()
