"""Numbers written with thousands of digits are a 400 naming the field (found by review: `limit` of 5000 nines was a
500: Python refuses to convert a string of more than 4300 digits to an int, a ValueError)."""
import pytest

from tests.factories import make_listed_node

V0 = "/compat/vast/api/v0"
pytestmark = pytest.mark.django_db


def _msg(response) -> str:
    return response.json()["msg"]


@pytest.mark.parametrize("limit", ["9" * 5000, "0" * 4400 + "5", "9" * 4301, "1" * 20])
def test_a_limit_with_too_many_digits_is_a_400(anon, limit):
    r = anon.post(f"{V0}/bundles/", {"limit": limit}, format="json")
    assert r.status_code == 400 and "`limit` is a whole number" in _msg(r), (r.status_code, r.content[:300])


def test_a_limit_as_text_still_counts(anon):
    make_listed_node(gpu_model="rtx-a4000", gpu_count=2)
    r = anon.post(f"{V0}/bundles/", {"limit": "1"}, format="json")
    assert r.status_code == 200 and len(r.json()["offers"]) == 1


def test_a_json_number_with_too_many_digits_is_a_400(anon):
    r = anon.post(f"{V0}/bundles/", '{"limit": ' + "9" * 5000 + "}", content_type="application/json")
    assert r.status_code == 400 and _msg(r)


@pytest.mark.parametrize(("name", "words"), [("limit", "`limit` is a whole number"),
                                            # a keyset token, no number (tests/compat/test_api.py)
                                            ("after_token", "`after_token` is the `next_token`")])
def test_show_instances_paging_with_too_many_digits_is_a_400(client_for, name, words):
    """A URL holds fewer digits than Python's limit (a longer one is a 414, core/request_guard.py): a guard."""
    api = client_for(make_listed_node(gpu_model="rtx-a4000", gpu_count=1).provider)
    r = api.get(f"/compat/vast/api/v1/instances/?{name}=" + "9" * 4000)
    assert r.status_code == 400 and words in _msg(r)


def test_whole_number_never_converts_more_digits_than_its_bound_has():
    from core.validators import whole_number

    for long in ("9" * 5000, "0" * 5000 + "7", "007"):
        assert whole_number(long, low=1, high=25) is None, long
    assert whole_number("07", low=1, high=25) == 7
    assert whole_number("26", low=1, high=25) is None and whole_number("0", low=1, high=25) is None
    assert whole_number("25", low=1, high=25) == 25 and whole_number("0", low=0, high=10) == 0
    for odd in ("\u00b2", "\u0663", "-1", "+1", " 1", "1.0", "", None, 5, True, "1_000"):
        assert whole_number(odd, low=0, high=10**9) is None, odd
