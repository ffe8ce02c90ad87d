"""One-GPU bookings and starts on a node with NVLink islands (found by review): they took the lowest free index, so
GPU 0 out of a whole island, and a later multi-GPU booking that would have fit that island spanned two. They now
rank as multi-GPU bookings do: a card off every island (an island of one) first, else the island with the fewest
free, in the same one statement."""
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from billing.services.ledger import credit_grant
from marketplace.models import Gpu, GpuStatus, Image, Instance
from marketplace.services import instances as svc
from tests.factories import UserFactory, make_listed_node

from .renting_helpers import book, ed25519_key, gpu_indices, run, sent_jobs_fixture  # noqa: F401
from .test_renting_concurrency import assert_consistent

pytestmark = pytest.mark.django_db

ISLANDS_4_2 = {"connected": True, "islands": [[0, 1, 2, 3], [4, 5]], "links_per_gpu": 12, "p2p_gbs": 230.0,
               "pcie_p2p_gbs": 21.0}


def islands_node(nvlink, gpu_count):
    node = make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=gpu_count)
    node.benchmark_summary = {"verdict": "verified", "findings": [], "median_per_gpu": {}, "nvlink": nvlink}
    node.save(update_fields=["benchmark_summary"])
    return node


def on_one_island(instance) -> bool | None:
    return svc.instance_on_one_nvlink_island(instance=svc.instances_for_user(user=instance.renter).get(pk=instance.pk))


def test_single_gpu_booking_breaks_the_island_a_later_booking_needs():
    """The reviewer's example: 1 GPU took GPU 0, then 4 GPUs got 1, 2, 3, 4 across both islands."""
    node = islands_node(ISLANDS_4_2, gpu_count=6)
    one = book(UserFactory(), node, 1)
    four = book(UserFactory(), node, 4)
    assert on_one_island(four), (
        f"1-GPU booking took {gpu_indices(one)}; the 4-GPU booking then got {gpu_indices(four)}")
    assert gpu_indices(one) == [4] and gpu_indices(four) == [0, 1, 2, 3]
    assert gpu_indices(book(UserFactory(), node, 1)) == [5]
    assert_consistent()


def test_a_standalone_card_goes_to_a_single_gpu_renter_before_an_island_card():
    node = islands_node({**ISLANDS_4_2, "islands": [[0, 1, 2, 3]]}, gpu_count=5)  # GPU 4 is on no island
    one = book(UserFactory(), node, 1)
    assert gpu_indices(one) == [4]
    four = book(UserFactory(), node, 4)
    assert gpu_indices(four) == [0, 1, 2, 3] and on_one_island(four)


@pytest.mark.django_db(transaction=True)
def test_a_single_gpu_booking_on_islands_is_still_one_short_transaction(sent_jobs, settings):
    """The same statements as any booking (test_renting_nvlink): the node and wallet, then the one WITH."""
    node = islands_node(ISLANDS_4_2, gpu_count=6)
    settings.BILLING_REQUIRE_FUNDS = True
    user = UserFactory()
    credit_grant(user=user, amount_micros=100_000_000, reason="test")
    image, keys = Image.objects.get(slug="cuda-12-4"), [ed25519_key()]
    with CaptureQueriesContext(connection) as captured:
        instance, _ = svc.instance_create(renter=user, node_id=node.pk, num_gpus=1, image=image, ssh_public_keys=keys)
    statements = [q["sql"].split(None, 1)[0].upper() for q in captured.captured_queries]
    assert statements == ["BEGIN", "WITH", "WITH", "COMMIT"], statements
    assert "sizes AS (SELECT island" in captured.captured_queries[2]["sql"]
    assert gpu_indices(instance) == [4]


def test_a_single_gpu_start_whose_card_is_gone_takes_one_of_the_smallest_island():
    """A stopped 1-GPU VM whose card was taken out: by index its start took GPU 0 out of the whole island of four;
    now the free card left in the pair."""
    node = islands_node(ISLANDS_4_2, gpu_count=6)
    Gpu.objects.filter(node=node, index__in=[0, 1, 2, 3, 5]).update(status=GpuStatus.UNAVAILABLE)
    instance = run(book(UserFactory(), node, 1))
    assert gpu_indices(instance) == [4]
    Gpu.objects.filter(node=node, index__in=[0, 1, 2, 3, 5]).update(status=GpuStatus.FREE)
    svc.instance_stop(instance=Instance.objects.get(pk=instance.pk))
    svc.instance_mark_stopped(instance_id=instance.pk)
    Gpu.objects.filter(node=node, index=4).update(status=GpuStatus.UNAVAILABLE)  # its provider took card 4 out
    started = svc.instance_start(instance=Instance.objects.get(pk=instance.pk))
    assert gpu_indices(started) == [5]
    four = book(UserFactory(), node, 4)
    assert gpu_indices(four) == [0, 1, 2, 3] and on_one_island(four)


def test_a_single_gpu_start_keeps_its_own_card_when_free():
    node = islands_node(ISLANDS_4_2, gpu_count=6)
    Gpu.objects.filter(node=node, index__in=[4, 5]).update(status=GpuStatus.UNAVAILABLE)
    instance = run(book(UserFactory(), node, 1))
    assert gpu_indices(instance) == [0]
    Gpu.objects.filter(node=node, index__in=[4, 5]).update(status=GpuStatus.FREE)
    svc.instance_stop(instance=Instance.objects.get(pk=instance.pk))
    svc.instance_mark_stopped(instance_id=instance.pk)
    started = svc.instance_start(instance=Instance.objects.get(pk=instance.pk))
    assert gpu_indices(started) == [0]  # its own card, free: kept, though the pair's cards rank first for a move
