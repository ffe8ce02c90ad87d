"""Retiring a node, and where a node goes back to from maintenance or offline (marketplace.services.nodes).

A retired server is never checked, reconciled or booked again, so nothing of a renter's may be left on it
unwatched: live instances, stopped ones (their disk) and volumes refuse the retire with what stands in the way; an
unreachable node's interrupted instances end failed (credited) instead, since nothing can bring them back.
"""
from datetime import timedelta

import pytest
from django.utils import timezone

from core.errors import Conflict
from marketplace.models import GpuAllocation, GpuStatus, InstanceStatus, InterruptionCause, NodeState, Verdict
from marketplace.services import instances as svc
from marketplace.services import nodes as node_svc
from notifications.models import Notification
from provisioning.models import NodeEvent
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book, run, sent_jobs_fixture  # noqa: F401 (the sent_jobs fixture)

pytestmark = pytest.mark.django_db


def _retire_refusal(node) -> str:
    with pytest.raises(Conflict) as refused:
        node_svc.node_retire(node=node)
    node.refresh_from_db()
    assert node.state != NodeState.RETIRED
    return refused.value.message


def test_live_and_stopped_instances_refuse_the_retire_naming_them():
    node = make_listed_node(gpu_count=3)
    live = run(book(UserFactory(), node))
    stopped = run(book(UserFactory(), node))
    svc.instance_stop(instance=stopped)
    svc.instance_mark_stopped(instance_id=stopped.pk)
    message = _retire_refusal(node)
    assert "renters' instances are live on it (1 running)" in message
    assert "1 stopped instance keeps a renter's data on it" in message and "Unlist it meanwhile" in message
    svc.instance_mark_failed(instance_id=live.pk, message="gone")
    assert "live on it" not in _retire_refusal(node)
    svc.instance_mark_failed(instance_id=stopped.pk, message="gone")
    node_svc.node_retire(node=node)
    node.refresh_from_db()
    assert node.state == NodeState.RETIRED and not node.listed


def test_a_destroyed_instance_whose_vm_is_still_to_go_refuses_until_the_reconciler_removed_it():
    node = make_listed_node(gpu_count=2)
    ended = run(book(UserFactory(), node))
    svc.instance_mark_failed(instance_id=run(book(UserFactory(), node)).pk, message="gone")  # over, GPUs released
    ended.allocations.update(released_at=None)
    svc.Instance.objects.filter(pk=ended.pk).update(status=InstanceStatus.DESTROYED)
    assert "still removing the VM of 1 destroyed instance" in _retire_refusal(node)
    svc.instance_cleanup_done(instance_id=ended.pk)
    node_svc.node_retire(node=node)


def test_an_unreachable_nodes_interrupted_instances_end_failed_and_credited_with_the_retire():
    node = make_listed_node(gpu_count=2)
    instance = run(book(UserFactory(), node))
    svc.instance_interrupt(instance_id=instance.pk, since=timezone.now() - timedelta(minutes=5),
                           cause=InterruptionCause.NODE_LOST, detail="no answer")
    type(node).objects.filter(pk=node.pk).update(state=NodeState.OFFLINE, health_failures=9)
    node.refresh_from_db()
    node_svc.node_retire(node=node)
    node.refresh_from_db()
    instance.refresh_from_db()
    assert node.state == NodeState.RETIRED
    assert instance.status == InstanceStatus.FAILED and node_svc.RETIRED_WHILE_INTERRUPTED in instance.status_message
    assert not node.gpus.filter(status=GpuStatus.RENTED).exists()
    event = NodeEvent.objects.get(node=node, kind="retired_unreachable")
    assert f"interrupted instance(s) {instance.pk} ended as failed (credited)" in event.message


def test_the_same_interrupted_instance_on_a_reachable_node_refuses_the_retire():
    node = make_listed_node(gpu_count=1)
    instance = run(book(UserFactory(), node))
    svc.instance_interrupt(instance_id=instance.pk, since=timezone.now(), cause=InterruptionCause.VM_LOST,
                           detail="the VM stopped")
    assert "renters' instances are live on it (1 interrupted)" in _retire_refusal(node)


def test_maintenance_ends_offline_while_the_health_check_fails_and_a_failure_keeps_it_in_maintenance():
    from provisioning.services.fleet_record import node_record_health

    node = make_listed_node(gpu_count=1)
    node_svc.node_update(node=node, maintenance=True)
    for _ in range(5):
        node_record_health(node_id=node.pk, ok=False, error="no route to host")
    node.refresh_from_db()
    assert node.state == NodeState.MAINTENANCE and node.health_failures == 5  # the provider's, till they end it
    node_svc.node_update(node=node, maintenance=False)
    node.refresh_from_db()
    assert node.state == NodeState.OFFLINE  # not straight to active: the health check brings it back
    node_record_health(node_id=node.pk, ok=True)
    node.refresh_from_db()
    assert node.state == NodeState.ACTIVE


def test_a_node_with_renters_comes_back_active_whatever_its_verdict():
    node = make_listed_node(gpu_count=1)
    run(book(UserFactory(), node))
    type(node).objects.filter(pk=node.pk).update(verdict=Verdict.REJECTED, state=NodeState.OFFLINE)
    node.refresh_from_db()
    assert node_svc.node_return_state(node=node) == NodeState.ACTIVE  # watched for its renters, not listed
    svc.Instance.objects.filter(node=node).update(status=InstanceStatus.DESTROYED)
    node.gpus.update(status=GpuStatus.FREE)
    GpuAllocation.objects.filter(gpu__node=node).update(released_at=timezone.now())
    assert node_svc.node_return_state(node=node) == NodeState.PENDING
    # A stopped instance destroyed while the node was away holds no GPU, but its VM is still there to remove:
    # the node stays watched (active) so that the reconciler removes it (pending, nothing would).
    svc.Instance.objects.filter(node=node).update(vm_cleanup_pending=True)
    assert node_svc.node_return_state(node=node) == NodeState.ACTIVE


def test_an_instance_on_a_retired_node_cannot_start_and_is_told_why():
    node = make_listed_node(gpu_count=1)
    instance = run(book(UserFactory(), node))
    svc.instance_stop(instance=instance)
    svc.instance_mark_stopped(instance_id=instance.pk)
    type(node).objects.filter(pk=node.pk).update(state=NodeState.RETIRED)
    instance.refresh_from_db()
    with pytest.raises(Conflict, match="its node was retired by its provider and never comes back"):
        svc.instance_start(instance=instance)


def test_a_stopped_instance_destroyed_while_the_node_was_away_holds_the_retire_until_its_vm_is_removed(sent_jobs):
    """Destroyed while its node could not be reached, a stopped instance (it holds no GPU) keeps the retire back
    until the reconciler removed its VM and disk (found by review: the node was retired with the disk on it)."""
    node = make_listed_node(gpu_count=1)
    instance = run(book(UserFactory(), node))
    svc.instance_stop(instance=instance)
    svc.instance_mark_stopped(instance_id=instance.pk)
    type(node).objects.filter(pk=node.pk).update(state=NodeState.OFFLINE, health_failures=5)
    instance.refresh_from_db()
    svc.instance_destroy(instance=instance)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.DESTROYED and instance.vm_cleanup_pending
    type(node).objects.filter(pk=node.pk).update(state=NodeState.ACTIVE, health_failures=0)  # it answers again
    node.refresh_from_db()
    assert "still removing the VM of 1 destroyed instance" in _retire_refusal(node)
    svc.instance_cleanup_done(instance_id=instance.pk)  # what the reconciler calls once the VM is gone
    instance.refresh_from_db()
    assert not instance.vm_cleanup_pending
    node_svc.node_retire(node=node)


def test_a_node_sent_offline_by_a_check_that_failed_on_the_platforms_side_is_not_retired_as_unreachable(sent_jobs):
    """Offline alone is not unreachable: a check the platform lost (a reaped job) sends a node offline that answers
    every health check; its renter's interrupted instance, which the reconciler would restart, is not failed."""
    from provisioning.models import Job, JobKind
    from provisioning.services.verification import node_verify_failed, node_verify_request
    from provisioning.ssh_errors import NodeError

    node = make_listed_node(gpu_count=1)
    instance = run(book(UserFactory(), node))
    svc.instance_interrupt(instance_id=instance.pk, since=timezone.now(), cause=InterruptionCause.VM_LOST,
                           detail="the VM stopped")
    node_svc.node_update(node=node, maintenance=True)
    node_verify_request(node=node, reason="provider")
    node_verify_failed(job=Job.objects.filter(node=node, kind=JobKind.NODE_VERIFY).latest("pk"),
                       error=NodeError("The job did not finish in time and was stopped by the platform."))
    node.refresh_from_db()
    assert node.state == NodeState.OFFLINE and node.health_failures == 0
    assert "renters' instances are live on it (1 interrupted)" in _retire_refusal(node)
    assert not node_svc.node_unreachable(node)
    type(node).objects.filter(pk=node.pk).update(health_failures=1)  # its health check failed too: unreachable
    node.refresh_from_db()
    assert node_svc.node_unreachable(node)


def test_a_quarantined_nodes_refusal_says_what_it_waits_for(sent_jobs):
    """A destroy that met a changed host key leaves the VM for later; a quarantined node is never reconciled until
    an operator accepts its key, so "a few minutes" would never come."""
    from provisioning.models import Job, JobKind
    from provisioning.services.vms import vm_destroy_failed
    from provisioning.ssh_errors import HostKeyMismatch

    node = make_listed_node(gpu_count=1)
    instance = run(book(UserFactory(), node))
    svc.instance_destroy(instance=instance)
    type(node).objects.filter(pk=node.pk).update(state=NodeState.QUARANTINED)
    vm_destroy_failed(job=Job.objects.filter(instance=instance, kind=JobKind.INSTANCE_DESTROY).latest("pk"),
                      error=HostKeyMismatch("SHA256:old", "SHA256:new"))
    node.refresh_from_db()
    message = _retire_refusal(node)
    assert "once an operator has accepted its new host key" in message and "a few minutes" not in message


def test_a_gpu_split_into_mig_slices_keeps_its_status_in_any_form(admin_client):
    """Held through its slices' allocations, a split GPU was freed from the Node page's GPU rows while a renter's
    slice ran on it, and the next whole-GPU booking took the same card (found by review)."""
    from django.core.exceptions import ValidationError

    from tests.marketplace.mig_helpers import make_mig_node

    node = make_mig_node({0: ["7g.80gb"]}, gpu_count=1)
    run(book(UserFactory(), node, num_gpus=1, mig_profile="7g.80gb"))
    split = node.gpus.get(index=0)
    for status in (GpuStatus.FREE, GpuStatus.UNAVAILABLE):
        split.status = status
        with pytest.raises(ValidationError, match="split into MIG slices"):
            split.full_clean()


def test_operators_retire_nodes_in_the_admin_and_cannot_delete_them(admin_client):
    """The admin's Retire calls node_retire (its refusals named per node); deleting a node there took its checks,
    events and jobs with it (nodes never rented had no instance or volume to protect them)."""
    from django.urls import reverse

    from marketplace.models import Node

    idle, rented = make_listed_node(gpu_count=1, name="idle-one"), make_listed_node(gpu_count=1, name="rented-one")
    run(book(UserFactory(), rented))
    url = reverse("admin:marketplace_node_changelist")
    r = admin_client.post(url, {"action": "retire", "_selected_action": [idle.pk, rented.pk]}, follow=True)
    said = [str(m) for m in r.context["messages"]]
    assert "1 node(s) retired." in said
    assert any(m.startswith("rented-one: ") and "live on it" in m for m in said), said
    assert Node.objects.get(pk=idle.pk).state == NodeState.RETIRED
    assert Node.objects.get(pk=rented.pk).state != NodeState.RETIRED
    assert admin_client.get(reverse("admin:marketplace_node_delete", args=[idle.pk])).status_code == 403
    r = admin_client.post(url, {"action": "delete_selected", "_selected_action": [idle.pk]})
    assert Node.objects.filter(pk=idle.pk).exists()


def test_an_unreachable_nodes_stopped_instances_end_with_the_retire_their_disks_billed_to_its_last_check():
    """Before, a stopped instance held an unreachable node's retire back for good (its renter billed for a disk
    nobody could reach, until they destroyed it). Now it fails with the retire, its renter told, and its disk is
    billed no further than the node's last healthy moment."""
    node = make_listed_node(gpu_count=1)
    instance = run(book(UserFactory(), node))
    svc.instance_stop(instance=instance)
    svc.instance_mark_stopped(instance_id=instance.pk)
    now = timezone.now()
    last_healthy = now - timedelta(hours=2)  # stopped three hours ago, then its server went silent
    type(node).objects.filter(pk=node.pk).update(state=NodeState.OFFLINE, health_failures=9,
                                                 last_seen_at=last_healthy)
    svc.Instance.objects.filter(pk=instance.pk).update(stopped_at=now - timedelta(hours=3))
    node.refresh_from_db()
    node_svc.node_retire(node=node)
    node.refresh_from_db()
    instance.refresh_from_db()
    assert node.state == NodeState.RETIRED
    assert instance.status == InstanceStatus.FAILED and node_svc.RETIRED_WHILE_STOPPED in instance.status_message
    assert instance.disk_billed_until == last_healthy and instance.disk_billed_seconds == 3600
    assert Notification.objects.filter(user=instance.renter, kind="instance_failed").exists()
    event = NodeEvent.objects.get(node=node, kind="retired_unreachable")
    assert f"stopped instance(s) {instance.pk} ended as failed" in event.message


def test_the_same_stopped_instance_on_a_reachable_node_still_refuses_the_retire():
    node = make_listed_node(gpu_count=1)
    instance = run(book(UserFactory(), node))
    svc.instance_stop(instance=instance)
    svc.instance_mark_stopped(instance_id=instance.pk)
    assert "1 stopped instance keeps a renter's data on it" in _retire_refusal(node)
