"""r46c review, persistent volumes: a failed instance whose VM is still on its node holds its volumes.

The node's agent counts every VM record it has as mounting the volume: a failed instance's VM (stopped, or its record
kept) refused the volume's delete on the node, and a second instance mounted the volume beside it. The platform let
the volume go as soon as the instance failed: a delete was accepted (202, "billing stopped"), refused by the node and
billed again from the request; and a second booking mounted it (two VM records on one volume). Now a failed instance
that ran holds its volumes until it is destroyed (its destroy job removes the VM); one that never ran does not (its
VM went with its failure). A later mount means the earlier ones were let go: destroying the failed instance after
does not bring its mount back (two live mounts). And a delete the node refuses is billed again from the refusal, not
across the time the renter was told billing had stopped."""
from datetime import timedelta

import pytest

from billing.services.storage import storage_meter
from core.errors import Conflict
from marketplace.models import Instance, InstanceStatus, Volume, VolumeState
from marketplace.services import instances as instance_svc
from marketplace.services import volumes as volume_svc
from provisioning import tasks
from provisioning.models import Job, JobKind
from tests.billing.conftest import clock  # noqa: F401
from tests.billing.helpers import fund, node
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book, ed25519_key
from tests.provisioning.test_vm_vanished import docker_node, node_with_one_gpu, run_job  # noqa: F401

pytestmark = pytest.mark.django_db


def _volume_on(node, renter):
    volume = volume_svc.volume_create(owner=renter, node_id=node.pk, size_gb=1)
    run_job(tasks.volume_create, None, JobKind.VOLUME_CREATE, volume=volume)
    return Volume.objects.get(pk=volume.pk)


def _failed_after_a_stop(node, renter, volume):
    """An instance that ran with the volume, stopped (its VM kept, stopped, on the node), then failed."""
    instance = run_job(tasks.instance_provision, book(renter, node, volumes=[{"volume": volume.pk, "mount": "/data"}]),
                       JobKind.INSTANCE_PROVISION)
    assert instance.status == InstanceStatus.RUNNING, instance.status_message
    instance_svc.instance_stop(instance=instance)
    run_job(tasks.instance_stop, instance, JobKind.INSTANCE_STOP)
    instance_svc.instance_mark_failed(instance_id=instance.pk, message="failed for another reason")
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.FAILED and not instance.vm_cleanup_pending
    return instance


def _users_on_node(docker_node, node, volume):  # noqa: F811
    listed = docker_node.session(node).agent("volume", "list", {})
    return [v["used_by"] for v in listed["volumes"] if v["name"] == volume.name][0]


def test_a_volume_whose_failed_instances_vm_is_on_the_node_is_not_deleted_until_the_instance_is(docker_node):  # noqa: F811
    """Before: the delete was taken (billing closed), the node refused it (mounted by VM inst-N) and the volume was
    available again, billed from the request."""
    node = node_with_one_gpu()
    renter = UserFactory()
    volume = _volume_on(node, renter)
    instance = _failed_after_a_stop(node, renter, volume)
    with pytest.raises(Conflict, match=f"instance {instance.pk} failed.*destroy the instance first"):
        volume_svc.volume_delete(volume=Volume.objects.get(pk=volume.pk), confirm=volume.name)
    volume.refresh_from_db()
    assert volume.state == VolumeState.AVAILABLE and volume.deleted_at is None
    assert not Job.objects.filter(volume=volume, kind=JobKind.VOLUME_DELETE).exists()
    assert volume_svc.volume_live_instance_ids(volume_svc.volume_for_user(user=renter, volume_id=volume.pk)) \
        == [instance.pk]  # what the API's in_use_by and the volumes page show

    # Destroyed, its VM is confirmed gone: the volume is free, and its delete goes through on the node.
    instance_svc.instance_destroy(instance=instance)
    assert run_job(tasks.instance_destroy, instance, JobKind.INSTANCE_DESTROY).status == InstanceStatus.DESTROYED
    volume_svc.volume_delete(volume=Volume.objects.get(pk=volume.pk), confirm=volume.name)
    run_job(tasks.volume_delete, None, JobKind.VOLUME_DELETE, volume=volume)
    volume.refresh_from_db()
    assert volume.state == VolumeState.DELETED, (volume.state, volume.status_message)


def test_a_volume_whose_failed_instances_vm_still_mounts_it_is_not_mounted_again(docker_node):  # noqa: F811
    """Before: the second booking was taken and the node's `volume list` said used_by ['inst-1', 'inst-2']."""
    node = node_with_one_gpu()
    renter = UserFactory()
    volume = _volume_on(node, renter)
    failed = _failed_after_a_stop(node, renter, volume)
    with pytest.raises(Conflict, match=f"instance {failed.pk} failed.*destroy the instance first"):
        book(renter, node, volumes=[{"volume": volume.pk, "mount": "/data"}])
    assert _users_on_node(docker_node, node, volume) == [failed.vm_id]

    instance_svc.instance_destroy(instance=failed)
    assert run_job(tasks.instance_destroy, failed, JobKind.INSTANCE_DESTROY).status == InstanceStatus.DESTROYED
    second = run_job(tasks.instance_provision, book(renter, node, volumes=[{"volume": volume.pk, "mount": "/data"}]),
                     JobKind.INSTANCE_PROVISION)
    assert second.status == InstanceStatus.RUNNING, second.status_message
    assert _users_on_node(docker_node, node, volume) == [second.vm_id]


def _book_api(client, node, volumes):
    return client.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "pytorch-2-5",
                                              "ssh_public_key": ed25519_key(), "volumes": volumes}, format="json")


def test_a_failed_instance_that_never_ran_lets_its_volume_go_and_its_destroy_does_not_take_it_back(api):
    """A failed instance whose VM is gone (it never ran: its provisioning failed, and the VM went with it) holds its
    volume no more, as before: it is mounted again. Before, the renter's destroy of the failed instance then made
    both mounts live (`in_use_by` [a, b]); a later mount now means the earlier one was let go for good."""
    node = make_listed_node(gpu_count=2)
    r = api.post("/api/v1/volumes/", {"offer": node.pk, "size_gb": 10}, format="json")
    assert r.status_code == 201, r.content
    volume = volume_svc.volume_mark_available(volume_id=r.json()["id"])
    first = _book_api(api, node, [{"volume": volume.pk, "mount": "/data"}])
    assert first.status_code == 201, first.content
    a = first.json()["id"]
    instance_svc.instance_mark_failed(instance_id=a, message="gone")
    Job.objects.filter(instance_id=a).update(status="succeeded", finished_at=Instance.objects.get(pk=a).created_at)
    assert Instance.objects.get(pk=a).started_at is None
    assert api.get(f"/api/v1/volumes/{volume.pk}/").json()["in_use_by"] == []
    second = _book_api(api, node, [{"volume": volume.pk, "mount": "/data"}])
    assert second.status_code == 201, second.content
    b = second.json()["id"]
    assert api.delete(f"/api/v1/instances/{a}/", format="json").status_code in (200, 202)
    assert Instance.objects.get(pk=a).status == InstanceStatus.DESTROYING
    live = volume_svc.volume_live_instance_ids(volume_svc.volume_for_user(user=volume.owner, volume_id=volume.pk))
    assert live == [b]
    assert api.get(f"/api/v1/volumes/{volume.pk}/").json()["in_use_by"] == [b]
    third = _book_api(api, node, [{"volume": volume.pk, "mount": "/data"}])
    assert third.status_code == 409 and f"instance {b}" in third.json()["detail"], third.content
    r = api.delete(f"/api/v1/volumes/{volume.pk}/", {"confirm": volume.name}, format="json")
    assert r.status_code == 409 and str(b) in r.json()["detail"], r.content


def test_a_failed_instance_that_never_ran_does_not_hold_its_volume_from_a_delete(api):
    node = make_listed_node(gpu_count=1)
    r = api.post("/api/v1/volumes/", {"offer": node.pk, "size_gb": 10}, format="json")
    volume = volume_svc.volume_mark_available(volume_id=r.json()["id"])
    a = _book_api(api, node, [{"volume": volume.pk, "mount": "/data"}]).json()["id"]
    instance_svc.instance_mark_failed(instance_id=a, message="the image could not be pulled")
    r = api.delete(f"/api/v1/volumes/{volume.pk}/", {"confirm": volume.name}, format="json")
    assert r.status_code == 202 and r.json()["state"] == "deleting", r.content


def test_a_delete_the_node_refuses_is_billed_again_from_the_refusal_not_from_the_request(clock, user):  # noqa: F811
    """The platform took the deletion (202, billing stopped) and the node refused it: the renter is not charged for
    the time between. Before, billing resumed from the request."""
    fund(user, "10")
    volume = volume_svc.volume_mark_available(
        volume_id=volume_svc.volume_create(owner=user, node_id=node().pk, size_gb=10).pk)
    clock.advance(600)
    volume_svc.volume_delete(volume=volume, confirm=volume.name)
    clock.advance(7200)
    volume_svc.volume_delete_refused(volume_id=volume.pk, message="its node says: mounted by VM inst-9")
    storage_meter(now=clock.now)
    volume.refresh_from_db()
    assert volume.state == VolumeState.AVAILABLE and volume.billed_seconds == 600
    clock.advance(60)
    storage_meter(now=clock.now)
    volume.refresh_from_db()
    assert volume.billed_seconds == 660
    assert volume.billed_until == clock.now
    assert clock.now - timedelta(seconds=60) > volume.available_at
