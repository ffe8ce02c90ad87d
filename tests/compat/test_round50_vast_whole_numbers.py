"""A count, limit or id of the Vast API written as a number with a whole value (5.0: what a JSON encoder writes for a
number kept as a float) counts as that whole number; a fraction, true/false, NaN, an infinity or a huge value is
still a 400 naming the field (compat.vast.query.whole). `limit` 5.0 was a 400."""

import json

import pytest

from compat.vast import query
from core.errors import ValidationFailed
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book

V0 = "/compat/vast/api/v0"
INSTANCES = "/compat/vast/api/v1/instances/"


@pytest.fixture
def market(db):
    provider = UserFactory()
    return provider, make_listed_node(provider, gpu_model="rtx-a6000", gpu_count=3, price="0.800000")


def _msg(response) -> str:
    return response.json()["msg"]


@pytest.mark.parametrize("limit", [2.0, "2.0", "2", 2, "2.00"])
def test_search_offers_takes_a_whole_limit_written_as_a_float(anon, market, limit):
    r = anon.post(f"{V0}/bundles/", {"limit": limit}, format="json")
    assert r.status_code == 200, r.content
    assert len(r.json()["offers"]) == 2


def test_search_offers_takes_a_raw_json_float_limit(anon, market):
    r = anon.post(f"{V0}/bundles/", '{"limit": 1.0}', content_type="application/json")
    assert r.status_code == 200 and len(r.json()["offers"]) == 1, r.content


@pytest.mark.parametrize(
    "limit",
    [
        5.5,
        True,
        False,
        "5.5",
        "1e3",
        "-1",
        "0.0",
        0.0,
        1001.0,
        1e300,
        "2.",
        ".0",
        " 5",
        "5.0 ",
        "\u00b2",
        "5" + ".0" * 40,
        [5],
        {"n": 5},
    ],
)
def test_search_offers_refuses_a_limit_that_is_no_whole_number_in_range(anon, market, limit):
    r = anon.post(f"{V0}/bundles/", {"limit": limit}, format="json")
    assert r.status_code == 400 and "`limit` is a whole number from 1 to 1000" in _msg(r), (limit, r.content)


@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity", "1e400", "1" + "0" * 400 + ".0"])
def test_search_offers_refuses_nan_infinite_and_huge_limits_in_raw_json(anon, db, raw):
    r = anon.post(f"{V0}/bundles/", '{"limit": ' + raw + "}", content_type="application/json")
    assert r.status_code == 400, (raw, r.content)


def test_the_shared_parser_refuses_nan_and_infinities():
    for value in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(ValidationFailed, match="`limit` is a whole number"):
            query.whole(value, "limit", low=1, high=10)
    assert query.whole(7.0, "n", low=1, high=10) == 7 and type(query.whole(7.0, "n", low=1, high=10)) is int


def test_show_instances_takes_a_whole_limit_written_as_a_float(client_for, market):
    """The SDK's client json.dumps a query argument that is no string: limit=2.0 arrives as "2.0"."""
    _, node = market
    api = client_for(UserFactory())
    made = [book(api.user, node) for _ in range(3)]
    r = api.get(INSTANCES, {"limit": "2.0"})
    assert r.status_code == 200, r.content
    assert [i["id"] for i in r.json()["instances"]] == [made[0].pk, made[1].pk] and r.json()["next_token"]
    for bad in ["2.5", "true", "NaN", "26.0", "0.0", "9" * 30 + ".0"]:
        r = api.get(INSTANCES, {"limit": bad})
        assert r.status_code == 400 and "`limit` is a whole number from 1 to 25" in _msg(r), bad


def test_list_machine_takes_a_whole_machine_id_written_as_a_float(client_for, market):
    provider, node = market
    host = client_for(provider)
    url = f"{V0}/machines/create_asks/"
    r = host.put(url, json.dumps({"machine": float(node.pk), "price_gpu": 0.5}), content_type="application/json")
    assert r.status_code == 200, r.content
    for bad in [node.pk + 0.5, True, "x", None]:
        r = host.put(url, {"machine": bad, "price_gpu": 0.5}, format="json")
        assert r.status_code == 400 and "`machine` is a machine id" in _msg(r), (bad, r.content)
