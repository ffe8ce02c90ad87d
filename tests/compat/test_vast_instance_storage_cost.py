"""`show instance` and `show instances` answer `storage_cost`, as `search offers` does since 20e269d: USD per GB per
30-day month for the instance's disk while it is stopped, exact from integer micros. An instance's is the disk price
it was booked at (what /api/v1/instances/' disk_price_per_gb_month says), not its node's price today."""
import json

import pytest

from marketplace.models import Node
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book

V0 = "/compat/vast/api/v0"
LIST = "/compat/vast/api/v1/instances/"


@pytest.fixture
def two_instances(api, db):
    provider = UserFactory()
    cheap = make_listed_node(provider, gpu_model="rtx-a4000", gpu_count=1)
    dear = make_listed_node(provider, gpu_model="rtx-a4000", gpu_count=1)
    # 0.1 and 0.3 have no exact binary fraction: from micros they are the floats 0.1 and 0.3 (not 0.30000000000000004).
    Node.objects.filter(pk=cheap.pk).update(disk_price_per_gb_month_micros=100_000)
    Node.objects.filter(pk=dear.pk).update(disk_price_per_gb_month_micros=300_000)
    return book(api.user, cheap), book(api.user, dear)


def test_show_instance_answers_the_disk_price_it_was_booked_at(api, two_instances):
    cheap, dear = two_instances
    for instance, price, text in ((cheap, 0.1, "0.100000"), (dear, 0.3, "0.300000")):
        assert api.get(f"/api/v1/instances/{instance.pk}/").json()["disk_price_per_gb_month"] == text
        row = api.get(f"{V0}/instances/{instance.pk}/").json()["instances"]
        assert row["storage_cost"] == price and type(row["storage_cost"]) is float
    # The node's price changes later: the instance keeps its own (booked instances keep their prices).
    Node.objects.filter(pk=dear.node_id).update(disk_price_per_gb_month_micros=1_234_567)
    assert api.get(f"{V0}/instances/{dear.pk}/").json()["instances"]["storage_cost"] == 0.3
    page = api.get(LIST).json()["instances"]
    assert [(row["id"], row["storage_cost"]) for row in page] == [(cheap.pk, 0.1), (dear.pk, 0.3)]


def test_show_instances_filters_and_orders_on_storage_cost(api, two_instances):
    cheap, dear = two_instances

    def ids(**params):
        r = api.get(LIST, {key: json.dumps(value) for key, value in params.items()})
        assert r.status_code == 200, r.json()
        return [row["id"] for row in r.json()["instances"]]

    assert ids(select_filters={"storage_cost": {"lte": 0.1}}) == [cheap.pk]
    assert ids(select_filters={"storage_cost": {"gt": 0.1}}) == [dear.pk]
    assert ids(select_filters={"storage_cost": {"eq": 0.3}}) == [dear.pk]
    assert ids(order_by=[{"col": "storage_cost", "dir": "desc"}]) == [dear.pk, cheap.pk]
