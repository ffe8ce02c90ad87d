"""The renter's pages no longer say a stopped instance costs nothing: its disk is billed as storage while stopped
(billing.services.storage), so the instance page, the usage page and the Stop question say so, with what the disk
costs (review round 53: a renter stopped an instance to pause billing while the disk drained the balance)."""
import pytest

from marketplace.models import Instance
from marketplace.services import instances as isvc
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import book, run

pytestmark = pytest.mark.django_db


def _stopped(renter, disk_gb=500) -> Instance:
    inst = run(book(renter, make_listed_node(gpu_model="rtx-a6000", gpu_count=1), disk_gb=disk_gb))
    isvc.instance_stop(instance=inst)
    isvc.instance_mark_stopped(instance_id=inst.pk)
    inst.refresh_from_db()
    assert inst.status == "stopped" and inst.disk_price_per_gb_month_micros == 100_000
    return inst


def test_a_stopped_instance_page_says_its_disk_is_billed_and_what_it_costs(web, funded_renter):
    inst = _stopped(funded_renter)
    for url in (f"/instances/{inst.pk}/", f"/instances/{inst.pk}/live/"):
        page = web.get(url).content.decode()
        assert "billing runs only while the instance is running" not in page, url
        assert ("While stopped, its 500 GB disk is billed: $0.10 per GB-month, about $50.00 per 30 days ($0.00 so "
                "far). Destroying the instance deletes the disk and ends this charge." in page), url
        assert "GPU time is not billed now: only while the instance is running" in page, url


def test_a_running_instance_page_has_no_disk_line(web, funded_renter):
    inst = run(book(funded_renter, make_listed_node(gpu_model="rtx-a6000", gpu_count=1), disk_gb=500))
    page = web.get(f"/instances/{inst.pk}/").content.decode()
    assert 'id="disk-billing"' not in page and 'data-billing="running"' in page


def test_the_usage_page_says_stopped_disks_are_billed(web, funded_renter):
    page = web.get("/account/usage/").content.decode()
    assert "stopped ones cost nothing" not in page
    assert "Stopped ones are not billed for GPU time, but their disks are, as storage" in page


def test_the_stop_question_says_the_disk_is_billed_while_stopped(web, funded_renter):
    inst = run(book(funded_renter, make_listed_node(gpu_model="rtx-a6000", gpu_count=1)))
    page = web.get(f"/instances/{inst.pk}/").content.decode()
    assert "the disk is kept, and billed at the server&#x27;s storage price while stopped" in page


def test_the_balance_page_counts_stopped_disks(web, funded_renter):
    page = web.get("/account/balance/").content.decode()
    assert "a stopped instance's disk, as volumes are, as storage" in page
