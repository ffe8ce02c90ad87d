"""An instance booked with require_nvlink keeps its GPUs on one NVLink island when a start takes GPUs again.

A start of a stopped VM whose GPUs are not all free takes GPUs as a booking does (one island when one has enough
free); with no island free enough it took them across islands, PCIe between them: the booking's require_nvlink was
not remembered. Now the instance stores it (`require_nvlink`, shown by the API) and such a start is a 409 that
says how many free GPUs share an island; the instance stays stopped, nothing taken.
"""
import pytest
from django.db import connections, transaction

from marketplace.models import Gpu, GpuStatus, Instance
from marketplace.services import instances as svc
from marketplace.services.instances import allocation
from provisioning.models import Job, JobKind
from tests.factories import UserFactory

from .renting_helpers import book, ed25519_key, gpu_indices, run, sent_jobs_fixture  # noqa: F401
from .test_renting_concurrency import assert_consistent, client_for
from .test_renting_nvlink import islands_node

pytestmark = pytest.mark.django_db

PAIRS = {"connected": True, "islands": [[0, 1], [2, 3]], "links_per_gpu": 12, "p2p_gbs": 230.0,
         "pcie_p2p_gbs": 21.0}


def _booked(client, node, **body):
    r = client.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 2, "image": "cuda-12-4",
                                           "ssh_public_key": ed25519_key(), **body}, format="json")
    assert r.status_code == 201, r.content[:300]
    return r.json()


def _stopped(instance_id: int) -> Instance:
    run(Instance.objects.get(pk=instance_id))
    svc.instance_stop(instance=Instance.objects.get(pk=instance_id))
    return svc.instance_mark_stopped(instance_id=instance_id)


def _split(node) -> None:
    """GPUs 1 and 2 free, one of each island: the others rented by someone else."""
    others = [book(UserFactory(), node, 1) for _ in range(4)]
    assert sorted(i for inst in others for i in gpu_indices(inst)) == [0, 1, 2, 3]
    for inst in others:
        if gpu_indices(inst) in ([1], [2]):
            svc.instance_destroy(instance=Instance.objects.get(pk=inst.pk))
            svc.instance_mark_destroyed(instance_id=inst.pk)


def test_the_instance_remembers_and_shows_require_nvlink():
    node = islands_node(nvlink=PAIRS, gpu_count=4)
    client = client_for(UserFactory())
    made = _booked(client, node, require_nvlink=True)
    assert (made["require_nvlink"], made["gpus"], made["gpus_on_one_nvlink_island"]) == (True, [0, 1], True)
    assert client.get(f"/api/v1/instances/{made['id']}/").json()["require_nvlink"] is True
    plain = _booked(client, node)
    assert plain["require_nvlink"] is False
    listed = {row["id"]: row["require_nvlink"] for row in client.get("/api/v1/instances/").json()["results"]}
    assert listed == {made["id"]: True, plain["id"]: False}
    assert Instance.objects.get(pk=made["id"]).require_nvlink is True


def test_a_start_with_no_island_free_enough_is_refused_not_spread_across_islands():
    node = islands_node(nvlink=PAIRS, gpu_count=4)
    client = client_for(UserFactory())
    made = _booked(client, node, require_nvlink=True)
    _stopped(made["id"])
    _split(node)  # its GPUs 0 and 1 released; now 1 and 2 are free, one of each island
    jobs = Job.objects.count()
    r = client.post(f"/api/v1/instances/{made['id']}/start/")
    # Before: 202, started on GPUs 1 and 2 (gpus_on_one_nvlink_island false), 21 GB/s over PCIe.
    assert r.status_code == 409, r.content[:300]
    detail = r.json()["detail"]
    assert "require_nvlink" in detail and "at most 1 do" in detail and "stays stopped" in detail, detail
    instance = Instance.objects.get(pk=made["id"])
    assert (instance.status, gpu_indices(instance)) == ("stopped", [])
    assert set(Gpu.objects.filter(node=node, status=GpuStatus.FREE).values_list("index", flat=True)) == {1, 2}
    assert Job.objects.count() == jobs  # no start queued
    assert_consistent()


def test_a_start_moves_to_a_whole_free_island_and_one_without_require_nvlink_still_spans():
    node = islands_node(nvlink=PAIRS, gpu_count=4)
    client = client_for(UserFactory())
    strict = _booked(client, node, require_nvlink=True)  # GPUs 0 and 1
    _stopped(strict["id"])
    holder = book(UserFactory(), node, 1)
    assert gpu_indices(holder) == [0]  # its GPU 0 taken: 1, 2 and 3 free, 2 and 3 one island
    r = client.post(f"/api/v1/instances/{strict['id']}/start/")
    assert r.status_code == 202, r.content[:300]
    assert (r.json()["gpus"], r.json()["gpus_on_one_nvlink_island"]) == ([2, 3], True)
    assert Job.objects.filter(instance_id=strict["id"], kind=JobKind.INSTANCE_START).exists()

    other = islands_node(nvlink=PAIRS, gpu_count=4)
    loose = _booked(client, other)
    _stopped(loose["id"])
    _split(other)
    r = client.post(f"/api/v1/instances/{loose['id']}/start/")
    assert r.status_code == 202, r.content[:300]  # not asked for: across islands, as before, and said
    assert (r.json()["gpus"], r.json()["gpus_on_one_nvlink_island"]) == ([1, 2], False)
    assert_consistent()


def test_its_own_gpus_free_again_start_as_before():
    node = islands_node(nvlink=PAIRS, gpu_count=4)
    client = client_for(UserFactory())
    made = _booked(client, node, require_nvlink=True)
    _stopped(made["id"])
    started = svc.instance_start(instance=Instance.objects.get(pk=made["id"]))
    assert (started.status, gpu_indices(started)) == ("starting", [0, 1])


# The demo's SQLite path ranks in Python (allocation._island_ranked) what PostgreSQL's statement ranks: by index, a
# booking there with require_nvlink on islands [[0, 1], [2, 3]] with GPU 0 rented took 1 and 2 and was refused.
@pytest.mark.parametrize(("islands", "taken", "count", "prefer"), [
    ([[0, 1], [2, 3]], [0], 2, []),
    ([[0, 1], [2, 3]], [1, 2], 2, []),
    ([[0, 1], [2, 3]], [], 1, []),
    ([[0, 1, 2], [3, 4, 5]], [0, 3], 2, [4, 1]),
    ([[0, 1, 2], [3, 4, 5]], [3], 3, [0, 4, 5]),
    ([[0, 1], [2, 3]], [0, 3], 2, [1, 2]),
    ([[2, 3]], [3], 2, [0]),
    ([[0, 1, 2, 3], [4, 5]], [1, 4], 2, [5]),
])
def test_the_python_ranking_takes_what_the_statement_takes(islands, taken, count, prefer):
    node = islands_node(nvlink={**PAIRS, "islands": islands}, gpu_count=6)
    Gpu.objects.filter(node=node, index__in=taken).update(status=GpuStatus.RENTED)
    ids = dict(Gpu.objects.filter(node=node).values_list("index", "pk"))
    free = list(Gpu.objects.filter(node=node, status=GpuStatus.FREE))
    for want in ([], [ids[i] for i in prefer]):
        with transaction.atomic():
            by_sql = [g.index for g in allocation._lock_free_gpus(node.pk, count, prefer=want, islands=islands)]
        island_of = allocation.island_of_index(islands)
        by_python = sorted(g.index for g in allocation._island_ranked(free, island_of, count, want))
        assert by_python == by_sql, (want, by_sql, by_python)


def test_a_booking_on_the_sqlite_path_takes_a_whole_free_island(monkeypatch):
    node = islands_node(nvlink=PAIRS, gpu_count=4)
    book(UserFactory(), node, 1)  # GPU 0 (or 3): an island stays whole
    held = {i for inst in Instance.objects.all() for i in gpu_indices(inst)}
    monkeypatch.setattr(type(connections["default"]), "vendor", "sqlite")
    made = book(UserFactory(), node, 2, require_nvlink=True)
    monkeypatch.undo()
    got = set(gpu_indices(made))
    assert got in ({0, 1}, {2, 3}) and not got & held, got  # before: by index, 1 and 2 (then refused, 409)
