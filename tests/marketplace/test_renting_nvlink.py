"""Topology-aware allocation (issue 17 item 2): a multi-GPU booking on a node with NVLink islands takes GPUs of one
island when one has enough free, still in the booking's one allocation statement and still atomic under races."""
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from billing.services.ledger import credit_grant
from core.errors import Conflict
from marketplace.models import Image
from marketplace.services import instances as svc
from marketplace.services.instances.allocation import island_of_index
from tests.factories import UserFactory, make_listed_node

from .renting_helpers import book, ed25519_key, gpu_indices, sent_jobs_fixture  # noqa: F401
from .test_renting_concurrency import assert_consistent, booking, client_for, in_parallel

TWO_ISLANDS = {"connected": True, "islands": [[0, 1, 2, 3], [4, 5, 6, 7]], "links_per_gpu": 12, "p2p_gbs": 230.0,
               "pcie_p2p_gbs": 21.0}


def islands_node(nvlink=TWO_ISLANDS, gpu_count=8):
    node = make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=gpu_count)
    node.benchmark_summary = {"verdict": "verified", "findings": [], "median_per_gpu": {}, "nvlink": nvlink}
    node.save(update_fields=["benchmark_summary"])
    return node


def test_island_numbers_per_index():
    assert island_of_index([[0, 1], [3, 4]]) == [0, 0, None, 1, 1]
    assert island_of_index(None) == [] and island_of_index([["x", -1]]) == []


@pytest.mark.django_db
def test_a_booking_takes_one_island_and_keeps_the_other_whole():
    node = islands_node()
    first = book(UserFactory(), node, 2)
    assert gpu_indices(first) == [0, 1]
    # By index this would be 2, 3, 4, 5, across the boards; the whole free island is better.
    assert gpu_indices(book(UserFactory(), node, 4)) == [4, 5, 6, 7]
    assert gpu_indices(book(UserFactory(), node, 2)) == [2, 3]


@pytest.mark.django_db
def test_the_smallest_island_that_fits_is_taken_and_without_one_the_fullest_first():
    node = islands_node()
    book(UserFactory(), node, 1)  # GPU 0: island 0 has 3 free, island 1 has 4
    assert gpu_indices(book(UserFactory(), node, 3)) == [1, 2, 3]  # fits island 0 exactly: island 1 stays whole
    node2 = islands_node()
    book(UserFactory(), node2, 1)
    # No island fits six: the fuller island whole (4-7), then the other's lowest free (1, 2), not 1-6 by index.
    assert gpu_indices(book(UserFactory(), node2, 6)) == [1, 2, 4, 5, 6, 7]


@pytest.mark.django_db
def test_without_nvlink_the_order_is_by_index_and_the_statement_count_is_unchanged():
    node = islands_node(nvlink={"connected": False, "islands": [], "links_per_gpu": None, "p2p_gbs": 19.0,
                                "pcie_p2p_gbs": 19.0}, gpu_count=4)
    book(UserFactory(), node, 1)
    assert gpu_indices(book(UserFactory(), node, 2)) == [1, 2]


@pytest.mark.django_db(transaction=True)
def test_an_island_booking_is_still_one_short_transaction(sent_jobs, settings):
    """The same statements as any booking (test_renting_concurrency): the islands come with the node's share lock,
    the instance and its job go in and its GPUs are picked, locked, rented and allocated in the one WITH statement."""
    node = islands_node()
    book(UserFactory(), node, 1)  # GPU 0 taken: by index a 4-GPU booking would span both islands
    settings.BILLING_REQUIRE_FUNDS = True
    user = UserFactory()
    credit_grant(user=user, amount_micros=100_000_000, reason="test")
    image, keys = Image.objects.get(slug="cuda-12-4"), [ed25519_key()]
    with CaptureQueriesContext(connection) as captured:
        instance, _ = svc.instance_create(renter=user, node_id=node.pk, num_gpus=4, image=image, ssh_public_keys=keys)
    statements = [q["sql"].split(None, 1)[0].upper() for q in captured.captured_queries]
    assert statements == ["BEGIN", "WITH", "WITH", "COMMIT"], statements
    assert "sizes AS (SELECT island" in captured.captured_queries[2]["sql"]
    assert gpu_indices(instance) == [4, 5, 6, 7]
    assert_consistent()


@pytest.mark.django_db(transaction=True)
def test_four_gpu_bookings_racing_never_overbook_nor_half_allocate(sent_jobs):
    """Racing, the island choice may be less than best (the free counts are read without locks); the allocation
    stays all or nothing and no GPU is taken twice."""
    node = islands_node()
    clients = [client_for(UserFactory()) for _ in range(4)]
    responses = in_parallel([booking(c, node, 4) for c in clients])
    assert {r.status_code for r in responses} <= {201, 409}
    won = [sorted(r.json()["gpus"]) for r in responses if r.status_code == 201]
    assert 1 <= len(won) <= 2 and all(len(g) == 4 for g in won)
    assert len({i for g in won for i in g}) == 4 * len(won)
    assert_consistent()


@pytest.mark.django_db
def test_a_booking_refused_for_too_few_gpus_takes_nothing():
    node = islands_node()
    book(UserFactory(), node, 6)
    with pytest.raises(Conflict):
        book(UserFactory(), node, 4)
    assert_consistent()


@pytest.mark.django_db
def test_the_instance_says_whether_its_gpus_are_on_one_island():
    node = islands_node()
    renter = UserFactory()
    client = client_for(renter)
    one = client.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 4, "image": "cuda-12-4",
                                             "ssh_public_key": ed25519_key()}, format="json").json()
    assert (one["gpus"], one["gpus_on_one_nvlink_island"]) == ([0, 1, 2, 3], True)
    book(UserFactory(), node, 2)  # 4 and 5
    single = client.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "cuda-12-4",
                                                "ssh_public_key": ed25519_key()}, format="json").json()
    assert single["gpus_on_one_nvlink_island"] is None  # one GPU: nothing to join
    rows = {row["id"]: row for row in client.get("/api/v1/instances/").json()["results"]}
    assert rows[one["id"]]["gpus_on_one_nvlink_island"] is True
    plain = make_listed_node(gpu_count=4)
    other = client.post("/api/v1/instances/", {"offer": plain.pk, "num_gpus": 2, "image": "cuda-12-4",
                                               "ssh_public_key": ed25519_key()}, format="json").json()
    assert other["gpus_on_one_nvlink_island"] is None  # a node without NVLink


@pytest.mark.django_db
def test_gpus_spanning_two_islands_are_said_to():
    node = islands_node()
    book(UserFactory(), node, 3)  # 0, 1, 2
    book(UserFactory(), node, 3)  # 4, 5, 6
    renter = UserFactory()
    spanning = book(renter, node, 2)
    assert gpu_indices(spanning) == [3, 7]
    fresh = svc.instances_for_user(user=renter).get(pk=spanning.pk)
    assert svc.instance_on_one_nvlink_island(instance=fresh) is False
