"""A provider's MIG section on the server page: declaring a layout and its slice prices through the form (the
service's rules, errors on the field, nothing half-written) and the slices a check proved, with their status."""
import pytest

from marketplace.models import MigSlice, Node
from tests.factories import UserFactory, make_listed_node, make_node
from tests.marketplace.mig_helpers import make_mig_node, prove
from tests.marketplace.renting_helpers import book
from tests.web.conftest import fund

pytestmark = pytest.mark.django_db


@pytest.fixture
def a100(renter):
    return make_node(renter, name="split-me", gpu_model="a100-80gb-sxm", gpu_count=2)


def test_a_provider_declares_a_layout_and_prices_on_the_page(web, a100):
    page = web.get(f"/nodes/{a100.pk}/").content.decode()
    assert 'id="mig-h"' in page and "3g.40gb" in page and f'action="/nodes/{a100.pk}/mig/"' in page
    r = web.post(f"/nodes/{a100.pk}/mig/", {"mig_layout": "GPU 0: 3g.40gb, 3g.40gb\n\ngpu 1: 7g.80gb",
                                             "mig_prices": "3g.40gb: 0.70\n7g.80gb: $1.60"})
    assert r.status_code == 302, r.content.decode()[:3000]
    a100.refresh_from_db()
    assert a100.mig_layout == [{"gpu": 0, "profiles": ["3g.40gb", "3g.40gb"]}, {"gpu": 1, "profiles": ["7g.80gb"]}]
    assert a100.mig_prices_micros == {"3g.40gb": 700_000, "7g.80gb": 1_600_000}
    page = web.get(f"/nodes/{a100.pk}/").content.decode()
    assert "GPU 0: 3g.40gb, 3g.40gb\nGPU 1: 7g.80gb</textarea>" in page
    assert "3g.40gb: 0.70\n7g.80gb: 1.60</textarea>" in page
    assert "No slice checked yet" in page
    # cleared: no MIG any more
    r = web.post(f"/nodes/{a100.pk}/mig/", {"mig_layout": "", "mig_prices": ""})
    a100.refresh_from_db()
    assert r.status_code == 302 and a100.mig_layout == [] and a100.mig_prices_micros == {}


@pytest.mark.parametrize(("fields", "field", "words"), [
    ({"mig_layout": "GPU 0: 9g.90gb", "mig_prices": "9g.90gb: 1"}, "mig_layout", "not a MIG profile"),
    ({"mig_layout": "GPU 0: 7g.80gb, 1g.10gb", "mig_prices": "7g.80gb: 1\n1g.10gb: 1"}, "mig_layout", "overfills"),
    ({"mig_layout": "GPU 2: 7g.80gb", "mig_prices": "7g.80gb: 1"}, "mig_layout", "0 to 1"),
    ({"mig_layout": "0 = 7g.80gb", "mig_prices": "7g.80gb: 1"}, "mig_layout", "Line 1 must read"),
    ({"mig_layout": "GPU 0: 3g.40gb, 3g.40gb", "mig_prices": ""}, "mig_prices", "Give a price per slice-hour"),
    ({"mig_layout": "GPU 0: 7g.80gb", "mig_prices": "7g.80gb: 1\n1g.10gb: 0.2"}, "mig_prices", "does not use"),
    ({"mig_layout": "GPU 0: 7g.80gb", "mig_prices": "7g.80gb: 0.0009"}, "mig_prices", "7g.80gb:"),
    ({"mig_layout": "GPU 0: 7g.80gb", "mig_prices": "7g.80gb 1"}, "mig_prices", "Line 1 must read"),
    ({"mig_layout": "GPU 0: 7g.80gb", "mig_prices": "7g.80gb: 1\n7g.80gb: 2"}, "mig_prices", "given twice"),
])
def test_bad_declarations_show_on_the_field_and_write_nothing(web, a100, fields, field, words):
    r = web.post(f"/nodes/{a100.pk}/mig/", fields)
    page = r.content.decode()
    assert r.status_code == 400 and f'id="id_{field}_errors"' in page and words in page, page[:4000]
    assert fields["mig_layout"] in page  # the input is kept
    a100.refresh_from_db()
    assert a100.mig_layout == [] and a100.mig_prices_micros == {}


def test_a_model_without_mig_has_no_mig_section(web, renter):
    node = make_node(renter, gpu_model="rtx-a6000", gpu_count=2)
    assert 'id="mig-h"' not in web.get(f"/nodes/{node.pk}/").content.decode()
    r = web.post(f"/nodes/{node.pk}/mig/", {"mig_layout": "GPU 0: 7g.80gb", "mig_prices": "7g.80gb: 1"})
    assert r.status_code == 400 and "has no MIG" in r.content.decode()


def test_another_providers_node_is_not_found(web):
    theirs = make_listed_node(UserFactory(), gpu_model="a100-80gb-sxm", gpu_count=1)
    assert web.post(f"/nodes/{theirs.pk}/mig/", {"mig_layout": "", "mig_prices": ""}).status_code == 404
    assert web.get(f"/nodes/{theirs.pk}/").status_code == 404


def test_the_page_lists_the_checked_slices_with_their_status(web, renter, stranger):
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"], 1: ["7g.80gb"]}, provider=renter)
    fund(stranger)
    book(stranger, node, num_gpus=1, mig_profile="3g.40gb")
    prove(node, {0: ["3g.40gb", "3g.40gb"], 1: ["7g.80gb"]})  # the next check keeps them (one is rented)
    MigSlice.objects.filter(node=node, profile="7g.80gb").update(status="unavailable")
    page = web.get(f"/nodes/{node.pk}/").content.decode()
    section = page.split('id="mig-h"')[1].split("</section>")[0]
    for s in MigSlice.objects.filter(node=node):
        assert s.uuid in section
    assert section.count('badge ok">free') == 1 and section.count('badge info">rented') == 1
    assert "its last check did not prove it" in section
    assert Node.objects.get(pk=node.pk).mig_layout[1] == {"gpu": 1, "profiles": ["7g.80gb"]}
