"""Starting a stopped multi-GPU instance on a node with NVLink islands (found by review): its own GPUs when all are
free; else a VM takes GPUs as a booking would (the smallest island that fits, else the fullest first), keeping as
many of its own as that rule allows. By index it took its remaining card and the next, across islands, beside a
whole free island. A container and a MIG instance keep theirs."""
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from core.errors import Conflict
from marketplace.models import Gpu, GpuStatus, Instance, MigSlice
from marketplace.services import instances as svc
from tests.factories import UserFactory

from .mig_helpers import make_mig_node
from .renting_helpers import book, ed25519_key, gpu_indices, run, sent_jobs_fixture  # noqa: F401
from .test_renting_concurrency import assert_consistent, client_for
from .test_renting_nvlink import islands_node

pytestmark = pytest.mark.django_db

PAIRS = {"connected": True, "islands": [[0, 1], [2, 3]], "links_per_gpu": 12, "p2p_gbs": 230.0,
         "pcie_p2p_gbs": 21.0}


def stopped(instance) -> Instance:
    run(instance)
    svc.instance_stop(instance=Instance.objects.get(pk=instance.pk))
    return svc.instance_mark_stopped(instance_id=instance.pk)


def set_status(node, indices, status) -> None:
    Gpu.objects.filter(node=node, index__in=indices).update(status=status)


def test_a_start_whose_card_was_taken_moves_to_a_whole_free_island_through_the_api():
    """The reviewer's example: islands [[0, 1], [2, 3]], the instance on 0 and 1 stopped, GPU 0 rented by another.
    A new booking would take 2 and 3; the start took 1 and 2 and said so (gpus_on_one_nvlink_island: false)."""
    node = islands_node(nvlink=PAIRS, gpu_count=4)
    renter = UserFactory()
    client = client_for(renter)
    created = client.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 2, "image": "cuda-12-4",
                                                 "ssh_public_key": ed25519_key()}, format="json").json()
    assert (created["gpus"], created["gpus_on_one_nvlink_island"]) == ([0, 1], True)
    instance = stopped(Instance.objects.get(pk=created["id"]))
    assert gpu_indices(book(UserFactory(), node, 1)) == [0]
    r = client.post(f"/api/v1/instances/{instance.pk}/start/")
    assert r.status_code == 202, r.content
    body = r.json()
    assert (body["status"], body["gpus"], body["gpus_on_one_nvlink_island"]) == ("starting", [2, 3], True)
    assert body["status_message"].endswith("to start it on GPUs 2, 3")
    again = client.get(f"/api/v1/instances/{instance.pk}/").json()
    assert (again["gpus"], again["gpus_on_one_nvlink_island"]) == ([2, 3], True)
    assert Gpu.objects.get(node=node, index=1).status == GpuStatus.FREE  # not half-held
    assert_consistent()


def test_its_own_gpus_all_free_are_kept_even_across_islands():
    """Keeping all of its GPUs is best (nothing moves), even where they span islands and one island is free now."""
    node = islands_node(nvlink=PAIRS, gpu_count=4)
    set_status(node, [0, 3], GpuStatus.UNAVAILABLE)
    instance = book(UserFactory(), node, 2)
    assert gpu_indices(instance) == [1, 2]  # no island had two free: one of each
    set_status(node, [0, 3], GpuStatus.FREE)
    stopped(instance)
    started = svc.instance_start(instance=Instance.objects.get(pk=instance.pk))
    assert gpu_indices(started) == [1, 2]


def test_moving_keeps_as_many_of_its_own_gpus_as_the_island_rule_allows():
    """Two islands with two free each: a booking takes the first; the start takes the one holding its own GPU 4,
    and GPU 4 in it, where by index it took 4 and 1 across the islands."""
    node = islands_node(nvlink={**PAIRS, "islands": [[0, 1, 2], [3, 4, 5]]}, gpu_count=6)
    set_status(node, [0, 1, 2], GpuStatus.UNAVAILABLE)
    instance = book(UserFactory(), node, 2)
    assert gpu_indices(instance) == [3, 4]
    set_status(node, [0, 1, 2], GpuStatus.FREE)
    stopped(instance)
    assert gpu_indices(book(UserFactory(), node, 1)) == [0]
    set_status(node, [3], GpuStatus.UNAVAILABLE)  # its provider took card 3 out
    started = svc.instance_start(instance=Instance.objects.get(pk=instance.pk))
    assert gpu_indices(started) == [4, 5]


def test_in_the_smallest_island_that_fits_its_own_gpu_comes_first():
    node = islands_node()  # [0-3], [4-7]
    instance = book(UserFactory(), node, 2)
    assert gpu_indices(instance) == [0, 1]
    stopped(instance)
    book(UserFactory(), node, 1)  # GPU 0: island 0 has 1, 2, 3 free, the smallest that fits
    started = svc.instance_start(instance=Instance.objects.get(pk=instance.pk))
    assert gpu_indices(started) == [1, 2]


def test_with_no_island_that_fits_the_fullest_comes_first():
    node = islands_node()
    instance = book(UserFactory(), node, 5)  # no island fits: 0-3 whole, then 4
    assert gpu_indices(instance) == [0, 1, 2, 3, 4]
    stopped(instance)
    book(UserFactory(), node, 1)  # GPU 0
    book(UserFactory(), node, 1)  # GPU 1: island 0 has 2 free, island 1 has 4
    started = svc.instance_start(instance=Instance.objects.get(pk=instance.pk))
    assert gpu_indices(started) == [2, 4, 5, 6, 7]  # by index (its own 2, 3, 4 first): 2-6


def test_too_few_free_is_refused_and_takes_nothing():
    node = islands_node(nvlink=PAIRS, gpu_count=4)
    instance = book(UserFactory(), node, 2)
    stopped(instance)
    book(UserFactory(), node, 1)
    book(UserFactory(), node, 1)
    book(UserFactory(), node, 1)  # 0, 1, 2: only 3 is free
    with pytest.raises(Conflict, match="Only 1 GPU of the 2 it needs are free"):
        svc.instance_start(instance=Instance.objects.get(pk=instance.pk))
    assert Instance.objects.get(pk=instance.pk).status == "stopped"
    assert Gpu.objects.get(node=node, index=3).status == GpuStatus.FREE
    assert_consistent()


def test_the_start_reads_the_islands_with_the_node_and_picks_in_one_statement():
    node = islands_node(nvlink=PAIRS, gpu_count=4)
    instance = book(UserFactory(), node, 2)
    stopped(instance)
    book(UserFactory(), node, 1)
    with CaptureQueriesContext(connection) as captured:
        svc.instance_start(instance=Instance.objects.get(pk=instance.pk))
    picks = [q["sql"] for q in captured.captured_queries if "sizes AS (SELECT island" in q["sql"]]
    assert len(picks) == 1 and "FOR UPDATE OF g SKIP LOCKED" in picks[0]


def test_a_container_still_gets_only_its_own_gpus():
    """A container cannot move: with its card taken it is refused, not moved to the free island."""
    node = islands_node(nvlink=PAIRS, gpu_count=4)
    node.runtime = "docker"
    node.save(update_fields=["runtime"])
    instance = book(UserFactory(), node, 2)
    assert gpu_indices(instance) == [0, 1]
    stopped(instance)
    book(UserFactory(), node, 1)
    with pytest.raises(Conflict, match="GPU 0 is rented by another instance now"):
        svc.instance_start(instance=Instance.objects.get(pk=instance.pk))
    assert sorted(Gpu.objects.filter(node=node, status=GpuStatus.FREE).values_list("index", flat=True)) == [1, 2, 3]


def test_a_restart_keeps_its_gpus():
    node = islands_node(nvlink=PAIRS, gpu_count=4)
    instance = run(book(UserFactory(), node, 2))
    restarted = svc.instance_restart(instance=instance)
    assert restarted.status == "starting" and gpu_indices(restarted) == [0, 1]


def test_a_mig_instance_on_a_node_with_islands_starts_on_its_own_slices():
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"], 1: ["3g.40gb", "3g.40gb"]}, gpu_count=2)
    node.benchmark_summary = {**(node.benchmark_summary or {}), "nvlink": {**PAIRS, "islands": [[0, 1]]}}
    node.save(update_fields=["benchmark_summary"])
    instance = book(UserFactory(), node, num_gpus=2, mig_profile="3g.40gb")
    held = sorted(svc.instance_slice_uuids(instance=instance))
    stopped(instance)
    assert set(MigSlice.objects.filter(uuid__in=held).values_list("status", flat=True)) == {"free"}
    started = svc.instance_start(instance=Instance.objects.get(pk=instance.pk))
    assert started.status == "starting" and sorted(svc.instance_slice_uuids(instance=started)) == held
    restarted = svc.instance_restart(instance=run(started))
    assert sorted(svc.instance_slice_uuids(instance=restarted)) == held
