"""A failed instance whose VM the platform knows is gone from its node (Instance.vm_gone) holds nothing there.

Found by review: a failed instance that ran kept its disk room on the node (OVER_DISK_KEPT, disk_room's SQL, the
offers' disk_left_gb) and the volumes it mounted (volumes._failed_vm_kept) until its renter destroyed it by hand,
even when its VM was known gone (the node said so, or was retired): other renters were refused the node's disk, and
the renter's own volume could be neither mounted elsewhere nor deleted. Now such an instance frees both at once;
one whose VM may still be there (the renter's data on it) holds them as before. The renter still sees it (and may
destroy it), with `vm_gone` saying its disk is released."""
from datetime import timedelta

import pytest
from django.db import transaction
from django.test import Client
from django.utils import timezone

from core.errors import Conflict
from marketplace.models import Instance, InstanceStatus, Node, Volume, VolumeState
from marketplace.selectors import disk_left_gb, offers_search
from marketplace.services import instances as svc
from marketplace.services import volumes as volume_svc
from marketplace.services.disk_room import DiskDoesNotFit, node_disk_room
from marketplace.services.instances.allocation import _lock_node_for_booking
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book, run, sent_jobs_fixture  # noqa: F401 (the sent_jobs fixture)
from tests.marketplace.test_volumes import available
from tests.marketplace.test_volumes import book as book_by_api

pytestmark = pytest.mark.django_db


def _node(**kwargs):
    node = make_listed_node(gpu_count=4, **kwargs)
    node.disk_free_gb, node.disk_total_gb, node.host_checked_at = 100, 100, timezone.now() - timedelta(hours=1)
    node.save()
    return node


def _left(node) -> tuple[int, int, int, int]:
    """The room left as each form computes it: the ORM's, the booking statement's, the annotation, the offers'."""
    room = node_disk_room(Node.objects.get(pk=node.pk))
    with transaction.atomic():
        booking = _lock_node_for_booking(node.pk, count_gpus=True).disk_room
    shown = Node.objects.filter(pk=node.pk).annotate(left=disk_left_gb()).get().left
    offered = offers_search().get(pk=node.pk).disk_left_gb
    return room.left_gb, booking.left_gb, shown, offered


def test_a_failed_instance_whose_vm_is_gone_frees_its_disk_room_for_the_next_booking(sent_jobs):  # noqa: F811
    node = _node()
    instance = run(book(UserFactory(), node, disk_gb=70))
    svc.instance_mark_failed(instance_id=instance.pk, message="its VM vanished", vm_gone=True)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.FAILED and instance.started_at is not None and instance.vm_gone
    assert _left(node) == (100, 100, 100, 100)  # before: (30, 30, 30, 30) until its renter destroyed it
    assert book(UserFactory(), node, disk_gb=80).status == InstanceStatus.REQUESTED


def test_a_failed_instance_whose_vm_may_be_there_still_holds_its_disk_room(sent_jobs):  # noqa: F811
    node = _node()
    instance = run(book(UserFactory(), node, disk_gb=70))
    svc.instance_mark_failed(instance_id=instance.pk, message="its container exited")  # VM kept, stopped
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.FAILED and not instance.vm_gone
    assert _left(node) == (30, 30, 30, 30)
    with pytest.raises(DiskDoesNotFit):
        book(UserFactory(), node, disk_gb=80)
    # Known gone later (the reconciler: the node no longer lists it), it lets go.
    assert svc.instance_vm_gone(instance_id=instance.pk) is True
    assert svc.instance_vm_gone(instance_id=instance.pk) is False  # once
    assert _left(node) == (100, 100, 100, 100)


def test_a_failed_instance_with_its_vm_still_to_be_removed_is_not_marked_gone(sent_jobs):  # noqa: F811
    """`cleanup_pending` (the node did not confirm the VM gone) wins over `vm_gone`: its disk stays counted."""
    node = _node()
    instance = book(UserFactory(), node, disk_gb=70)
    svc.instance_mark_failed(instance_id=instance.pk, message="unreachable", cleanup_pending=True, vm_gone=True)
    instance.refresh_from_db()
    assert instance.vm_cleanup_pending and not instance.vm_gone
    assert _left(node) == (30, 30, 30, 30)


def test_only_a_failed_instance_is_marked_gone(sent_jobs):  # noqa: F811
    node = _node()
    instance = run(book(UserFactory(), node, disk_gb=40))
    assert svc.instance_vm_gone(instance_id=instance.pk) is False
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.RUNNING and not instance.vm_gone


def _failed_with_volume(api, node, *, vm_gone: bool) -> tuple[Instance, Volume]:
    volume = available(api, node, size_gb=5)
    r = book_by_api(api, node, [{"volume": volume.pk, "mount": "/data"}])
    assert r.status_code == 201, r.content
    instance = run(Instance.objects.get(pk=r.json()["id"]))
    svc.instance_mark_failed(instance_id=instance.pk, message="failed", vm_gone=vm_gone)
    return Instance.objects.get(pk=instance.pk), Volume.objects.get(pk=volume.pk)


def test_a_failed_instance_whose_vm_is_gone_lets_its_volume_be_mounted_by_another_instance(api, sent_jobs):  # noqa: F811
    node = _node()
    failed, volume = _failed_with_volume(api, node, vm_gone=True)
    assert volume_svc.volume_holder_ids(volume) == []  # before: [failed.pk] until it was destroyed
    r = book_by_api(api, node, [{"volume": volume.pk, "mount": "/data"}])
    assert r.status_code == 201, r.content  # before: 409, the failed instance mounts it
    second = r.json()["id"]
    assert volume_svc.volume_holder_ids(Volume.objects.get(pk=volume.pk)) == [second]
    # Its renter still sees the failed instance, and that its disk is released; they may destroy it.
    body = api.get(f"/api/v1/instances/{failed.pk}/").json()
    assert body["status"] == "failed" and body["vm_gone"] is True
    assert 'id="vm-gone"' in _page(api, failed)
    assert api.delete(f"/api/v1/instances/{failed.pk}/").status_code == 202
    assert volume_svc.volume_holder_ids(Volume.objects.get(pk=volume.pk)) == [second]  # not taken back


def test_a_failed_instance_whose_vm_is_gone_lets_its_volume_be_deleted(api, sent_jobs):  # noqa: F811
    node = _node()
    failed, volume = _failed_with_volume(api, node, vm_gone=True)
    volume_svc.volume_delete(volume=volume, confirm=volume.name)  # before: Conflict, "destroy the instance first"
    assert Volume.objects.get(pk=volume.pk).state == VolumeState.DELETING


def test_a_failed_instance_whose_vm_may_be_there_still_holds_its_volume(api, sent_jobs):  # noqa: F811
    node = _node()
    failed, volume = _failed_with_volume(api, node, vm_gone=False)
    assert volume_svc.volume_holder_ids(volume) == [failed.pk]
    r = book_by_api(api, node, [{"volume": volume.pk, "mount": "/data"}])
    assert r.status_code == 409, r.content
    with pytest.raises(Conflict, match="destroy the instance first"):
        volume_svc.volume_delete(volume=volume, confirm=volume.name)
    assert api.get(f"/api/v1/instances/{failed.pk}/").json()["vm_gone"] is False
    assert 'id="vm-gone"' not in _page(api, failed)


def _page(api, instance) -> str:
    web = Client()
    web.force_login(api.user)
    r = web.get(f"/instances/{instance.pk}/")
    assert r.status_code == 200
    return r.content.decode()
