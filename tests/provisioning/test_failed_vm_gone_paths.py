"""Every path where the platform learns that a failed instance's VM is gone from its node marks it (Instance.vm_gone:
it then holds no disk room there, nor its volumes; tests/marketplace/test_failed_vm_gone_releases.py).

Found by review: such an instance held both until its renter destroyed it. Gone means nothing of the VM is left on
the node, not even the agent's record of it (a record whose container or domain is missing still counts as mounting
the instance's volumes there): a VM the node does not list at all, one the node removed (the provisioning's own
clean-up, the reconciler's, its record of a missing VM forgotten), or any VM of a retired node. A VM the node lists
as missing, or whose state it cannot tell, leaves the mark unset until the reconciler knows more."""
from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.models import Instance, InstanceStatus, InterruptionCause, NodeState
from marketplace.services import instances as svc
from marketplace.services import nodes as node_svc
from provisioning import tasks
from provisioning.models import Job, JobKind
from provisioning.services.fleet_record import node_record_health
from provisioning.services.jobs import job_create
from provisioning.services.reconcile import node_reconcile
from provisioning.ssh_errors import AgentFailed, NodeUnreachable
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book, run
from tests.provisioning import test_vm_job_failures as job_failures
from tests.provisioning.test_reconcile_instances import FakeNode, running_instance, stopped_instance

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def sent_jobs(monkeypatch):
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: None)
    monkeypatch.setattr("provisioning.services.vms.wait_for_ssh", lambda host, port, timeout=0: None)


@pytest.fixture
def fake_node(monkeypatch):
    fake = FakeNode()
    monkeypatch.setattr("provisioning.services.reconcile.node_session", fake.session)
    return fake


def _gone(instance) -> tuple[str, bool]:
    instance.refresh_from_db()
    return instance.status, instance.vm_gone


def _failed_long_ago(instance) -> None:
    Instance.objects.filter(pk=instance.pk).update(updated_at=timezone.now() - timedelta(hours=2))


# ------------------------------------------------------------------------------------------------ the reconciler

@pytest.mark.parametrize("listed", [None, "missing"])
def test_an_interrupted_instance_whose_vm_is_gone_fails_marked_gone_only_when_not_listed(fake_node, listed):
    node = make_listed_node(gpu_count=1)
    instance = running_instance(node, fake_node)
    svc.instance_interrupt(instance_id=instance.pk, since=timezone.now(), cause=InterruptionCause.NODE_LOST,
                           detail="no answer")
    if listed is None:
        del fake_node.vms[instance.vm_id]
    else:
        fake_node.vms[instance.vm_id] = listed
    node_reconcile(node)
    assert _gone(instance) == (InstanceStatus.FAILED, listed is None)
    if listed == "missing":  # its record on the node is forgotten a while after: nothing of it is left then
        _failed_long_ago(instance)
        node_reconcile(node)
        assert instance.vm_id not in fake_node.vms
        assert _gone(instance) == (InstanceStatus.FAILED, True)


def test_a_running_instance_whose_vm_is_not_listed_fails_marked_gone(fake_node):
    node = make_listed_node(gpu_count=1)
    instance = running_instance(node, fake_node)
    Instance.objects.filter(pk=instance.pk).update(started_at=timezone.now() - timedelta(minutes=5))
    del fake_node.vms[instance.vm_id]
    node_reconcile(node)
    assert _gone(instance) == (InstanceStatus.FAILED, True)


@pytest.mark.parametrize("listed", [None, "missing"])
def test_a_stopped_instance_whose_vm_is_gone_fails_marked_gone_only_when_not_listed(fake_node, listed):
    node = make_listed_node(gpu_count=1)
    instance = stopped_instance(node, fake_node, stopped_ago=timedelta(hours=1))
    if listed is None:
        del fake_node.vms[instance.vm_id]
    else:
        fake_node.vms[instance.vm_id] = listed
    node_reconcile(node)
    assert _gone(instance) == (InstanceStatus.FAILED, listed is None)


def test_a_failed_instance_whose_kept_vm_later_leaves_the_node_is_marked_gone_at_the_next_pass(fake_node):
    """Failed with its VM kept (stopped, the renter's data on it): it holds; once the node no longer lists it (removed
    there), the next pass marks it, unless a VM job of it is open (the list cannot show what that job does)."""
    node = make_listed_node(gpu_count=2)
    kept, busy = stopped_instance(node, fake_node), stopped_instance(node, fake_node)
    for instance in (kept, busy):
        svc.instance_mark_failed(instance_id=instance.pk, message="failed for another reason")
    node_reconcile(node)
    assert _gone(kept) == (InstanceStatus.FAILED, False)  # its VM is there, stopped
    del fake_node.vms[kept.vm_id]
    del fake_node.vms[busy.vm_id]
    job_create(kind=JobKind.INSTANCE_STOP, node=node, instance=busy)
    node_reconcile(node)
    assert _gone(kept) == (InstanceStatus.FAILED, True)
    assert _gone(busy) == (InstanceStatus.FAILED, False)


def test_a_failed_instance_whose_vm_state_the_node_cannot_tell_is_not_marked_gone(fake_node):
    node = make_listed_node(gpu_count=1)
    instance = stopped_instance(node, fake_node)
    svc.instance_mark_failed(instance_id=instance.pk, message="failed for another reason")
    fake_node.vms[instance.vm_id] = "unknown"
    node_reconcile(node)
    assert _gone(instance) == (InstanceStatus.FAILED, False)


def test_the_vm_of_a_failed_instance_that_never_ran_removed_by_the_reconciler_is_marked_gone(fake_node):
    node = make_listed_node(gpu_count=1)
    instance = book(UserFactory(), node)
    Job.objects.filter(instance=instance).delete()  # its provision is over
    svc.instance_mark_failed(instance_id=instance.pk, message="reaped")
    fake_node.vms[instance.vm_id] = "stopped"  # made just before the failure
    assert _gone(instance) == (InstanceStatus.FAILED, False)
    node_reconcile(node)
    assert instance.vm_id not in fake_node.vms
    assert _gone(instance) == (InstanceStatus.FAILED, True)


# ------------------------------------------------------------------------------------------------ the health check

@pytest.mark.parametrize("state", [None, "missing"])
def test_a_stopped_instance_whose_vm_the_health_check_no_longer_lists_fails_marked_gone(fake_node, state):
    node = make_listed_node(gpu_count=1)
    instance = stopped_instance(node, fake_node, stopped_ago=timedelta(hours=1))
    now = timezone.now()
    node_record_health(node_id=node.pk, ok=True, vms={instance.vm_id: "stopped"}, probed_at=now)
    node_record_health(node_id=node.pk, ok=True, vms={} if state is None else {instance.vm_id: state},
                       probed_at=now + timedelta(seconds=60))
    assert _gone(instance) == (InstanceStatus.FAILED, state is None)


# ------------------------------------------------------------------------------------------------ VM jobs that gave up

def test_a_provision_that_gave_up_with_its_vm_removed_is_marked_gone(monkeypatch):
    fake = job_failures.AwayNode()
    monkeypatch.setattr("provisioning.services.vms.node_session", fake.session)
    node = make_listed_node(gpu_count=1)
    instance = book(UserFactory(), node)

    def refused():
        raise AgentFailed({"code": "pull_failed", "message": "manifest unknown"})

    fake.hooks[("vm", "create")] = refused
    job_failures.run_in_worker(tasks.instance_provision,
                               Job.objects.get(instance=instance, kind=JobKind.INSTANCE_PROVISION))
    assert _gone(instance) == (InstanceStatus.FAILED, True)


def test_a_provision_that_gave_up_unconfirmed_is_not_marked_gone(monkeypatch):
    fake = job_failures.AwayNode()
    monkeypatch.setattr("provisioning.services.vms.node_session", fake.session)
    node = make_listed_node(gpu_count=1)
    instance = book(UserFactory(), node)

    def made_then_lost():
        fake.vms[instance.vm_id] = "running"
        fake.unreachable = True
        raise NodeUnreachable("connection reset while reading the answer")

    fake.hooks[("vm", "create")] = made_then_lost
    job_failures.run_in_worker(tasks.instance_provision,
                               Job.objects.get(instance=instance, kind=JobKind.INSTANCE_PROVISION),
                               retries=job_failures.RETRIES_SPENT)
    instance.refresh_from_db()
    assert instance.vm_cleanup_pending and _gone(instance) == (InstanceStatus.FAILED, False)


def test_a_start_answered_missing_fails_without_the_mark_until_the_reconciler_knows(monkeypatch):
    """The node may keep its record of a VM it answers `missing` for (counted as mounting its volumes there)."""
    fake = job_failures.PrunedNode()
    monkeypatch.setattr("provisioning.services.vms.node_session", fake.session)
    node = make_listed_node(gpu_count=1)
    instance = job_failures.stopped_instance(node, fake)
    fake.pruned.add(instance.vm_id)
    svc.instance_start(instance=instance)
    job_failures.run_in_worker(tasks.instance_start, Job.objects.get(instance=instance, kind=JobKind.INSTANCE_START))
    assert _gone(instance) == (InstanceStatus.FAILED, False)


# ------------------------------------------------------------------------------------------------ a retired node

def test_an_unreachable_nodes_retire_marks_the_instances_it_fails_gone():
    node = make_listed_node(gpu_count=3)
    interrupted = run(book(UserFactory(), node))
    svc.instance_interrupt(instance_id=interrupted.pk, since=timezone.now() - timedelta(minutes=5),
                           cause=InterruptionCause.NODE_LOST, detail="no answer")
    stopped = run(book(UserFactory(), node))
    svc.instance_stop(instance=stopped)
    svc.instance_mark_stopped(instance_id=stopped.pk)
    failed = run(book(UserFactory(), node))
    svc.instance_mark_failed(instance_id=failed.pk, message="failed before", cleanup_pending=True)
    type(node).objects.filter(pk=node.pk).update(state=NodeState.OFFLINE, health_failures=9,
                                                 last_seen_at=timezone.now() - timedelta(hours=1))
    node.refresh_from_db()
    node_svc.node_retire(node=node)
    for instance in (interrupted, stopped, failed):
        assert _gone(instance) == (InstanceStatus.FAILED, True), instance.pk


def test_a_reachable_nodes_retire_marks_its_failed_instances_gone():
    node = make_listed_node(gpu_count=1)
    failed = run(book(UserFactory(), node))
    svc.instance_mark_failed(instance_id=failed.pk, message="its container exited")  # VM kept: it holds
    assert _gone(failed) == (InstanceStatus.FAILED, False)
    node_svc.node_retire(node=node)
    assert _gone(failed) == (InstanceStatus.FAILED, True)
