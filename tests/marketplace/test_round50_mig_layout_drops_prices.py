"""Turning MIG off, or dropping a profile from the layout, needs no price deleted beside it (found by review): the API
says "declare no layout (an empty list)", and PATCH {"mig_layout": []} was a 400 naming the stored price of a profile
the empty layout no longer used; the server page's Save of a cleared layout the same. Prices not sent are the stored
ones the new layout still uses; a price sent for a profile it does not use is still refused, and a new profile still
needs its price."""
import pytest

from marketplace.models import Node

from .mig_helpers import make_mig_node

pytestmark = pytest.mark.django_db

NODES = "/api/v1/nodes/"


def test_an_empty_layout_alone_turns_mig_off(api):
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, {"3g.40gb": "0.70"}, provider=api.user, runtime="docker")
    r = api.patch(f"{NODES}{node.pk}/", {"mig_layout": []}, format="json")
    assert r.status_code == 200, r.json()
    assert r.json()["mig_layout"] == [] and r.json()["mig_prices"] == {}
    node.refresh_from_db()
    assert node.mig_layout == [] and node.mig_prices_micros == {}


def test_a_profile_dropped_from_the_layout_drops_its_price_and_keeps_the_others(api):
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"], 1: ["7g.80gb"]}, {"3g.40gb": "0.70", "7g.80gb": "1.60"},
                         provider=api.user, runtime="docker")
    r = api.patch(f"{NODES}{node.pk}/", {"mig_layout": [{"gpu": 1, "profiles": ["7g.80gb"]}]}, format="json")
    assert r.status_code == 200, r.json()
    assert r.json()["mig_prices"] == {"7g.80gb": "1.600000"}
    assert Node.objects.get(pk=node.pk).mig_prices_micros == {"7g.80gb": 1_600_000}


def test_a_price_sent_for_an_unused_profile_and_a_new_profile_without_one_are_still_refused(api):
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, {"3g.40gb": "0.70"}, provider=api.user, runtime="docker")
    r = api.patch(f"{NODES}{node.pk}/", {"mig_layout": [], "mig_prices": {"3g.40gb": "0.70"}}, format="json")
    assert r.status_code == 400 and "does not use" in r.json()["mig_prices"][0]
    r = api.patch(f"{NODES}{node.pk}/", {"mig_layout": [{"gpu": 0, "profiles": ["7g.80gb"]}]}, format="json")
    assert r.status_code == 400 and "7g.80gb" in r.json()["mig_prices"][0]
    assert Node.objects.get(pk=node.pk).mig_prices_micros == {"3g.40gb": 700_000}  # nothing written

