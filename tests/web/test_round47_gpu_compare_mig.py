"""Round 47: the GPU comparison's prices are of whole GPUs a renter can book, never a slice-only node's per-GPU
price (which nothing on that node is charged at: slices are priced per slice-hour)."""
import pytest
from django.test import Client

from marketplace.models import GpuModel
from marketplace.web.figures import gpu_comparison
from tests.factories import make_listed_node
from tests.marketplace.mig_helpers import make_mig_node

A100 = "a100-80gb-sxm"


@pytest.mark.django_db
def test_a_slice_only_node_is_no_price_of_a_gpu_hour():
    # Every GPU of this node is split into MIG slices: renters book slices only, never a whole GPU.
    make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=1, price="0.100000")
    whole = make_listed_node(gpu_model=A100, gpu_count=2, price="2.000000")
    column = gpu_comparison(GpuModel.objects.filter(slug=A100))[0]
    # The only whole A100 a renter can book costs $2.00 per GPU-hour (old code: $0.10 cheapest, $1.05 median).
    assert (column.cheapest_micros, column.median_micros) == (whole.price_per_gpu_hour_micros,) * 2
    assert (column.offers, column.slice_only_offers, column.gpus_free) == (2, 1, 2)
    page = Client().get(f"/gpus/?models={A100}").content.decode()
    assert "$2.00" in page and "$0.10" not in page and "$1.05" not in page
    assert "1 (2 GPUs free), 1 with MIG slices only" in page


@pytest.mark.django_db
def test_a_model_on_offer_as_slices_only_has_no_gpu_hour_price_and_no_best_value():
    # A100 slices only at a $0.01 per-GPU price the provider is never charged at, against a whole RTX A6000 for rent.
    make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=1, price="0.010000")
    make_listed_node(gpu_model="rtx-a6000", gpu_count=1, price="3.000000")
    columns = {c.model.slug: c for c in gpu_comparison(GpuModel.objects.filter(slug__in=[A100, "rtx-a6000"]))}
    a100 = columns[A100]
    assert not a100.best_value  # old code: the $0.01 A100 was marked the best value
    assert (a100.offers, a100.cheapest_micros, a100.cheapest_per_tflop, a100.slice_only_offers) == (1, None, None, 1)
    page = Client().get("/gpus/").content.decode()
    assert "1 with MIG slices only" in page and "MIG slices only" in page
