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
