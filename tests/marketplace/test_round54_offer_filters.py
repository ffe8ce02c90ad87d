"""Review r54 (offers), findings 2 and 6 (4: test_round54_repeated_filters.py).

2. `min_gpu_memory_gb` with `mig_profile` read the whole card's memory: 10 GB slices matched "at least 40". With a
   profile it is the profile's memory per slice, what a booking with it gets.
6. `nvlink=true` with `mig_profile` narrowed the list by whole free GPUs on an island, which a slice booking never
   gets (booking refuses require_nvlink with mig_profile): a 400 naming both."""
import pytest
from rest_framework.test import APIClient

from .mig_helpers import make_mig_node

pytestmark = pytest.mark.django_db

URL = "/api/v1/offers/"


def ids(params) -> list[int]:
    response = APIClient().get(URL, params)
    assert response.status_code == 200, response.content
    return [o["id"] for o in response.json()["results"]]


# ------------------------------------------------------------------------------------------------- 2


def test_min_gpu_memory_with_mig_profile_is_the_slices_memory():
    node = make_mig_node({0: ["1g.10gb"] * 7, 1: ["3g.40gb", "3g.40gb"]}, gpu_count=2)
    assert node.pk not in ids({"mig_profile": "1g.10gb", "min_gpu_memory_gb": 40})  # the reviewer's
    assert ids({"mig_profile": "1g.10gb", "min_gpu_memory_gb": 10}) == [node.pk]
    assert ids({"mig_profile": "1g.10gb", "min_gpu_memory_gb": 11}) == []
    assert ids({"mig_profile": "3g.40gb", "min_gpu_memory_gb": 40}) == [node.pk]
    assert ids({"mig_profile": "3g.40gb", "min_gpu_memory_gb": 41}) == []
    # Without a profile, the card's (a whole GPU of the node is not free here, but the node is listed).
    assert ids({"min_gpu_memory_gb": 80}) == [node.pk]
    assert ids({"min_gpu_memory_gb": 81}) == []


def test_a_cached_shape_takes_each_requests_memory():
    node = make_mig_node({0: ["1g.10gb"] * 7}, gpu_count=1)
    for memory, expected in ((40, []), (5, [node.pk]), (10, [node.pk]), (11, [])):
        assert ids({"mig_profile": "1g.10gb", "min_gpu_memory_gb": memory}) == expected


# ------------------------------------------------------------------------------------------------- 6


def test_nvlink_true_with_a_mig_profile_is_a_400_naming_both():
    make_mig_node({0: ["1g.10gb"] * 7}, gpu_count=4)
    response = APIClient().get(URL, {"nvlink": "true", "mig_profile": "1g.10gb"})
    assert response.status_code == 400, response.content
    assert set(response.json()) >= {"nvlink", "mig_profile"}
    # nvlink=false with a profile, and each alone, are as before.
    assert APIClient().get(URL, {"nvlink": "false", "mig_profile": "1g.10gb"}).status_code == 200
    assert APIClient().get(URL, {"nvlink": "true"}).status_code == 200
    assert APIClient().get(URL, {"mig_profile": "1g.10gb"}).status_code == 200
