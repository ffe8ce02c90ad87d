"""A provider's servers list and server page count what is rented on a split GPU: its MIG slices, apart from the
whole GPUs (a node whose 14 slices were all rented read "0 of 2 GPUs rented")."""
import re

import pytest

from marketplace.models import Node
from tests.marketplace.mig_helpers import SEVEN, make_mig_node
from tests.marketplace.renting_helpers import book
from tests.web.conftest import fund

pytestmark = pytest.mark.django_db


def _text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def test_every_slice_rented_reads_as_rented(web, renter, stranger):
    node = make_mig_node({0: SEVEN, 1: SEVEN}, {"1g.10gb": "0.25"}, provider=renter)
    fund(stranger)
    book(stranger, node, num_gpus=7, mig_profile="1g.10gb")
    book(stranger, node, num_gpus=7, mig_profile="1g.10gb")
    page = _text(web.get(f"/nodes/{node.pk}/").content.decode())
    assert "14 of 14 MIG slices rented (2 GPUs split)" in page
    assert "0 of 2 GPUs rented" not in page
    listing = _text(web.get("/nodes/").content.decode())
    assert "14 / 14 MIG slices" in listing and "0 / 2" not in listing


def test_whole_gpus_and_slices_are_counted_apart(web, renter, stranger):
    node = make_mig_node({0: SEVEN}, {"1g.10gb": "0.25"}, provider=renter, gpu_count=2)  # GPU 1 stays whole
    fund(stranger)
    book(stranger, node, num_gpus=3, mig_profile="1g.10gb")
    page = _text(web.get(f"/nodes/{node.pk}/").content.decode())
    assert "0 of 1 whole GPU rented · 3 of 7 MIG slices rented (1 GPU split)" in page
    listing = _text(web.get("/nodes/").content.decode())
    assert "0 / 1 GPU 3 / 7 MIG slices" in listing
    Node.objects.filter(pk=node.pk).update(listed=False)  # the idle ones it cannot offer: slices counted too
    page = _text(web.get(f"/nodes/{node.pk}/").content.decode())
    assert "so its 1 idle GPU and 4 idle MIG slices cannot be rented" in page


def test_a_node_without_slices_reads_as_before(web, renter, stranger):
    node = make_mig_node({}, provider=renter, gpu_count=2)
    fund(stranger)
    book(stranger, node, num_gpus=1)
    page = _text(web.get(f"/nodes/{node.pk}/").content.decode())
    assert "1 of 2 GPUs rented" in page and "MIG slices rented" not in page
    listing = _text(web.get("/nodes/").content.decode())
    assert "1 / 2" in listing and "MIG" not in listing.split("Earned")[1]
