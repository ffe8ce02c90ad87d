"""A MIG slice choice the rent page no longer offers when the form comes back (the slices were taken since the page
was shown, the provider cleared the layout, or the field was made up) is refused on the form, nothing booked. Before,
Django dropped the unknown field and the page booked as many whole GPUs at the whole GPU's price (review round 53)."""
import pytest

from marketplace.models import Instance, Node
from marketplace.services.nodes import node_update
from tests.factories import make_listed_node
from tests.marketplace.mig_helpers import SEVEN, make_mig_node
from tests.marketplace.renting_helpers import book, ed25519_key
from tests.web.conftest import fund

pytestmark = pytest.mark.django_db

GONE = "MIG 1g.10gb slices are not one of the available choices now: none is free on this server"


def _body(**extra):
    return {"image": "cuda-12-4", "num_gpus": "1", "ssh_public_key": ed25519_key(), "request_token": "tok1", **extra}


def _mine(renter):
    return list(Instance.objects.filter(renter=renter).values_list("mig_profile", "num_gpus"))


def test_slices_taken_since_the_page_are_refused_not_booked_as_whole_gpus(web, funded_renter, stranger):
    node = make_mig_node({0: SEVEN}, {"1g.10gb": "0.25"}, gpu_count=2)  # GPU 0: 7 slices, GPU 1 whole
    shown = web.get(f"/offers/{node.pk}/rent/").context["shown_prices"]
    fund(stranger)
    book(stranger, node, num_gpus=7, mig_profile="1g.10gb")  # someone takes the slices meanwhile
    r = web.post(f"/offers/{node.pk}/rent/", _body(mig_profile="1g.10gb", shown_prices=shown))
    page = r.content.decode()
    assert r.status_code == 400, page[:2000]
    assert _mine(funded_renter) == [], "asked for one $0.25 slice, booked a whole GPU at $1.50/h"
    assert GONE in page and "Nothing was booked; choose again." in page
    # Not sent again with the page: the page now offers whole GPUs only, at their price, and books them when asked.
    assert 'name="mig_profile"' not in page
    r = web.post(f"/offers/{node.pk}/rent/", _body(shown_prices=r.context["shown_prices"]))
    assert r.status_code == 302 and _mine(funded_renter) == [("", 1)]


def test_slices_of_another_profile_still_free_refuse_the_one_gone(web, funded_renter, stranger):
    node = make_mig_node({0: SEVEN, 1: ["3g.40gb", "3g.40gb"]}, {"1g.10gb": "0.25", "3g.40gb": "0.70"})
    fund(stranger)
    book(stranger, node, num_gpus=7, mig_profile="1g.10gb")
    r = web.post(f"/offers/{node.pk}/rent/", _body(mig_profile="1g.10gb"))
    page = r.content.decode()
    assert r.status_code == 400 and 'id="id_mig_profile_errors"' in page and GONE in page, page[:2000]
    assert _mine(funded_renter) == []


def test_a_layout_cleared_since_the_page_refuses_the_slice_choice(web, funded_renter):
    node = make_mig_node({0: SEVEN}, {"1g.10gb": "0.25"}, gpu_count=2)
    shown = web.get(f"/offers/{node.pk}/rent/").context["shown_prices"]
    node_update(node=Node.objects.get(pk=node.pk), mig_layout=[])  # the provider turns MIG off meanwhile
    r = web.post(f"/offers/{node.pk}/rent/", _body(mig_profile="1g.10gb", num_gpus="2", shown_prices=shown))
    assert r.status_code == 400 and GONE in r.content.decode()
    assert _mine(funded_renter) == []


def test_a_made_up_profile_on_an_offer_without_mig_is_refused(web, funded_renter):
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=1)
    r = web.post(f"/offers/{node.pk}/rent/", _body(mig_profile="1g.10gb"))
    assert r.status_code == 400 and GONE in r.content.decode()
    assert _mine(funded_renter) == []


def test_the_back_button_form_with_a_gone_profile_is_refused_too(web, funded_renter, stranger):
    """The token already booked with other choices: the page sent back (_reused_form) says both, books nothing."""
    node = make_mig_node({0: SEVEN}, {"1g.10gb": "0.25"}, gpu_count=3)
    assert web.post(f"/offers/{node.pk}/rent/", _body()).status_code == 302  # one whole GPU, token tok1
    fund(stranger)
    book(stranger, node, num_gpus=7, mig_profile="1g.10gb")
    r = web.post(f"/offers/{node.pk}/rent/", _body(mig_profile="1g.10gb"))
    page = r.content.decode()
    assert r.status_code == 400 and "already used to book" in page and GONE in page
    assert _mine(funded_renter) == [("", 1)]
