"""The rent page holds the disk price it showed as it holds the GPU's: a provider's raise of the disk price between
the page and the click is a 409 page naming the old and new price, nothing booked; a cut books at the lower price.
Before, only GPU and slice prices were carried (`shown_prices`), and the raise booked silently (review round 53)."""
import html
import re
from decimal import Decimal

import pytest

from marketplace.models import Instance, Node
from marketplace.services.nodes import node_update
from provisioning.models import Job
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import ed25519_key

pytestmark = pytest.mark.django_db


def _hidden(page: str, name: str) -> str:
    found = re.search(rf'<input type="hidden" name="{name}" value="([^"]*)"', page)
    assert found, f"the rent page carries {name}"
    return html.unescape(found.group(1))


def _form(page: str, **fields) -> dict:
    """The page's form as a browser sends it back."""
    return {"image": "cuda-12-4", "num_gpus": "1", "ssh_public_key": ed25519_key(), "request_token": "t1",
            "shown_prices": _hidden(page, "shown_prices"), "shown_disk_price": _hidden(page, "shown_disk_price"),
            **fields}


def _raise_disk(node, usd: str) -> None:
    node_update(node=Node.objects.get(pk=node.pk), disk_price_per_gb_month=Decimal(usd))


def test_a_disk_price_raised_after_the_page_is_refused_naming_both(web, funded_renter):
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=1)
    page = web.get(f"/offers/{node.pk}/rent/").content.decode()
    assert "volumes and stopped disks $0.10 per GB-month" in page and _hidden(page, "shown_disk_price") == "0.100000"
    _raise_disk(node, "10")  # the provider, meanwhile
    r = web.post(f"/offers/{node.pk}/rent/", _form(page))
    again = r.content.decode()
    assert r.status_code == 409, again[:2000]
    assert ("The price changed since the page was shown: its disk now costs $10.00 per GB-month (billed while the "
            "instance is stopped), not the $0.10 shown. Nothing was booked." in again)
    assert not Instance.objects.exists() and not Job.objects.exists()
    # The page sent back carries the new disk price: sent again (same token, nothing was booked with it), it books.
    assert _hidden(again, "shown_disk_price") == "10.000000"
    r = web.post(f"/offers/{node.pk}/rent/", _form(again))
    assert r.status_code == 302, r.content.decode()[:2000]
    assert Instance.objects.get(renter=funded_renter).disk_price_per_gb_month_micros == 10_000_000


def test_a_disk_price_cut_books_at_the_lower_price(web, funded_renter):
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=1)
    page = web.get(f"/offers/{node.pk}/rent/").content.decode()
    _raise_disk(node, "0.05")
    r = web.post(f"/offers/{node.pk}/rent/", _form(page))
    assert r.status_code == 302, r.content.decode()[:2000]
    assert Instance.objects.get(renter=funded_renter).disk_price_per_gb_month_micros == 50_000


def test_both_prices_raised_are_both_named(web, funded_renter):
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=1, price="0.500000")
    page = web.get(f"/offers/{node.pk}/rent/").content.decode()
    node_update(node=Node.objects.get(pk=node.pk), price_per_gpu_hour=Decimal("2"),
                disk_price_per_gb_month=Decimal("1"))
    r = web.post(f"/offers/{node.pk}/rent/", _form(page))
    again = r.content.decode()
    assert r.status_code == 409 and not Instance.objects.exists()
    assert ("this offer now costs $2.00 per GPU-hour, not the $0.50 shown, and its disk now costs $1.00 per GB-month "
            "(billed while the instance is stopped), not the $0.10 shown. Nothing was booked." in again)


@pytest.mark.parametrize("value", ["nope", "NaN", "-1", "0.1234567", "Infinity", "1e999999"])
def test_an_unreadable_disk_price_is_a_form_error(web, funded_renter, value):
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=1)
    page = web.get(f"/offers/{node.pk}/rent/").content.decode()
    r = web.post(f"/offers/{node.pk}/rent/", _form(page, shown_disk_price=value))
    assert r.status_code == 400 and "Disk price shown: The disk price this page showed could not be read" in \
        r.content.decode()
    assert not Instance.objects.exists()


def test_a_form_without_the_disk_price_books_at_the_price_now(web, funded_renter):
    """A page from before the field: no check, as for shown_prices."""
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=1)
    page = web.get(f"/offers/{node.pk}/rent/").content.decode()
    _raise_disk(node, "1")
    r = web.post(f"/offers/{node.pk}/rent/", _form(page, shown_disk_price=""))
    assert r.status_code == 302
