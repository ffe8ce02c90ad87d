"""The volumes page (create, list, delete confirmed by the name), volumes on the instance page, and the host facts
on the offers and rent pages, with Django's test client."""
import re

import pytest

from marketplace.models import Instance, Volume
from marketplace.services import volumes as volume_svc
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import book

pytestmark = pytest.mark.django_db


def _node_with_host_facts():
    node = make_listed_node(gpu_model="rtx-a4000", gpu_count=2, city="Berlin")
    node.cpu_model, node.cpu_cores, node.ram_gb, node.disk_free_gb = "AMD EPYC 7543", 64, 512, 3500
    node.disk_bandwidth_mbs, node.driver_version, node.cuda_version = 1850.0, "550.54.15", 12040
    node.pcie_gen, node.pcie_width, node.net_mbps, node.disk_price_per_gb_month_micros = 4, 16, 940.0, 80_000
    node.save()
    return node


def test_the_volumes_page_needs_a_login(client):
    r = client.get("/volumes/")
    assert r.status_code == 302 and "/accounts/login/" in r["Location"]


def test_create_list_and_delete_with_the_name_typed(web, renter):
    node = _node_with_host_facts()
    page = web.get("/volumes/").content.decode()
    assert f'value="{node.pk}"' in page and "$0.08 per GB-month" in page
    r = web.post("/volumes/", {"offer": node.pk, "size_gb": 25, "label": "datasets"})
    assert r.status_code == 302
    volume = Volume.objects.get(owner=renter)
    assert (volume.size_gb, volume.label, volume.state) == (25, "datasets", "creating")
    volume_svc.volume_mark_available(volume_id=volume.pk)
    page = web.get("/volumes/").content.decode()
    assert volume.name in page and "datasets" in page and "25 GB" in page
    # A wrong name deletes nothing; the right one does.
    r = web.post(f"/volumes/{volume.pk}/delete/", {"confirm": "yes"}, follow=True)
    assert Volume.objects.get(pk=volume.pk).state == "available"
    assert volume.name in r.content.decode()  # the message says which name to send
    web.post(f"/volumes/{volume.pk}/delete/", {"confirm": volume.name})
    assert Volume.objects.get(pk=volume.pk).state == "deleting"


@pytest.mark.parametrize(("data", "field"), [({"size_gb": 0}, "size_gb"), ({"offer": 999_999}, "offer"),
                                             ({"label": "a\nb"}, "label")])
def test_bad_input_is_shown_next_to_the_field(web, data, field):
    node = _node_with_host_facts()
    r = web.post("/volumes/", {"offer": node.pk, "size_gb": 5, **data})
    assert r.status_code == 400 and f'id="id_{field}_errors"' in r.content.decode()
    assert not Volume.objects.exists()


def _token(page: str) -> str:
    match = re.search(r'name="request_token" value="([A-Za-z0-9]+)"', page)
    assert match is not None, "the form carries no request token"
    return match[1]


def test_a_double_submitted_volume_form_makes_one_billed_volume(web, funded_renter):
    """A double click (site.js does not disable the button) posts the page's form twice."""
    node = make_listed_node(gpu_model="rtx-a4000", gpu_count=2)
    data = {"offer": node.pk, "size_gb": 500, "label": "datasets",
            "request_token": _token(web.get("/volumes/").content.decode())}
    for _ in range(2):
        assert web.post("/volumes/", data).status_code == 302
    assert Volume.objects.filter(owner=funded_renter).count() == 1, "two volumes, both billed per GB-month"
    # The same form sent again with other choices (the back button) is refused, with a fresh token to send.
    r = web.post("/volumes/", {**data, "size_gb": 20})
    assert r.status_code == 400 and "already used to create a volume" in r.content.decode()
    fresh = _token(r.content.decode())
    assert fresh != data["request_token"]
    assert web.post("/volumes/", {**data, "size_gb": 20, "request_token": fresh}).status_code == 302
    assert sorted(Volume.objects.filter(owner=funded_renter).values_list("size_gb", flat=True)) == [20, 500]


def test_another_users_volume_cannot_be_deleted(web, stranger):
    node = _node_with_host_facts()
    theirs = volume_svc.volume_mark_available(
        volume_id=volume_svc.volume_create(owner=stranger, node_id=node.pk, size_gb=5).pk)
    assert web.post(f"/volumes/{theirs.pk}/delete/", {"confirm": theirs.name}).status_code == 404
    assert theirs.name not in web.get("/volumes/").content.decode()
    assert Volume.objects.get(pk=theirs.pk).state == "available"


def test_the_instance_page_shows_its_volumes_and_the_disk_price(web, renter):
    node = _node_with_host_facts()
    volume = volume_svc.volume_mark_available(
        volume_id=volume_svc.volume_create(owner=renter, node_id=node.pk, size_gb=7, label="ckpt").pk)
    instance = book(renter, node, volumes=[{"volume": volume.pk, "mount": "/data"}])
    page = web.get(f"/instances/{instance.pk}/").content.decode()
    assert volume.name in page and "/data" in page and "(ckpt)" in page
    assert "$0.08 per GB-month" in page
    # The volumes page says who mounts it, and offers no delete while it does.
    page = web.get("/volumes/").content.decode()
    assert f'href="/instances/{instance.pk}/"' in page and f"/volumes/{volume.pk}/delete/" not in page
    assert Instance.objects.get(pk=instance.pk).volume_mounts.count() == 1


def test_offers_and_rent_pages_show_the_host_facts(client, web, renter):
    node = _node_with_host_facts()
    node.disk_total_gb = 3840
    node.save()
    book(renter, node, disk_gb=100)  # promised since the report: the pages show the room left, as bookings judge it
    offers = client.get("/offers/").content.decode()
    assert "PCIe 4.0 ×16" in offers and "CUDA 12.4" in offers and "64 CPU threads" in offers
    assert "3400 GB disk free to book" in offers
    rent = web.get(f"/offers/{node.pk}/rent/").content.decode()
    for text in ("AMD EPYC 7543", "512 GB RAM", "3400 GB free to book (a 3840 GB disk)", "1,850 MB/s", "550.54.15",
                 "940 Mbit/s", "measured by the platform over SSH"):
        assert text in rent, text


@pytest.mark.parametrize("query", ["min_cuda_version=12.4", "min_cuda_version=12.5", "min_pcie_gen=4&min_ram_gb=500",
                                   "ordering=-ram_gb", "ordering=platform_to_node_mbps"])
def test_host_filters_work_on_the_offers_page_as_in_the_api(client, query):
    node = _node_with_host_facts()
    make_listed_node(gpu_model="rtx-a4000")  # not measured yet: nulls, ordered last
    page = client.get(f"/offers/?{query}").content.decode()
    web_ids = [int(i) for i in re.findall(r'href="/offers/(\d+)/rent/"', page)]
    api_ids = [o["id"] for o in client.get(f"/api/v1/offers/?{query}").json()["results"]]
    assert web_ids == api_ids
    if query.startswith("ordering"):
        assert api_ids[0] == node.pk


def test_a_volume_the_balance_cannot_hold_an_hour_of_is_refused_in_the_pages_words(web, renter, settings):
    """The funds check of renting (found by review: a volume needed only a balance above zero), worded for the page."""
    from tests.billing.helpers import fund

    settings.BILLING_REQUIRE_FUNDS = True
    node = _node_with_host_facts()  # USD 0.08 per GB-month: 3000 GB is USD 0.33 per hour
    fund(renter, "0.10")
    r = web.post("/volumes/", {"offer": node.pk, "size_gb": 3000})
    page = r.content.decode()
    assert r.status_code == 400 and "Not enough balance: this volume costs $0.333333 per hour" in page, page
    (said,) = re.findall(r'<ul class="errorlist nonfield"[^>]*><li>(.*?)</li>', page)
    assert "top up at least $0.24 on the Balance page" in said and "/api/v1/" not in said
    assert not Volume.objects.exists()
    # The node's reported free disk (3500 GB) is a limit too, said on the page.
    fund(renter, "10")
    page = web.post("/volumes/", {"offer": node.pk, "size_gb": 4000}).content.decode()
    assert "reported 3500 GB of free disk" in page and not Volume.objects.exists()
