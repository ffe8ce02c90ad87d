"""A node's IP address is stored in one spelling (marketplace.validators.canonical_address), so that the rule of one
live node per address and port (node_unique_own_live_endpoint, a 409) sees another spelling of the same IP as the
same address. Before, "::1" and "0:0:0:0:0:0:0:1" were two live nodes of one provider on one server (found by
review r52)."""
import pytest

from marketplace.models import Node
from tests.web.conftest import logged_in

from .test_api_nodes import URL, valid_payload

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("first,second", [("::1", "0:0:0:0:0:0:0:1"), ("::1", "::0.0.0.1"),
                                          ("127.0.0.1", "::ffff:127.0.0.1"), ("0::1", "::1")])
def test_the_same_ip_spelled_twice_is_409(api, first, second):
    r1 = api.post(URL, valid_payload(address=first), format="json")
    assert r1.status_code == 201, r1.content
    r2 = api.post(URL, valid_payload(address=second, name="dup"), format="json")
    assert r2.status_code == 409, (r2.status_code, r2.content[:300])
    assert Node.objects.count() == 1


@pytest.mark.parametrize("given,stored", [("0:0:0:0:0:0:0:1", "::1"), ("::ffff:127.0.0.1", "127.0.0.1"),
                                          ("LocalHost", "localhost")])
def test_an_address_is_stored_and_shown_in_its_one_spelling(api, given, stored):
    r = api.post(URL, valid_payload(address=given), format="json")
    assert r.status_code == 201, r.content
    assert r.json()["address"] == stored
    assert Node.objects.get().address == stored


def test_the_register_page_stores_the_same_spelling_and_refuses_the_duplicate(user):
    web = logged_in(user)
    form = {"name": "rack1", "address": "0:0:0:0:0:0:0:1", "ssh_port": "2222", "ssh_user": "gpu",
            "host_key_fingerprint": "", "country": "DE", "gpu_model": "rtx-a6000", "gpu_count": "1",
            "price_per_gpu_hour": "0.79", "runtime": "docker"}
    r = web.post("/nodes/new/", form)
    assert r.status_code == 302, r.content.decode()[:2000]
    assert Node.objects.get().address == "::1"
    r = web.post("/nodes/new/", {**form, "name": "rack1-again", "address": "::0.0.0.1"})
    assert r.status_code in (400, 409), r.status_code
    assert "already registered at ::1:2222" in r.content.decode()
    assert Node.objects.count() == 1
