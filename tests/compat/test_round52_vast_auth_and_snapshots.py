"""Round 52 (review r52, suspicions 2 and 3): a key in the query string (`?api_key=`, older Vast clients) is a 401
that says where the key goes and that it may have leaked, never an authentication; `show instances` reuses one
paging snapshot per listing instead of writing a new cache key on every first page."""

import base64
import json

import pytest
from rest_framework.test import APIClient

from tests.factories import UserFactory, api_key_for, make_listed_node
from tests.marketplace.renting_helpers import book

INSTANCES = "/compat/vast/api/v1/instances/"
BUNDLES = "/compat/vast/api/v0/bundles/"


@pytest.mark.parametrize("valid", [True, False])
def test_a_key_in_the_query_string_is_a_401_naming_the_header_and_the_leak(db, valid):
    user = UserFactory()
    key = api_key_for(user) if valid else "gpm_not-a-key"
    r = APIClient().get(INSTANCES, {"api_key": key})
    assert r.status_code == 401, r.content
    body = r.json()
    assert body["success"] is False and body["error"] == "api_key_in_url"
    assert "Authorization: Bearer <key>" in body["msg"] and "logs" in body["msg"] and "rotate" in body["msg"]
    assert key not in body["msg"]
    # Public views too: the key is not taken as no key (the search would silently run anonymous).
    assert APIClient().post(f"{BUNDLES}?api_key={key}", {}, format="json").status_code == 401


def test_the_header_still_authenticates_and_no_key_at_all_is_the_usual_401(db):
    user = UserFactory()
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key_for(user)}")
    assert client.get(INSTANCES, {"api_key": "ignored"}).status_code == 200
    r = APIClient().get(INSTANCES)
    assert r.status_code == 401 and r.json()["error"] != "api_key_in_url"


def _snapshot(token: str) -> str:
    return json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))["s"]


def _page(api, token=None):
    r = api.get(INSTANCES, {"limit": 2, **({"after_token": token} if token else {})})
    assert r.status_code == 200, r.content
    return [i["id"] for i in r.json()["instances"]], r.json()["next_token"]


def _walk(api, token) -> list[int]:
    shown = []
    while token:
        ids, token = _page(api, token)
        shown += ids
    return shown


def test_polling_the_first_page_reuses_one_snapshot_until_the_listing_changes(client_for, db):
    node = make_listed_node(UserFactory(), gpu_model="rtx-a6000", gpu_count=8, price="0.800000")
    api = client_for(UserFactory())
    made = [book(api.user, node).pk for _ in range(5)]
    firsts = [_page(api) for _ in range(4)]
    assert len({_snapshot(token) for _, token in firsts}) == 1  # one cache key, not one per poll
    # A walker that began before a change still pages over exactly its listing, each instance once...
    old_first, old_token = firsts[0]
    second, mid = _page(api, old_token)
    newer = book(api.user, node).pk
    new_first, new_token = _page(api)
    assert _snapshot(new_token) != _snapshot(old_token)  # ...and a changed listing is a new one, with it in it
    assert old_first + second + _walk(api, mid) == made
    assert new_first + _walk(api, new_token) == [*made, newer]
