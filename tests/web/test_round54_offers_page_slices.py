"""Review r54 (offers), findings 1 and 7 on the offers page.

1. A server whose cards are all split into MIG slices (no whole GPU free) showed "$0.10/h" under "Per GPU-hour", a
   price nobody can book there, and its Rent button said "at $0.10 per GPU-hour". It now shows "MIG slices only"
   with its prices per slice-hour, and the button's label says so; it comes after the whole-GPU offers by price.
7. The page printed "N GB RAM" and labelled the filter "RAM, at least (GB)", while ram_gb is GiB (MiB / 1024) as
   the API says: both say GiB now."""
import re

import pytest
from django.test import Client

from marketplace.models import Node
from tests.factories import make_listed_node
from tests.marketplace.mig_helpers import make_mig_node

pytestmark = pytest.mark.django_db


def rows(page: str) -> list[str]:
    return re.findall(r"<tr>.*?</tr>", page, flags=re.S)


def test_a_slice_only_offer_shows_its_slice_prices_not_a_gpu_hour_price():
    slices_only = make_mig_node({0: ["1g.10gb"] * 7, 1: ["1g.10gb"] * 7}, gpu_count=2, price="0.100000",
                                prices={"1g.10gb": "0.900000"}, city="Oslo")
    whole = make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=2, price="0.500000", city="Bergen")
    page = Client().get("/offers/", {"ordering": "price_per_gpu_hour"}).content.decode()
    [first, second] = [r for r in rows(page) if "/rent/" in r]
    assert f"/offers/{whole.pk}/rent/" in first and f"/offers/{slices_only.pk}/rent/" in second
    assert "MIG slices only" in second
    assert "$0.10" not in second, second
    assert "1g.10gb $0.90/slice-h" in second
    assert "per GPU-hour" not in re.search(r'aria-label="([^"]*)">Rent', second).group(1)
    assert "from $0.90 per slice-hour" in second
    assert "MIG slices only" not in first and "at $0.50 per GPU-hour" in first
    # Not matched by a GPU-hour price bound.
    page = Client().get("/offers/", {"max_price_per_gpu_hour": "0.2"}).content.decode()
    assert f"/offers/{slices_only.pk}/rent/" not in page


def test_ram_is_gib_on_the_page_and_its_filter():
    node = make_listed_node(gpu_count=1)
    Node.objects.filter(pk=node.pk).update(cpu_cores=32, ram_gb=251)
    page = Client().get("/offers/").content.decode()
    assert "251 GiB RAM" in page and "251 GB RAM" not in page
    assert "RAM, at least (GiB)" in page and "RAM, at least (GB)" not in page
