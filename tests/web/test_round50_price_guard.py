"""The rent page books at most at the price it showed: a provider's raise between the page and the click is a 409
page showing the new price and asking again (nothing booked); sending that page again books at the new price."""

import html
import re
from decimal import Decimal

import pytest

from marketplace.models import Instance
from marketplace.services.nodes import node_update
from provisioning.models import Job
from tests.factories import make_listed_node
from tests.marketplace.mig_helpers import make_mig_node
from tests.marketplace.renting_helpers import ed25519_key

pytestmark = pytest.mark.django_db


def _shown(page: str) -> str:
    """The hidden `shown_prices` as a browser sends it back."""
    found = re.search(r'<input type="hidden" name="shown_prices" value="([^"]*)"', page)
    assert found, "the rent page carries the prices it shows"
    return html.unescape(found.group(1))


def _form(page: str, **fields) -> dict:
    return {
        "image": "cuda-12-4",
        "num_gpus": "1",
        "ssh_public_key": ed25519_key(),
        "request_token": "t1",
        "shown_prices": _shown(page),
        **fields,
    }


def test_rent_page_books_at_a_price_raised_after_the_page_showed_it(web, funded_renter):
    """The reviewer's case (prov.md 1), the form sent with the price its page showed."""
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=1, price="0.500000")
    page = web.get(f"/offers/{node.pk}/rent/")
    assert page.status_code == 200 and "0.50" in page.content.decode()
    node_update(node=node, price_per_gpu_hour=Decimal("100"))  # the provider, meanwhile (API PATCH or page)
    r = web.post(
        f"/offers/{node.pk}/rent/",
        {
            "image": "cuda-12-4",
            "num_gpus": "1",
            "ssh_public_key": ed25519_key(),
            "request_token": "t1",
            "shown_prices": '{"":"0.500000"}',
        },
    )
    booked = Instance.objects.filter(renter=funded_renter).first()
    # The renter agreed to $0.50/GPU-h; they must not be booked at $100/GPU-h without being asked again.
    assert booked is None or booked.price_per_gpu_hour_micros == 500_000, (
        r.status_code,
        booked and booked.price_per_gpu_hour_micros,
    )


def test_the_page_comes_back_at_the_new_price_and_a_second_click_books_at_it(web, funded_renter):
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=1, price="0.500000")
    first = web.get(f"/offers/{node.pk}/rent/").content.decode()
    assert _shown(first) == '{"":"0.500000"}'
    node_update(node=node, price_per_gpu_hour=Decimal("100"))
    r = web.post(f"/offers/{node.pk}/rent/", _form(first))
    again = r.content.decode()
    assert r.status_code == 409, again[:2000]
    assert (
        "The price changed since the page was shown: this offer now costs $100.00 per GPU-hour, not the $0.50 "
        "shown. Nothing was booked." in again
    )
    assert "$100.00 per GPU-hour" in again and not Instance.objects.exists() and not Job.objects.exists()
    assert _shown(again) == '{"":"100.000000"}'
    # The same token (nothing was booked with it), the page's new price: booked at it.
    r = web.post(f"/offers/{node.pk}/rent/", _form(again))
    assert r.status_code == 302, r.content.decode()[:2000]
    assert Instance.objects.get(renter=funded_renter).price_per_gpu_hour_micros == 100_000_000


def test_a_price_cut_books_at_the_lower_price(web, funded_renter):
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=1, price="0.500000")
    page = web.get(f"/offers/{node.pk}/rent/").content.decode()
    node_update(node=node, price_per_gpu_hour=Decimal("0.25"))
    r = web.post(f"/offers/{node.pk}/rent/", _form(page))
    assert r.status_code == 302, r.content.decode()[:2000]
    assert Instance.objects.get(renter=funded_renter).price_per_gpu_hour_micros == 250_000


def test_a_raise_seen_on_a_page_sent_back_for_another_reason_is_said_too(web, funded_renter):
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=1, price="0.500000")
    page = web.get(f"/offers/{node.pk}/rent/").content.decode()
    node_update(node=node, price_per_gpu_hour=Decimal("2"))
    r = web.post(f"/offers/{node.pk}/rent/", _form(page, ssh_public_key=""))
    again = r.content.decode()
    assert r.status_code == 400 and "now costs $2.00 per GPU-hour, not the $0.50 shown" in again
    assert _shown(again) == '{"":"2.000000"}' and not Instance.objects.exists()


@pytest.mark.parametrize(
    "value",
    ["nope", '{"":"NaN"}', '{"":"-1"}', '{"":"0.1234567"}', '{"":1}', "[1]", '{"":"1e999999"}', '{"":"Infinity"}',
     # nested past Python's recursion limit: json.loads raises RecursionError, not ValueError (found by review: a 500)
     "[" * 3999, "[" * 1500 + "]" * 1500],
)
def test_an_unreadable_shown_price_is_a_form_error_not_a_500(web, funded_renter, value):
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=1, price="0.500000")
    page = web.get(f"/offers/{node.pk}/rent/").content.decode()
    r = web.post(f"/offers/{node.pk}/rent/", _form(page, shown_prices=value))
    assert r.status_code == 400
    assert "Prices shown: The prices this page showed could not be read" in r.content.decode()
    assert not Instance.objects.exists()


def test_a_mig_slice_is_held_to_the_slice_price_shown(web, funded_renter):
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, {"3g.40gb": "0.70"})  # GPU 1 stays whole
    page = web.get(f"/offers/{node.pk}/rent/").content.decode()
    node_update(node=node, mig_prices={"3g.40gb": Decimal("5")})
    r = web.post(f"/offers/{node.pk}/rent/", _form(page, mig_profile="3g.40gb"))
    again = r.content.decode()
    assert r.status_code == 409, again[:2000]
    assert "now costs $5.00 per MIG 3g.40gb slice-hour, not the $0.70 shown" in again
    assert not Instance.objects.exists()
    r = web.post(f"/offers/{node.pk}/rent/", _form(again, mig_profile="3g.40gb"))
    assert r.status_code == 302, r.content.decode()[:2000]
    instance = Instance.objects.get(renter=funded_renter)
    assert (instance.mig_profile, instance.price_per_gpu_hour_micros) == ("3g.40gb", 5_000_000)


def test_a_double_click_still_books_once(web, funded_renter):
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=2, price="0.500000")
    page = web.get(f"/offers/{node.pk}/rent/").content.decode()
    form = _form(page)
    first, second = web.post(f"/offers/{node.pk}/rent/", form), web.post(f"/offers/{node.pk}/rent/", form)
    assert first.status_code == second.status_code == 302
    assert first["Location"] == second["Location"] and Instance.objects.count() == 1
