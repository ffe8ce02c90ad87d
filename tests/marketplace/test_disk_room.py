"""The room left on a node's disk (marketplace.services.disk_room): what its server reported free, less the
instance disks and volumes promised there since. Before, a booking never looked (an instance disk could be
promised beyond the server's free space) and a volume counted only the volumes."""
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from marketplace.models import Node
from marketplace.selectors import disk_left_gb
from marketplace.services import instances as svc
from marketplace.services import volumes as volume_svc
from marketplace.services.disk_room import DiskDoesNotFit, node_disk_room
from marketplace.services.instances.allocation import _lock_node_for_booking
from tests.factories import make_listed_node

from .renting_helpers import add_key, book, sent_jobs_fixture, snapshot  # noqa: F401 (the sent_jobs fixture)

pytestmark = pytest.mark.django_db


def _node(free_gb=200, reported_ago=timedelta(hours=1), **kwargs):
    node = make_listed_node(gpu_count=4, **kwargs)
    node.disk_free_gb, node.host_checked_at = free_gb, timezone.now() - reported_ago
    node.save()
    return node


def _book(api, node, disk_gb):
    key = api.user.ssh_keys.first() or add_key(api.user)
    return api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "pytorch-2-5",
                                           "ssh_keys": [key.pk], "disk_gb": disk_gb}, format="json")


def _gone(instance):
    """Destroyed on its node (while it is being destroyed, its disk is still there: it counts)."""
    svc.instance_destroy(instance=instance)
    assert node_disk_room(Node.objects.get(pk=instance.node_id)).promised_gb >= instance.disk_gb
    svc.instance_mark_destroyed(instance_id=instance.pk)


def test_a_booking_whose_disk_does_not_fit_is_refused_naming_the_room_left(api, user):
    node = _node(free_gb=200)
    refused = _book(api, node, 250)
    assert refused.status_code == 409, refused.content
    assert "reported 200 GB of free disk" in refused.json()["detail"] and "disk_gb" in refused.json()["detail"]
    assert _book(api, node, 120).status_code == 201
    before = snapshot(node)
    again = _book(api, node, 100)  # the 120 GB promised since the report count: 80 GB are left
    assert again.status_code == 409, again.content
    assert "less 120 GB promised to instances and volumes there since: 80 GB are left" in again.json()["detail"]
    assert snapshot(node) == before  # nothing written
    assert _book(api, node, 80).status_code == 201


def test_instance_disks_and_volumes_share_the_room(api, user):
    node = _node(free_gb=200)
    assert _book(api, node, 150).status_code == 201
    volume = api.post("/api/v1/volumes/", {"offer": node.pk, "size_gb": 60}, format="json")
    assert volume.status_code == 409 and "50 GB are left" in volume.json()["detail"], volume.content
    assert api.post("/api/v1/volumes/", {"offer": node.pk, "size_gb": 50}, format="json").status_code == 201
    assert _book(api, node, 50).status_code == 409


def test_what_is_over_or_came_before_the_report_does_not_count(user):
    node = _node(free_gb=200)
    old = book(user, node, disk_gb=100)
    node.host_checked_at = timezone.now() + timedelta(seconds=1)  # reported after it: already counted
    node.save()
    new = book(user, node, disk_gb=70)
    Node.objects.filter(pk=node.pk).update(host_checked_at=old.created_at + timedelta(microseconds=1))
    assert node_disk_room(Node.objects.get(pk=node.pk)).promised_gb == 70
    _gone(new)
    assert node_disk_room(Node.objects.get(pk=node.pk)).promised_gb == 0


def test_a_node_that_never_reported_its_disk_is_not_judged(api, user):
    node = _node(free_gb=None)
    assert node_disk_room(node) is None
    assert _book(api, node, 500).status_code == 201


def _offer_room(node_id):
    """The offers' annotation (selectors.disk_left_gb) for one node, listed or not."""
    return Node.objects.annotate(left=disk_left_gb()).values_list("left", flat=True).get(pk=node_id)


def test_the_booking_statements_room_is_the_services(user):
    """Three forms of one rule: the column the booking's node statement computes, the ORM's (volumes) and the
    offers' annotation."""
    node = _node(free_gb=1000)
    book(user, node, disk_gb=100)
    book(user, node, disk_gb=40)
    volume_svc.volume_create(owner=user, node_id=node.pk, size_gb=30)
    _gone(book(user, node, disk_gb=300))
    for reported_ago, size in ((timedelta(hours=1), None), (timedelta(0), None), (timedelta(hours=1), 1200),
                               (timedelta(0), 1200), (timedelta(0), 1100)):  # all since, none since; sizes
        Node.objects.filter(pk=node.pk).update(host_checked_at=timezone.now() - reported_ago, disk_total_gb=size)
        with transaction.atomic():
            locked = _lock_node_for_booking(node.pk, count_gpus=True)
        assert locked.disk_room == node_disk_room(Node.objects.get(pk=node.pk))
        assert _offer_room(node.pk) == locked.disk_room.left_gb
    assert (locked.disk_room.promised_gb, locked.disk_room.promised_all_gb, locked.disk_room.left_gb) == (0, 170, 930)
    Node.objects.filter(pk=node.pk).update(host_checked_at=None, disk_total_gb=None)  # never dated: all live counts
    with transaction.atomic():
        locked = _lock_node_for_booking(node.pk, count_gpus=True)
    assert locked.disk_room == node_disk_room(Node.objects.get(pk=node.pk))
    assert locked.disk_room.promised_gb == 170 and _offer_room(node.pk) == 1000 - 170
    Node.objects.filter(pk=node.pk).update(disk_free_gb=100)  # less than promised (a disk filled since): 0, not < 0
    assert _offer_room(node.pk) == 0 and node_disk_room(Node.objects.get(pk=node.pk)).left_gb == 0
    Node.objects.filter(pk=node.pk).update(disk_free_gb=None)
    assert _offer_room(node.pk) is None and node_disk_room(Node.objects.get(pk=node.pk)) is None


def _three_nodes(user):
    """300 GB left of 1000 reported, 500 left of 500, and a node that never reported its disk."""
    booked, free, unread = _node(free_gb=1000), _node(free_gb=500), _node(free_gb=None)
    book(user, booked, disk_gb=700)
    return booked, free, unread


def test_offers_show_filter_and_order_the_room_left_not_the_reported_free_disk(anon, user):
    """An offer listed for `min_disk_free_gb=400` was then refused a 400 GB disk: the offers showed the reported
    free disk, the booking judged the room left."""
    booked, free, unread = _three_nodes(user)
    shown = {o["id"]: o["disk_free_gb"] for o in anon.get("/api/v1/offers/").json()["results"]}
    assert shown == {booked.pk: 300, free.pk: 500, unread.pk: None}
    assert anon.get(f"/api/v1/offers/{booked.pk}/").json()["disk_free_gb"] == 300
    assert [o["id"] for o in anon.get("/api/v1/offers/?min_disk_free_gb=400").json()["results"]] == [free.pk]
    assert [o["id"] for o in anon.get("/api/v1/offers/?min_disk_free_gb=300").json()["results"]] in (
        [booked.pk, free.pk], [free.pk, booked.pk])
    ordered = anon.get("/api/v1/offers/?ordering=-disk_free_gb").json()["results"]
    assert [o["id"] for o in ordered] == [free.pk, booked.pk, unread.pk]  # unknown last
    ordered = anon.get("/api/v1/offers/?ordering=disk_free_gb").json()["results"]
    assert [o["id"] for o in ordered] == [booked.pk, free.pk, unread.pk]


def test_vast_search_shows_and_filters_the_room_left_and_its_refusal_speaks_vasts_words(anon, api, user):
    booked, free, _ = _three_nodes(user)
    bundles = "/compat/vast/api/v0/bundles/"
    rows = anon.post(bundles, {"order": [["disk_space", "desc"]], "num_gpus": {"eq": 1}}, format="json").json()
    spaces = [(o["machine_id"], o.get("disk_space")) for o in rows["offers"]]
    assert spaces[:2] == [(free.pk, 500.0), (booked.pk, 300.0)]
    rows = anon.post(bundles, {"disk_space": {"gte": 400}}, format="json").json()["offers"]
    assert {o["machine_id"] for o in rows} == {free.pk}
    add_key(api.user)
    ask = booked.pk * 100 + 1
    refused = api.put(f"/compat/vast/api/v0/asks/{ask}/", {"image": "cuda-12-4", "disk": 400, "runtype": "ssh"},
                      format="json")
    assert refused.status_code == 409, refused.content
    assert refused.json()["msg"] == (
        f"Offer {ask}'s machine reported 1000 GB of free disk, less 700 GB promised to instances and volumes there "
        "since: 300 GB are left; an instance disk of 400 GB does not fit. Ask for less disk (--disk), or take "
        "another offer from `vastai search offers` (its disk_space is the room left).")
    too_small = api.put(f"/compat/vast/api/v0/asks/{ask}/", {"image": "cuda-12-4", "disk": 5, "runtype": "ssh"},
                        format="json")
    assert too_small.status_code == 400 and "needs 20 to" in too_small.json()["msg"]
    assert api.put(f"/compat/vast/api/v0/asks/{ask}/", {"image": "cuda-12-4", "disk": 300, "runtype": "ssh"},
                   format="json").status_code == 200


def _too_early_then_found(monkeypatch, module, name):
    """The key's first look finds nothing (made before the original committed); later looks are the real one."""
    looks, look = [], getattr(module, name)

    def lookup(**kwargs):
        looks.append(kwargs)
        return None if len(looks) == 1 else look(**kwargs)

    monkeypatch.setattr(module, name, lookup)
    return looks


def test_a_retry_that_looked_before_its_original_committed_gets_it_not_the_disk_409(user, monkeypatch):
    """A retry with the original's Idempotency-Key whose look came before the original's commit was refused
    against the original's own disk (a 409, checked before the key's unique index could answer it); the same for
    a volume. Both answer with what the original made (core.idempotency.create_once)."""
    from marketplace.services.instances import booking

    node = _node(free_gb=200)
    first = book(user, node, disk_gb=150, idempotency_key="once", request_fingerprint="f")
    looks = _too_early_then_found(monkeypatch, booking, "instance_for_idempotency_key")
    again, created = svc.instance_create(renter=user, node_id=node.pk, num_gpus=1, image=first.image,
                                         ssh_public_keys=first.ssh_public_keys, disk_gb=150,
                                         idempotency_key="once", request_fingerprint="f")
    assert (again.pk, created, len(looks)) == (first.pk, False, 2)

    volume, made = volume_svc.volume_create_once(owner=user, node_id=node.pk, size_gb=50, idempotency_key="v",
                                                 request_fingerprint="g")
    looks = _too_early_then_found(monkeypatch, volume_svc, "volume_for_idempotency_key")
    same, made_again = volume_svc.volume_create_once(owner=user, node_id=node.pk, size_gb=50, idempotency_key="v",
                                                     request_fingerprint="g")
    assert made and (same.pk, made_again, len(looks)) == (volume.pk, False, 2)
    with pytest.raises(DiskDoesNotFit):  # without the key: the disk's own answer
        volume_svc.volume_create_once(owner=user, node_id=node.pk, size_gb=50)


def test_the_disks_size_bounds_what_reports_of_free_space_let_grow(api, user):
    """A disk takes its room as it fills: a report after a booking still counted its empty disk as free, and the
    promises grew past the disk's size, report after report. The size (disk_total_gb) bounds them: every live disk
    and volume counts against it, whenever promised."""
    node = _node(free_gb=1000)
    Node.objects.filter(pk=node.pk).update(disk_total_gb=1200)
    assert _book(api, node, 300).status_code == 201
    Node.objects.filter(pk=node.pk).update(host_checked_at=timezone.now())  # reported again: still 1000 GB free
    room = node_disk_room(Node.objects.get(pk=node.pk))
    assert (room.left_gb, room.by_size) == (900, True) and _offer_room(node.pk) == 900
    with transaction.atomic():
        assert _lock_node_for_booking(node.pk, count_gpus=True).disk_room == room
    refused = _book(api, node, 901)
    assert refused.status_code == 409, refused.content
    assert refused.json()["detail"] == (
        f"Offer {node.pk}'s server has a 1200 GB disk, and 300 GB of it are promised to instances and volumes there: "
        "900 GB are left; an instance disk of 901 GB does not fit. Ask for less disk (disk_gb), or rent another offer.")
    volume = api.post("/api/v1/volumes/", {"offer": node.pk, "size_gb": 901}, format="json")
    assert volume.status_code == 409 and "900 GB are left" in volume.json()["detail"], volume.content
    assert _book(api, node, 900).status_code == 201
    assert _offer_room(node.pk) == 0
    assert api.post("/api/v1/volumes/", {"offer": node.pk, "size_gb": 1}, format="json").status_code == 409
    Node.objects.filter(pk=node.pk).update(disk_total_gb=None)  # its size never reported: the free space alone
    assert _offer_room(node.pk) == 100 and node_disk_room(Node.objects.get(pk=node.pk)).left_gb == 100


def test_a_disk_booked_while_the_check_ran_counts_against_the_free_space_it_read(user):
    """The host facts were dated at the verdict, minutes after the agent read the free disk: a disk booked in
    between was neither in the free space read nor counted as promised since. They are dated at the job's start."""
    from provisioning.models import Job, JobKind
    from provisioning.services.verification import node_verify_conclude

    node = _node(free_gb=1000, reported_ago=timedelta(days=1))
    started = timezone.now() - timedelta(minutes=5)
    job = Job.objects.create(kind=JobKind.NODE_VERIFY, node=node, status="running", started_at=started,
                             deadline=timezone.now() + timedelta(hours=1))
    during = book(user, node, disk_gb=300)  # after the agent read 1000 GB free, before the verdict
    Node.objects.filter(pk=node.pk).update(score=1.0)
    node_verify_conclude(job=job, verdict="verified", score=1.0, findings=[],
                         inventory={"disk": {"free_gb": 1000, "total_gb": 2000}})
    checked = Node.objects.get(pk=node.pk)
    assert checked.host_checked_at == started and during.created_at > started
    assert node_disk_room(checked).left_gb == 700 and _offer_room(node.pk) == 700


def test_a_volume_being_deleted_holds_its_room_until_its_node_deletes_it(user):
    """As an instance being destroyed does (found by review: a volume in `deleting` counted for nothing)."""
    node = _node(free_gb=200)
    volume = volume_svc.volume_mark_available(volume_id=volume_svc.volume_create(owner=user, node_id=node.pk,
                                                                                 size_gb=50).pk)
    volume_svc.volume_delete(volume=volume, confirm=volume.name)
    assert node_disk_room(Node.objects.get(pk=node.pk)).left_gb == 150 and _offer_room(node.pk) == 150
    with transaction.atomic():
        assert _lock_node_for_booking(node.pk, count_gpus=True).disk_room.left_gb == 150
    volume_svc.volume_mark_deleted(volume_id=volume.pk)
    assert node_disk_room(Node.objects.get(pk=node.pk)).left_gb == 200 and _offer_room(node.pk) == 200
