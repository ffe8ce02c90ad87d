"""Renting MIG slices on the rent page: the choice offered is what the row offers, the estimate is priced per
slice-hour, the booking goes through instance_create(mig_profile=...), and errors name the field."""
import re

import pytest

from marketplace.models import Instance, MigSlice
from marketplace.services import instances as svc
from tests.factories import make_listed_node
from tests.marketplace.mig_helpers import SEVEN, make_mig_node
from tests.marketplace.renting_helpers import book, ed25519_key
from tests.web.conftest import fund

pytestmark = pytest.mark.django_db


def _post(web, node, **fields):
    return web.post(f"/offers/{node.pk}/rent/", {"image": "cuda-12-4", "num_gpus": "1",
                                                 "ssh_public_key": ed25519_key(), "request_token": "t", **fields})


def test_an_all_mig_offer_rents_slices_from_its_rent_link(web, funded_renter):
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"], 1: SEVEN}, {"3g.40gb": "0.70", "1g.10gb": "0.25"})
    offers = web.get("/offers/").content.decode()
    assert f'href="/offers/{node.pk}/rent/"' in offers
    page = web.get(f"/offers/{node.pk}/rent/").content.decode()
    # no whole GPU is free: only the profiles, the first one chosen, the estimate priced per slice-hour
    assert 'name="mig_profile"' in page
    assert re.search(r'value="1g.10gb"[^>]*checked|checked[^>]*value="1g.10gb"', page)
    assert "Whole GPUs" not in page
    assert "MIG 3g.40gb slices (40 GB each): $0.70 per slice-hour, 2 free" in page
    assert "7 × 1g.10gb at $0.25 per slice-hour" in page
    assert '1 MIG 1g.10gb slice</span> × <span data-est="unit-price">$0.25 per slice-hour' in page
    r = _post(web, node, mig_profile="3g.40gb", num_gpus="2")
    assert r.status_code == 302, r.content.decode()[:2000]
    instance = Instance.objects.get(renter=funded_renter)
    assert (instance.mig_profile, instance.num_gpus, instance.price_per_hour_micros) == ("3g.40gb", 2, 1_400_000)
    assert len(svc.instance_slice_uuids(instance=instance)) == 2
    assert set(MigSlice.objects.filter(node=node, profile="3g.40gb").values_list("status", flat=True)) == {"rented"}


def test_the_estimate_follows_the_chosen_profile_after_an_error(web, funded_renter):
    node = make_mig_node({0: SEVEN}, {"1g.10gb": "0.25"}, gpu_count=2)  # GPU 1 stays whole
    page = web.get(f"/offers/{node.pk}/rent/").content.decode()
    assert "Whole GPUs: " in page and re.search(r'value=""[^>]*checked|checked[^>]*value=""', page)
    assert '1 GPU</span>' in page
    r = _post(web, node, mig_profile="1g.10gb", num_gpus="3", ssh_public_key="")
    page = r.content.decode()
    assert r.status_code == 400 and 'id="id_ssh_keys_errors"' in page
    assert '3 MIG 1g.10gb slices</span> × <span data-est="unit-price">$0.25 per slice-hour' in page
    assert "$0.75" in page and not Instance.objects.exists()


@pytest.mark.parametrize(("fields", "field", "words"), [
    ({"mig_profile": "2g.20gb"}, "mig_profile", "not one of the available choices"),
    ({"mig_profile": "1g.10gb", "num_gpus": "8"}, "num_gpus", "less than or equal to 7"),
])
def test_bad_slice_choices_show_on_the_form_naming_the_field(web, funded_renter, fields, field, words):
    node = make_mig_node({0: SEVEN}, {"1g.10gb": "0.25"}, gpu_count=1)
    r = _post(web, node, **fields)
    page = r.content.decode()
    assert r.status_code == 400 and f'id="id_{field}_errors"' in page and words in page, page[:3000]
    assert not Instance.objects.exists()


def test_more_slices_than_are_free_is_the_services_error_on_the_field(web, funded_renter, stranger):
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"], 1: ["3g.40gb", "3g.40gb"]}, {"3g.40gb": "0.70"})
    page = web.get(f"/offers/{node.pk}/rent/").content.decode()  # the form offered 4
    fund(stranger)
    book(stranger, node, num_gpus=3, mig_profile="3g.40gb")
    r = _post(web, node, mig_profile="3g.40gb", num_gpus="2")
    page = r.content.decode()
    assert r.status_code == 400 and 'id="id_num_gpus_errors"' in page
    assert "This offer has 1 free MIG 3g.40gb slice; ask for 1 to 1." in page
    assert not Instance.objects.filter(renter=funded_renter).exists()


def test_an_offer_without_slices_shows_no_choice(web, funded_renter):
    node = make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=2)
    page = web.get(f"/offers/{node.pk}/rent/").content.decode()
    assert 'name="mig_profile"' not in page and "data-unit-prices" not in page
    assert "Number of GPUs" in page and "or slices" not in page


def test_a_profile_from_the_link_is_chosen_when_free(web, funded_renter):
    node = make_mig_node({0: SEVEN, 1: ["3g.40gb", "3g.40gb"]}, {"1g.10gb": "0.25", "3g.40gb": "0.70"})
    page = web.get(f"/offers/{node.pk}/rent/?mig_profile=3g.40gb").content.decode()
    assert re.search(r'value="3g.40gb"[^>]*checked|checked[^>]*value="3g.40gb"', page)
    page = web.get(f"/offers/{node.pk}/rent/?mig_profile=9g.90gb").content.decode()
    assert re.search(r'value="1g.10gb"[^>]*checked|checked[^>]*value="1g.10gb"', page)


def test_instance_pages_say_which_slices_it_holds(web, funded_renter):
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, {"3g.40gb": "0.70"}, gpu_count=1)
    instance = book(funded_renter, node, num_gpus=2, mig_profile="3g.40gb")
    listing = web.get("/instances/").content.decode()
    assert "2 × MIG 3g.40gb of A100 80GB SXM" in listing
    page = web.get(f"/instances/{instance.pk}/").content.decode()
    for uuid in svc.instance_slice_uuids(instance=instance):
        assert uuid in page
    assert "$1.40 per hour ($0.70 per slice-hour)" in page


def test_the_offers_page_filtered_by_a_profile_links_to_the_form_with_that_profile_chosen(web, funded_renter):
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"], 1: SEVEN}, {"3g.40gb": "0.70", "1g.10gb": "0.25"})
    offers = web.get("/offers/?mig_profile=3g.40gb").content.decode()
    assert f'href="/offers/{node.pk}/rent/?mig_profile=3g.40gb"' in offers
    page = web.get(f"/offers/{node.pk}/rent/?mig_profile=3g.40gb").content.decode()
    assert re.search(r'value="3g.40gb"[^>]*checked|checked[^>]*value="3g.40gb"', page)
