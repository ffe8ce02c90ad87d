"""POST /api/v1/instances/ with max_disk_price_per_gb_month: the disk price now above the renter's maximum is a 409
price_changed naming both, with nothing written; at or below it books (review round 53: the disk price, billed while
the instance is stopped and fixed at booking, had no such guard where the GPU's price had one)."""
from decimal import Decimal

import pytest
import yaml

from marketplace.models import Instance
from marketplace.services import instances as svc
from marketplace.services.nodes import node_update
from tests.factories import make_listed_node

from .renting_helpers import book, snapshot
from .test_round50_price_guard import body, post

pytestmark = pytest.mark.django_db


def test_a_disk_price_raised_above_the_maximum_is_a_409_naming_both(api):
    node = make_listed_node(gpu_count=2, price="0.500000")
    node_update(node=node, disk_price_per_gb_month=Decimal("10"))
    before = snapshot(node)
    r = post(api, body(node, max_price_per_gpu_hour="0.50", max_disk_price_per_gb_month="0.10"))
    assert r.status_code == 409, r.content
    assert r.json() == {
        "detail": "The price changed: this offer's disk now costs $10.00 per GB-month, more than the $0.10 per "
        "GB-month you agreed to. Nothing was booked; book again at the new price if it suits you.",
        "code": "price_changed",
        "disk_price_per_gb_month": "10.000000",
        "max_disk_price_per_gb_month": "0.100000",
    }
    assert snapshot(node) == before and not Instance.objects.exists()


@pytest.mark.parametrize("maximum", ["10", "10.000000", "25"])
def test_at_or_under_the_maximum_books_at_the_disk_price_now(api, maximum):
    node = make_listed_node(gpu_count=2)
    node_update(node=node, disk_price_per_gb_month=Decimal("10"))
    r = post(api, body(node, max_disk_price_per_gb_month=maximum))
    assert r.status_code == 201, r.content
    assert r.json()["disk_price_per_gb_month"] == "10.000000"


def test_a_disk_price_cut_books_at_the_lower_price(api):
    node = make_listed_node(gpu_count=2)
    node_update(node=node, disk_price_per_gb_month=Decimal("0.05"))
    r = post(api, body(node, max_disk_price_per_gb_month="0.10"))
    assert r.status_code == 201 and r.json()["disk_price_per_gb_month"] == "0.050000", r.content


@pytest.mark.parametrize(("value", "message"), [
    ("-0.01", "Ensure this value is greater than or equal to 0."),
    ("NaN", "A valid number is required."),
    (0.5, 'Must be a decimal number in a string, e.g. "0.79".'),
])
def test_a_bad_disk_maximum_is_a_400_naming_the_field(api, value, message):
    node = make_listed_node(gpu_count=2)
    r = post(api, body(node, max_disk_price_per_gb_month=value))
    assert r.status_code == 400 and r.json() == {"max_disk_price_per_gb_month": [message]}, r.content


def test_the_service_refuses_a_disk_raise_with_the_disk_figures(user):
    node = make_listed_node(gpu_count=2)
    with pytest.raises(svc.PriceChanged) as refused:
        book(user, node, max_disk_price_micros=99_999)
    assert (refused.value.price_micros, refused.value.max_price_micros, refused.value.disk) == (100_000, 99_999, True)
    assert not Instance.objects.exists()
    assert book(user, node, max_disk_price_micros=100_000).disk_price_per_gb_month_micros == 100_000


def test_the_schema_documents_the_disk_maximum(anon):
    schema = yaml.safe_load(anon.get("/api/schema/").content)
    field = schema["components"]["schemas"]["InstanceCreateRequest"]["properties"]["max_disk_price_per_gb_month"]
    assert field["type"] == "string" and "price_changed" in field["description"]
