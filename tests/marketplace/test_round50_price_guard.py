"""POST /api/v1/instances/ with max_price_per_gpu_hour, and the booking service's price guard: a price now above
the renter's maximum is a 409 price_changed naming both prices, with nothing written; at or below it books."""

from decimal import Decimal

import pytest
import yaml
from django.test import override_settings

from billing.models import Entry, LedgerTransaction
from marketplace.models import Instance
from marketplace.services import instances as svc
from marketplace.services.nodes import node_update
from tests.factories import make_listed_node
from tests.web.conftest import fund

from .mig_helpers import make_mig_node
from .renting_helpers import book, ed25519_key, sent_jobs_fixture, snapshot  # noqa: F401

pytestmark = pytest.mark.django_db

URL = "/api/v1/instances/"


def body(node, **overrides):
    data = {"offer": node.pk, "num_gpus": 1, "image": "pytorch-2-5", "ssh_public_key": ed25519_key("me@laptop")}
    data.update(overrides)
    return data


def post(client, data, key=None):
    headers = {"HTTP_IDEMPOTENCY_KEY": key} if key is not None else {}
    return client.post(URL, data, format="json", **headers)


def test_a_price_raised_above_the_maximum_is_a_409_naming_both_prices(api):
    node = make_listed_node(gpu_count=2, price="0.500000")
    node_update(node=node, price_per_gpu_hour=Decimal("100"))
    before = snapshot(node)
    r = post(api, body(node, max_price_per_gpu_hour="0.50"))
    assert r.status_code == 409, r.content
    assert r.json() == {
        "detail": "The price changed: this offer now costs $100.00 per GPU-hour, more than the $0.50 per GPU-hour "
        "you agreed to. Nothing was booked; book again at the new price if it suits you.",
        "code": "price_changed",
        "price_per_gpu_hour": "100.000000",
        "max_price_per_gpu_hour": "0.500000",
    }
    assert snapshot(node) == before


@pytest.mark.parametrize("maximum", ["100", "100.000000", "250"])
def test_at_or_under_the_maximum_books_at_the_price_now(api, maximum):
    node = make_listed_node(gpu_count=2, price="100")
    r = post(api, body(node, max_price_per_gpu_hour=maximum))
    assert r.status_code == 201, r.content
    assert r.json()["price_per_gpu_hour"] == "100.000000"


def test_a_cut_books_at_the_lower_price(api):
    node = make_listed_node(gpu_count=2, price="0.500000")
    node_update(node=node, price_per_gpu_hour=Decimal("0.25"))
    r = post(api, body(node, max_price_per_gpu_hour="0.5"))
    assert r.status_code == 201 and r.json()["price_per_gpu_hour"] == "0.250000"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("-0.01", "Ensure this value is greater than or equal to 0."),
        ("NaN", "A valid number is required."),
        ("Infinity", "A valid number is required."),
        ("0.1234567", "Ensure that there are no more than 6 decimal places."),
        ("1234567.5", "Ensure that there are no more than 6 digits before the decimal point."),
        (0.5, 'Must be a decimal number in a string, e.g. "0.79".'),
        (None, "This field may not be null."),
    ],
)
def test_a_bad_maximum_is_a_400_naming_the_field(api, value, message):
    node = make_listed_node(gpu_count=2, price="0.500000")
    before = snapshot(node)
    r = post(api, body(node, max_price_per_gpu_hour=value))
    assert r.status_code == 400 and r.json() == {"max_price_per_gpu_hour": [message]}, r.content
    assert snapshot(node) == before


def test_a_mig_booking_is_held_to_its_slice_price(api):
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, {"3g.40gb": "0.70"})
    node_update(node=node, mig_prices={"3g.40gb": Decimal("5")})
    r = post(api, body(node, mig_profile="3g.40gb", max_price_per_gpu_hour="0.70"))
    assert r.status_code == 409 and r.json()["code"] == "price_changed", r.content
    assert (
        "now costs $5.00 per MIG 3g.40gb slice-hour, more than the $0.70 per MIG 3g.40gb slice-hour"
        in r.json()["detail"]
    )
    assert not Instance.objects.exists()
    # The whole GPU's price (0.5) is not the slice's: a maximum of 5 books the slice.
    r = post(api, body(node, mig_profile="3g.40gb", max_price_per_gpu_hour="5"))
    assert r.status_code == 201 and r.json()["price_per_gpu_hour"] == "5.000000", r.content


@override_settings(BILLING_REQUIRE_FUNDS=True)
def test_a_refused_price_writes_nothing(user):
    """With the funds check on (its wallet lock taken with the node's row): no instance, GPU, job or ledger row."""
    fund(user, 500)
    node = make_listed_node(gpu_count=2, price="100")
    transactions, entries, before = LedgerTransaction.objects.count(), Entry.objects.count(), snapshot()
    with pytest.raises(svc.PriceChanged) as refused:
        book(user, node, max_price_micros=99_999_999, idempotency_key="k1", request_fingerprint="f")
    assert (refused.value.price_micros, refused.value.max_price_micros) == (100_000_000, 99_999_999)
    assert refused.value.status_code == 409 and refused.value.code == "price_changed"
    assert snapshot() == before
    assert (LedgerTransaction.objects.count(), Entry.objects.count()) == (transactions, entries)
    # The key refused booked nothing: the same key books once the renter agrees to the price.
    instance = book(user, node, max_price_micros=100_000_000, idempotency_key="k1", request_fingerprint="f")
    assert instance.price_per_gpu_hour_micros == 100_000_000


def test_a_replay_with_its_idempotency_key_returns_the_instance_booked(api):
    node = make_listed_node(gpu_count=2, price="0.500000")
    sent = body(node, max_price_per_gpu_hour="0.5")
    first = post(api, sent, key="k1")
    assert first.status_code == 201, first.content
    node_update(node=node, price_per_gpu_hour=Decimal("100"))  # raised after the booking: the retry is the booking
    again = post(api, sent, key="k1")
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"], again.content
    assert Instance.objects.count() == 1


def test_the_schema_documents_the_maximum(anon):
    schema = yaml.safe_load(anon.get("/api/schema/").content)
    field = schema["components"]["schemas"]["InstanceCreateRequest"]["properties"]["max_price_per_gpu_hour"]
    assert field["type"] == "string" and "price_changed" in field["description"]
