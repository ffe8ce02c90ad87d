"""Review round 47 (finding 2): an offer's NVLink claim is about the GPUs a renter can get, not the server.

On a node with NVLink islands [[0, 1], [2, 3]] whose renters of GPUs 1 and 2 left, the offers showed `nvlink: true`
with 2 free GPUs and listed it under nvlink=true&min_gpus=2; its 2-GPU booking got GPUs 1 and 2, on different
islands (230 GB/s over NVLink promised, 21 GB/s over PCIe had). Now: `nvlink_gpus_free` (the most free GPUs on one
island), the `nvlink` filter with min_gpus matching only that many on one island, Vast's bw_nvlink only on the
per-count offers up to it, and a booking's `require_nvlink` refusing (409) rather than spanning islands.
"""
import pytest

from marketplace.models import Instance
from marketplace.services import instances as svc
from tests.factories import UserFactory, make_listed_node

from .renting_helpers import book, ed25519_key, gpu_indices, run, sent_jobs_fixture  # noqa: F401

pytestmark = pytest.mark.django_db
PAIRS = {"connected": True, "islands": [[0, 1], [2, 3]], "links_per_gpu": 12, "p2p_gbs": 230.0,
         "pcie_p2p_gbs": 21.0}
V0 = "/compat/vast/api/v0"
VAST_DEFAULTS = {"verified": {"eq": True}, "external": {"eq": False}, "rentable": {"eq": True},
                 "order": [["score", "desc"]], "type": "on-demand", "allocated_storage": 5.0}


def _pairs_node(nvlink=PAIRS, gpu_count=4):
    node = make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=gpu_count)
    node.benchmark_summary = {"verdict": "verified", "findings": [], "median_per_gpu": {}, "nvlink": nvlink}
    node.save(update_fields=["benchmark_summary"])
    return node


def _leave(*instances):
    for inst in instances:
        svc.instance_destroy(instance=Instance.objects.get(pk=inst.pk))
        svc.instance_mark_destroyed(instance_id=inst.pk)


def _split_node():
    """GPUs 1 and 2 free, one of each island (the review's churn)."""
    node = _pairs_node()
    singles = [run(book(UserFactory(), node, 1)) for _ in range(4)]
    assert [gpu_indices(i) for i in singles] == [[0], [1], [2], [3]]
    _leave(singles[1], singles[2])
    return node


def _offers(anon, query=""):
    response = anon.get(f"/api/v1/offers/?{query}")
    assert response.status_code == 200, response.content[:300]
    return {o["id"]: o for o in response.json()["results"]}


def test_an_offer_whose_free_gpus_span_islands_is_no_nvlink_offer_for_two(anon):
    node = _split_node()
    offer = _offers(anon)[node.pk]
    assert (offer["num_gpus_free"], offer["nvlink_gpus_free"], offer["nvlink"]) == (2, 1, False)
    assert offer["benchmark"]["nvlink"]["connected"] is True  # the server's own interconnect, still shown
    assert node.pk not in _offers(anon, "nvlink=true&min_gpus=2")  # listed before: the booking got [1, 2]
    assert node.pk not in _offers(anon, "nvlink=true")
    assert node.pk in _offers(anon, "nvlink=false") and node.pk in _offers(anon, "min_gpus=2")
    assert anon.get(f"/api/v1/offers/{node.pk}/").json()["nvlink_gpus_free"] == 1  # the single read agrees


def test_an_offer_with_a_whole_free_island_is_listed_and_its_booking_gets_it(anon, client_for, sent_jobs):
    node = _pairs_node()
    book(UserFactory(), node, 1)  # GPU 3 (the last island's fewest free) or 0: one island stays whole
    offer = _offers(anon)[node.pk]
    assert (offer["num_gpus_free"], offer["nvlink_gpus_free"], offer["nvlink"]) == (3, 2, True)
    assert node.pk in _offers(anon, "nvlink=true&min_gpus=2") and node.pk in _offers(anon, "nvlink=true")
    assert node.pk not in _offers(anon, "nvlink=true&min_gpus=3")  # 3 free, but only 2 on one island
    assert node.pk in _offers(anon, "min_gpus=3") and node.pk not in _offers(anon, "nvlink=false")
    renter = UserFactory()
    r = client_for(renter).post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 2, "image": "cuda-12-4",
                                                        "ssh_public_key": ed25519_key(), "require_nvlink": True},
                                format="json")
    assert r.status_code == 201, r.content[:300]
    assert r.json()["gpus_on_one_nvlink_island"] is True


def test_require_nvlink_refuses_a_booking_across_islands_and_books_nothing(anon, client_for, sent_jobs):
    node = _split_node()
    renter = client_for(UserFactory())
    body = {"offer": node.pk, "num_gpus": 2, "image": "cuda-12-4", "ssh_public_key": ed25519_key(),
            "require_nvlink": True}
    r = renter.post("/api/v1/instances/", body, format="json")
    assert r.status_code == 409, r.content[:300]
    assert "at most 1 do" in r.json()["detail"] and "require_nvlink" in r.json()["detail"]
    assert _offers(anon)[node.pk]["num_gpus_free"] == 2  # rolled back: nothing booked
    assert not Instance.objects.filter(renter=renter.user).exists()
    # One GPU, or MIG slices, with require_nvlink: a 400 naming it.
    r = renter.post("/api/v1/instances/", {**body, "num_gpus": 1}, format="json")
    assert r.status_code == 400 and "require_nvlink" in str(r.json()), r.content[:300]
    # A server whose islands are all smaller than the ask: refused before any allocation.
    r = renter.post("/api/v1/instances/", {**body, "offer": _pairs_node().pk, "num_gpus": 3}, format="json")
    assert r.status_code == 409 and "no NVLink island of 3" in r.json()["detail"], r.content[:300]
    # Without it the booking still goes through, across islands, and says so.
    r = renter.post("/api/v1/instances/", {**body, "require_nvlink": False}, format="json")
    assert r.status_code == 201 and r.json()["gpus_on_one_nvlink_island"] is False, r.content[:300]


def test_a_server_without_nvlink_or_without_islands_has_none_free(anon):
    plain = _pairs_node(nvlink={"connected": False, "islands": [], "links_per_gpu": None, "p2p_gbs": 19.0,
                                "pcie_p2p_gbs": 19.0})
    unread = make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=2)
    odd = _pairs_node(nvlink={"connected": True, "islands": [[0, "x", 1], 7, [[2]], [3, 3.0]], "p2p_gbs": 1.0})
    offers = _offers(anon)
    assert [offers[n.pk]["nvlink_gpus_free"] for n in (plain, unread, odd)] == [0, 0, 2]
    assert {plain.pk, unread.pk} <= set(_offers(anon, "nvlink=false")) and odd.pk in _offers(anon, "nvlink=true")


def _vast_rows(anon, node, **query):
    r = anon.post(f"{V0}/bundles/", {**VAST_DEFAULTS, **query}, format="json")
    assert r.status_code == 200, r.content[:300]
    return {o["num_gpus"]: o for o in r.json()["offers"] if o["machine_id"] == node.pk}


def test_vast_offers_show_nvlink_bandwidth_only_for_counts_on_one_island(anon):
    node = _split_node()
    rows = _vast_rows(anon, node)
    assert {n: row.get("bw_nvlink") for n, row in rows.items()} == {1: 230.0, 2: 0.0}  # was 230.0 on both
    assert set(_vast_rows(anon, node, bw_nvlink={"gte": 100.0})) == {1}
    assert set(_vast_rows(anon, node, bw_nvlink={"gte": 100.0}, num_gpus={"gte": 2})) == set()
    whole = _pairs_node()
    assert {n: row.get("bw_nvlink") for n, row in _vast_rows(anon, whole).items()} == {
        1: 230.0, 2: 230.0, 3: 0.0, 4: 0.0}
