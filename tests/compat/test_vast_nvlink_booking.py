"""`vastai create instance` of an offer listed as NVLink never gets GPUs of different NVLink islands.

Vast's search carries the NVLink filter (`bw_nvlink`), its create nothing of it: PUT /asks/ID/ booked without
require_nvlink. So an offer listed with bw_nvlink 230 whose booking met another booking in flight (holding one GPU of
each island) got a GPU of each island, 21 GB/s over PCIe. Now an offer listed as NVLink at the booking is booked
with require_nvlink: one island, or a 409 in Vast's error body that says why; the instance remembers it, so its
start does too. An offer listed with bw_nvlink 0 still books across islands, and its answer says so (`msg`).
"""
import threading

import pytest
from django.db import connection, transaction

from marketplace.models import Gpu, GpuStatus, Instance
from marketplace.services import instances as svc
from tests.factories import UserFactory
from tests.marketplace.renting_helpers import add_key, book, gpu_indices, run
from tests.marketplace.test_renting_nvlink import islands_node

from .test_api import V0, msg

PAIRS = {"connected": True, "islands": [[0, 1], [2, 3]], "links_per_gpu": 12, "p2p_gbs": 230.0,
         "pcie_p2p_gbs": 21.0}
VAST_DEFAULTS = {"verified": {"eq": True}, "external": {"eq": False}, "rentable": {"eq": True},
                 "order": [["score", "desc"]], "type": "on-demand", "allocated_storage": 5.0}


def _create(client, ask_id):
    return client.put(f"{V0}/asks/{ask_id}/", {"client_id": "me", "image": "cuda-12-4", "disk": 20.0, "env": {},
                                               "runtype": "ssh", "label": None}, format="json")


def _bw_nvlink(client, node) -> dict[int, float]:
    r = client.post(f"{V0}/bundles/", VAST_DEFAULTS, format="json")
    assert r.status_code == 200, r.content[:300]
    return {o["num_gpus"]: o.get("bw_nvlink") for o in r.json()["offers"] if o["machine_id"] == node.pk}


def _renter(client_for):
    user = UserFactory()
    add_key(user)
    return client_for(user)


@pytest.mark.django_db(transaction=True)
def test_an_nvlink_offer_booked_while_another_booking_holds_a_gpu_of_each_island_is_refused(client_for, anon):
    node = islands_node(nvlink=PAIRS, gpu_count=4)
    assert _bw_nvlink(anon, node) == {1: 230.0, 2: 230.0, 3: 0.0, 4: 0.0}
    client, ask = _renter(client_for), node.pk * 100 + 2
    holding, done = threading.Event(), threading.Event()

    def another_booking():  # holds GPUs 1 and 3 as a booking in flight does (FOR UPDATE, not committed)
        try:
            with transaction.atomic():
                list(Gpu.objects.select_for_update().filter(node=node, index__in=[1, 3]))
                holding.set()
                done.wait(30)
        finally:
            connection.close()

    holder = threading.Thread(target=another_booking)
    holder.start()
    try:
        assert holding.wait(10)
        r = _create(client, ask)
    finally:
        done.set()
        holder.join(30)
    # Before: 200, and the instance held GPUs 0 and 2 (SKIP LOCKED passed over 1): one of each island.
    assert r.status_code == 409, (r.status_code, r.content[:300], [gpu_indices(i) for i in Instance.objects.all()])
    body = r.json()
    assert (body["success"], body["error"]) == (False, "conflict")
    assert f"Offer {ask} was listed with bw_nvlink 230 GB/s" in msg(r) and "none was booked across" in msg(r)
    assert not Instance.objects.exists()
    assert Gpu.objects.filter(node=node, status=GpuStatus.FREE).count() == 4  # rolled back
    # The other booking gone: the same create gets one island, and the instance remembers it was asked for.
    r = _create(client, ask)
    assert r.status_code == 200, r.content[:300]
    instance = Instance.objects.get(pk=r.json()["new_contract"])
    assert (gpu_indices(instance), instance.require_nvlink) == ([0, 1], True)
    assert "msg" not in r.json()


@pytest.mark.django_db
def test_an_offer_listed_with_bw_nvlink_0_books_across_islands_and_says_so(client_for, anon):
    node = islands_node(nvlink=PAIRS, gpu_count=4)
    client, ask = _renter(client_for), node.pk * 100 + 2
    assert _bw_nvlink(anon, node)[2] == 230.0  # what the renter saw
    singles = [book(UserFactory(), node, 1) for _ in range(4)]
    for inst in singles:  # meanwhile the island broke up: GPUs 1 and 2 free, one of each island
        if gpu_indices(inst) in ([1], [2]):
            svc.instance_destroy(instance=Instance.objects.get(pk=inst.pk))
            svc.instance_mark_destroyed(instance_id=inst.pk)
    assert _bw_nvlink(anon, node) == {1: 230.0, 2: 0.0}  # what a search shows now
    r = _create(client, ask)
    assert r.status_code == 200, r.content[:300]
    instance = Instance.objects.get(pk=r.json()["new_contract"])
    assert (gpu_indices(instance), instance.require_nvlink) == ([1, 2], False)
    # Before: {"success": true, "new_contract": N} only: nothing said the GPUs were joined over PCIe.
    said = r.json().get("msg", "")
    assert "different NVLink islands" in said and f"offer {ask} is listed with bw_nvlink 0" in said, r.json()


@pytest.mark.django_db
def test_a_vast_start_of_an_nvlink_booking_keeps_it_on_one_island_or_is_refused(client_for, anon):
    node = islands_node(nvlink=PAIRS, gpu_count=4)
    client, ask = _renter(client_for), node.pk * 100 + 2
    r = _create(client, ask)
    assert r.status_code == 200, r.content[:300]
    contract = r.json()["new_contract"]
    run(Instance.objects.get(pk=contract))
    svc.instance_stop(instance=Instance.objects.get(pk=contract))
    svc.instance_mark_stopped(instance_id=contract)
    singles = [book(UserFactory(), node, 1) for _ in range(4)]
    for inst in singles:
        if gpu_indices(inst) in ([1], [2]):
            svc.instance_destroy(instance=Instance.objects.get(pk=inst.pk))
            svc.instance_mark_destroyed(instance_id=inst.pk)
    r = client.put(f"{V0}/instances/{contract}/", {"state": "running"}, format="json")
    assert r.status_code == 409, r.content[:300]
    assert r.json()["success"] is False and "require_nvlink" in msg(r) and "at most 1 do" in msg(r)
    assert Instance.objects.get(pk=contract).status == "stopped"
