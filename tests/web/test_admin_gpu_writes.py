"""What a GPU's page and its node's page write (found by review): the GPU's form saved every column it had read,
so a booking committed between the page's read and its save was undone (the GPU back to free under the instance
holding it), and the node's page wrote the whole node row on a change of one of its GPUs, though nothing of the node
is editable there. Now the GPU row is read under its lock when the form is sent, only the columns the operator
changed are written (nothing when nothing changed), and the node's row is not written."""
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from marketplace.admin import GpuAdmin, NodeAdmin
from marketplace.models import Gpu, GpuStatus, Node
from provisioning.services.gpu_presence import Presence, gpus_returned, node_gpus_presence
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import book
from tests.web.conftest import logged_in
from tests.web.test_admin_pages import change_form

pytestmark = pytest.mark.django_db

GPUS = f'"{Gpu._meta.db_table}"'
NODES = f'"{Node._meta.db_table}"'


@pytest.fixture
def ops(operator):
    return logged_in(operator)


def _booked_before_the_save(monkeypatch, admin_class, renter, node, also=None):
    """The race, in the order it ran: the admin read the row and checked the form, then a booking committed (here
    in the admin's own transaction, which its lock cannot keep out), then the admin saved."""
    real = admin_class.save_form
    booked = []

    def save_form(self, request, form, change):
        booked.append(book(renter, node))
        if also is not None:
            also()
        return real(self, request, form, change)

    monkeypatch.setattr(admin_class, "save_form", save_form)
    return booked


def _status(gpu) -> str:
    return Gpu.objects.values_list("status", flat=True).get(pk=gpu.pk)


def test_a_booking_between_the_gpu_pages_read_and_its_save_stays(ops, renter, monkeypatch):
    node = make_listed_node(name="one-gpu", gpu_count=1)
    gpu = Gpu.objects.get(node=node)
    url = f"/admin/marketplace/gpu/{gpu.pk}/change/"
    data = change_form(ops, url, "gpu_form")
    assert data["status"] == ["free"]
    booked = _booked_before_the_save(monkeypatch, GpuAdmin, renter, node)
    r = ops.post(url, data)
    assert r.status_code == 302, r.content.decode()[:2000]
    assert booked and _status(gpu) == GpuStatus.RENTED  # before: free again, under the instance holding it


def test_the_gpu_page_reads_the_row_locked_and_writes_only_what_changed(ops):
    node = make_listed_node(name="two-gpus", gpu_count=2)
    gpu = Gpu.objects.get(node=node, index=1)
    url = f"/admin/marketplace/gpu/{gpu.pk}/change/"
    data = change_form(ops, url, "gpu_form")
    with CaptureQueriesContext(connection) as queries:
        assert ops.post(url, data).status_code == 302
    sql = [q["sql"] for q in queries.captured_queries]
    assert not [s for s in sql if s.startswith(f"UPDATE {GPUS}")], "nothing changed, nothing written"
    reads = [s for s in sql if s.startswith(f"SELECT {GPUS}.")]
    assert reads and "FOR UPDATE" in reads[0], "the row is read under its lock, before the form's checks"

    with CaptureQueriesContext(connection) as queries:
        assert ops.post(url, {**data, "status": ["unavailable"]}).status_code == 302
    updates = [q["sql"] for q in queries.captured_queries if q["sql"].startswith(f"UPDATE {GPUS}")]
    assert len(updates) == 1 and updates[0].split(" WHERE ")[0].count("=") == 2  # status and lost_at only
    assert _status(gpu) == GpuStatus.UNAVAILABLE


def test_the_node_page_writes_neither_the_node_row_nor_a_gpu_booked_meanwhile(ops, renter, monkeypatch):
    node = make_listed_node(name="inline-node", gpu_count=2)
    url = f"/admin/marketplace/node/{node.pk}/change/"
    data = change_form(ops, url, "node_form")
    first, second = (Gpu.objects.get(node=node, index=i) for i in (0, 1))
    assert data["gpus-0-status"] == data["gpus-1-status"] == ["free"]
    data["gpus-1-status"] = ["unavailable"]

    def a_check_writes_the_node():
        Node.objects.filter(pk=node.pk).update(last_error="written by a check meanwhile")

    booked = _booked_before_the_save(monkeypatch, NodeAdmin, renter, node, also=a_check_writes_the_node)
    with CaptureQueriesContext(connection) as queries:
        r = ops.post(url, data)
    assert r.status_code == 302, r.content.decode()[:2000]
    assert booked
    assert _status(first) == GpuStatus.RENTED and _status(second) == GpuStatus.UNAVAILABLE
    assert Node.objects.get(pk=node.pk).last_error == "written by a check meanwhile"  # before: written back
    ours = [q["sql"] for q in queries.captured_queries if q["sql"].startswith(f"UPDATE {NODES}")]
    assert [s for s in ours if "written by a check" not in s and "last_error" in s] == []
    reads = [q["sql"] for q in queries.captured_queries
             if q["sql"].startswith(f"SELECT {GPUS}.") and f'{GPUS}."node_id" = ' in q["sql"]]
    assert reads and "FOR UPDATE" in reads[0], "the page's GPU rows are read under their lock"


# ------------------------------------------------------------------ a page opened before a GPU was lost
#
# A GPU counted as changed when the posted status differed from the row as read at the save, not from what the page
# showed: a page opened before a health check found a card missing (unavailable, lost_at set) wrote it back free and
# no longer lost, whether the operator changed another GPU of the node or nothing at all, and the card that fell off
# the bus was offered and booked again. The page now sends the status it showed; a status that moved since is
# refused on the form, nothing saved, unless the page's value agrees with it.


def _lost(gpu) -> None:
    """What a health check does to a card its server no longer lists (provisioning.services.gpu_presence)."""
    node_gpus_presence(node=gpu.node, presence=Presence(missing=[gpu.pk], newly_missing=[(gpu.index, gpu.uuid)]),
                       last_seen=None)


def _stored(gpu) -> tuple:
    row = Gpu.objects.get(pk=gpu.pk)
    return row.status, row.lost_at is not None


def test_a_node_page_opened_before_a_gpu_was_lost_does_not_free_it_again(ops):
    node = make_listed_node(name="lost-card", gpu_count=2)
    first, second = (Gpu.objects.get(node=node, index=i) for i in (0, 1))
    url = f"/admin/marketplace/node/{node.pk}/change/"
    data = change_form(ops, url, "node_form")
    assert data["gpus-1-status"] == data["initial-gpus-1-status"] == ["free"]  # the page's value goes with it
    _lost(second)
    assert _stored(second) == (GpuStatus.UNAVAILABLE, True)
    data["gpus-0-status"] = ["unavailable"]  # the operator changes GPU 0 only
    r = ops.post(url, data)
    assert r.status_code == 200, "refused"  # before: 302, GPU 1 written back free and no longer lost
    assert "Changed by someone else since you opened this page: it is “unavailable”, lost" in r.content.decode()
    assert _stored(second) == (GpuStatus.UNAVAILABLE, True)
    assert _stored(first) == (GpuStatus.FREE, False)  # nothing of the page saved

    # Opened again: GPU 0's change is saved, the lost GPU left as it is (untouched, not written).
    data = change_form(ops, url, "node_form")
    data["gpus-0-status"] = ["unavailable"]
    with CaptureQueriesContext(connection) as queries:
        assert ops.post(url, data).status_code == 302
    assert _stored(first) == (GpuStatus.UNAVAILABLE, False) and _stored(second) == (GpuStatus.UNAVAILABLE, True)
    updates = [q["sql"] for q in queries.captured_queries if q["sql"].startswith(f"UPDATE {GPUS}")]
    assert len(updates) == 1 and f"{first.pk}" in updates[0].split(" WHERE ")[1]


def test_the_gpu_page_saved_unchanged_after_a_loss_does_not_free_the_gpu(ops):
    node = make_listed_node(name="lost-alone", gpu_count=1)
    gpu = Gpu.objects.get(node=node)
    url = f"/admin/marketplace/gpu/{gpu.pk}/change/"
    data = change_form(ops, url, "gpu_form")
    assert data["status"] == data["initial-status"] == ["free"]
    _lost(gpu)
    r = ops.post(url, data)  # Save, nothing changed
    assert r.status_code == 200 and "it is “unavailable”, lost" in r.content.decode()
    assert _stored(gpu) == (GpuStatus.UNAVAILABLE, True)  # before: free, no longer lost


def test_a_stale_gpu_page_that_agrees_with_the_loss_writes_nothing(ops):
    node = make_listed_node(name="lost-agreed", gpu_count=1)
    gpu = Gpu.objects.get(node=node)
    url = f"/admin/marketplace/gpu/{gpu.pk}/change/"
    data = change_form(ops, url, "gpu_form")
    _lost(gpu)
    data["status"] = ["unavailable"]  # the operator takes it out too
    with CaptureQueriesContext(connection) as queries:
        r = ops.post(url, data)
    assert r.status_code == 302, r.content.decode()[:2000]
    assert _stored(gpu) == (GpuStatus.UNAVAILABLE, True)  # still lost: found back, it is free again by itself
    assert not [q for q in queries.captured_queries if q["sql"].startswith(f"UPDATE {GPUS}")]


def test_a_gpu_found_back_since_the_page_opened_is_not_taken_out_by_its_save(ops):
    node = make_listed_node(name="card-back", gpu_count=1)
    gpu = Gpu.objects.get(node=node)
    _lost(gpu)
    url = f"/admin/marketplace/gpu/{gpu.pk}/change/"
    data = change_form(ops, url, "gpu_form")
    assert data["status"] == ["unavailable"]
    gpus_returned(gpu_ids=[gpu.pk])
    assert _stored(gpu) == (GpuStatus.FREE, False)
    r = ops.post(url, data)
    assert r.status_code == 200 and "it is “free” now" in r.content.decode()
    assert _stored(gpu) == (GpuStatus.FREE, False)


def test_the_node_page_locks_its_gpus_in_id_order(ops):
    node = make_listed_node(name="renumbered", gpu_count=3)
    # An inventory that numbered the cards anew: index order is no longer id order.
    gpus = list(Gpu.objects.filter(node=node).order_by("pk"))
    Gpu.objects.filter(pk=gpus[0].pk).update(index=7)
    Gpu.objects.filter(pk=gpus[2].pk).update(index=0)
    Gpu.objects.filter(pk=gpus[0].pk).update(index=2)
    url = f"/admin/marketplace/node/{node.pk}/change/"
    data = change_form(ops, url, "node_form")
    with CaptureQueriesContext(connection) as queries:
        assert ops.post(url, data).status_code == 302
    locks = [q["sql"] for q in queries.captured_queries
             if q["sql"].startswith(f"SELECT {GPUS}.") and q["sql"].endswith("FOR UPDATE")]
    assert locks, "the page's GPU rows are locked"
    first = locks[0]  # before: the inline's read, ordered by ("node_id", "index")
    columns, order = first.split(" FROM ")[0], first.split(" ORDER BY ")[1]
    assert columns.split(" ", 1)[1] == f'{GPUS}."id" AS "pk"', first  # the ids alone, locked in their order
    assert order == "1 ASC FOR UPDATE", first
