"""`show instances` pages go on in the order the listing's first page made: an instance whose order-by column
(its label, its status) changes between two page fetches is shown once, neither skipped nor shown twice. The
token's keyset over the order-by values alone skipped one that moved before the last row shown and repeated one
that moved after it."""

import base64
import json

import pytest
from django.core.cache import cache

from marketplace.models import Instance
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book

V0 = "/compat/vast/api/v0"
INSTANCES = "/compat/vast/api/v1/instances/"
BY_LABEL = json.dumps([{"col": "label", "dir": "asc"}])


@pytest.fixture
def renter(client_for, db):
    node = make_listed_node(UserFactory(), gpu_model="rtx-a6000", gpu_count=4, price="0.800000")
    api = client_for(UserFactory())
    made = [book(api.user, node, label=label) for label in ("b", "c", "d")]
    return api, made


def _page(api, token=None, **params):
    r = api.get(INSTANCES, {"limit": 1, "order_by": BY_LABEL, **params, **({"after_token": token} if token else {})})
    assert r.status_code == 200, r.content
    return [i["id"] for i in r.json()["instances"]], r.json()["next_token"]


def _relabel(api, instance: Instance, label: str) -> None:
    r = api.put(f"{V0}/instances/{instance.pk}/", {"label": label}, format="json")
    assert r.status_code == 200, r.content


def _rest(api, token) -> list[int]:
    shown = []
    while token:
        ids, token = _page(api, token)
        shown += ids
    return shown


def test_a_row_moved_before_the_last_one_shown_is_not_skipped(renter):
    api, (b, c, d) = renter
    first, token = _page(api)
    assert first == [b.pk]
    _relabel(api, d, "a")  # now sorts before b, the last row shown
    shown = first + _rest(api, token)
    assert sorted(shown) == sorted([b.pk, c.pk, d.pk]) and len(shown) == 3, shown
    assert shown == [b.pk, c.pk, d.pk]  # in the listing's order


def test_a_row_moved_after_the_last_one_shown_is_not_shown_twice(renter):
    api, (b, c, d) = renter
    first, token = _page(api)
    assert first == [b.pk]
    _relabel(api, b, "z")  # now sorts after every other
    shown = first + _rest(api, token)
    assert shown == [b.pk, c.pk, d.pk], shown


def test_a_row_moved_by_its_status_is_shown_once(renter):
    api, (b, c, d) = renter
    by_status = json.dumps([{"col": "intended_status", "dir": "asc"}])  # running before stopped
    first, token = _page(api, order_by=by_status)
    assert first == [b.pk]
    Instance.objects.filter(pk=b.pk).update(status="stopped")  # now sorts after the running ones
    shown = list(first)
    while token:
        ids, token = _page(api, token, order_by=by_status)
        shown += ids
    assert shown == [b.pk, c.pk, d.pk], shown


def test_destroyed_and_no_longer_matching_rows_are_left_out_and_the_rest_still_shown(renter):
    api, (b, c, d) = renter
    only_created = json.dumps({"actual_status": {"in": ["created"]}})
    first, token = _page(api, select_filters=only_created)
    assert first == [b.pk]
    Instance.objects.filter(pk=c.pk).update(status="stopped")  # no longer matches the filter
    shown = list(first)
    while token:
        ids, token = _page(api, token, select_filters=only_created)
        shown += ids
    assert shown == [b.pk, d.pk], shown


def test_a_token_whose_listing_is_no_longer_kept_pages_by_its_values(renter):
    api, (b, c, d) = renter
    first, token = _page(api)
    snapshot = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))["s"]
    assert cache.delete(f"compat.vast.instance-pages:{api.user.pk}:{snapshot}")  # expired, or evicted
    assert first + _rest(api, token) == [b.pk, c.pk, d.pk]
