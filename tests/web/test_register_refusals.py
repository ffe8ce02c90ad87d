"""The register-a-server page shows a refusal about the account (an unverified e-mail address) above the form, not
under the Address field; a second live server at the same address and port still shows under Address."""
import pytest

from marketplace.models import Node
from tests.factories import UserFactory, make_node
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db

FORM = {"name": "box", "address": "10.0.0.1", "ssh_port": 2222, "ssh_user": "gpu", "country": "DE",
        "gpu_model": "rtx-a6000", "gpu_count": 2, "price_per_gpu_hour": "0.50", "runtime": "sim"}


def test_an_unverified_address_is_said_above_the_form(settings):
    settings.SIM_NODES_ALLOWED = True
    unverified = UserFactory(email="not-yet@example.com", email_verified_at=None)
    r = logged_in(unverified).post("/nodes/new/", FORM)
    page = r.content.decode()
    assert r.status_code == 400 and "Verify your e-mail address" in page
    assert 'id="id_address_errors"' not in page and 'class="errorlist nonfield"' in page
    assert not Node.objects.filter(provider=unverified).exists()


def test_a_second_server_at_the_same_address_is_said_under_address(settings, renter):
    settings.SIM_NODES_ALLOWED = True
    make_node(renter, address="10.0.0.1", ssh_port=2222)
    r = logged_in(renter).post("/nodes/new/", FORM)
    page = r.content.decode()
    assert r.status_code == 400 and 'id="id_address_errors"' in page and "10.0.0.1:2222" in page
