"""The renter's verbs on an instance whose node is quarantined: its SSH host key changed, and neither a health check
nor a job talks to it until an operator accepts the new key (provisioning.services.nodes.node_quarantine,
billing.services.metering.UNSEEN_NODE_STATES). A job sent there fails at once on the changed key (HostKeyMismatch:
not transient, counted against the node), and quarantines it again (another critical event for the operators).

A destroy took the quick path of an unreachable node (destroyed at once, its VM removed by the reconciler when the
node is back) only for an offline node or one missing its health checks: on a quarantined node a stopped
instance's destroy queued a job that failed at once. Each test here failed on the old lifecycle.py."""
import pytest
from django.utils import timezone

from marketplace.models import Gpu, Instance, InstanceStatus, Node, NodeState
from marketplace.services import instances as svc
from provisioning import tasks
from provisioning.models import OPEN, Job, JobFault, JobKind, JobStatus, NodeEvent
from provisioning.services.nodes import node_quarantine
from provisioning.services.reconcile import node_reconcile
from provisioning.ssh_errors import HostKeyMismatch
from tests.factories import UserFactory, make_listed_node
from tests.provisioning.test_reconcile_instances import FakeNode

from .renting_helpers import book, run, sent_jobs_fixture  # noqa: F401

pytestmark = pytest.mark.django_db

OLD_KEY, NEW_KEY = "SHA256:old", "SHA256:new"


@pytest.fixture
def changed_key(monkeypatch):
    """Every job's SSH session meets the changed host key, as provisioning.services.nodes._session_connect does:
    the node is quarantined (again) and HostKeyMismatch raised; nothing reaches the node."""
    def session(node, *args, **kwargs):
        node_quarantine(node_id=node.pk, seen=NEW_KEY)
        raise HostKeyMismatch(OLD_KEY, NEW_KEY)

    monkeypatch.setattr("provisioning.services.vms.node_session", session)
    monkeypatch.setattr("provisioning.services.vms.wait_for_ssh", lambda host, port, timeout=0: None)


def run_open_jobs():
    """Each open job of the instances, as a worker delivery runs it."""
    task_of = {JobKind.INSTANCE_DESTROY: tasks.instance_destroy, JobKind.INSTANCE_STOP: tasks.instance_stop,
               JobKind.INSTANCE_RESTART: tasks.instance_restart, JobKind.INSTANCE_START: tasks.instance_start}
    for job in Job.objects.filter(OPEN).exclude(instance=None).order_by("pk"):
        task = task_of[job.kind]
        task.push_request(id=f"task-{job.pk}", args=[job.pk], kwargs={}, retries=0, called_directly=False,
                          delivery_info={"exchange": "", "routing_key": "celery"})
        try:
            tasks.run_job(task, job.pk)
        finally:
            task.pop_request()


def _close_jobs() -> None:
    Job.objects.filter(OPEN).update(status=JobStatus.SUCCEEDED, finished_at=timezone.now())


def running(node) -> Instance:
    instance = run(book(UserFactory(), node))
    _close_jobs()
    return Instance.objects.get(pk=instance.pk)


def stopped(node) -> Instance:
    instance = running(node)
    svc.instance_stop(instance=instance)
    svc.instance_mark_stopped(instance_id=instance.pk)
    _close_jobs()
    return Instance.objects.get(pk=instance.pk)


def failed(node) -> Instance:
    instance = running(node)
    svc.instance_mark_failed(instance_id=instance.pk, message="Its VM is gone.")
    return Instance.objects.get(pk=instance.pk)


def quarantine(node) -> None:
    Node.objects.filter(pk=node.pk).update(state=NodeState.QUARANTINED, host_key_fingerprint=OLD_KEY,
                                           seen_host_key_fingerprint=NEW_KEY, last_seen_at=timezone.now())


def critical_events(node) -> int:
    return NodeEvent.objects.filter(node=node, kind="host_key_changed").count()


def no_job_held_against_the_node(node) -> bool:
    return not Job.objects.filter(node=node, fault=JobFault.NODE).exists()


# ------------------------------------------------------------------------------------------------- destroy

@pytest.mark.parametrize("make", [stopped, failed, running], ids=["stopped", "failed", "running"])
def test_a_destroy_on_a_quarantined_node_ends_at_once_and_sends_no_job(changed_key, make):
    """Stopped (the report): its destroy queued a job, the renter saw `destroying` until a worker met the changed
    key, the job failed (held against the node's reliability) and quarantined the node again. Failed, or running (a
    job's session opened before the quarantine finished after it): the same. Now destroyed at once for the renter,
    its VM (and the GPUs it may still use) left for the reconciler when the node is back."""
    node = make_listed_node(gpu_count=1)
    instance = make(node)
    held = instance.status == InstanceStatus.RUNNING
    quarantine(node)
    events = critical_events(node)

    answer = svc.instance_destroy(instance=instance)
    assert answer.status == InstanceStatus.DESTROYED
    run_open_jobs()  # the old code's destroy job, run as a worker would
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.DESTROYED and instance.vm_cleanup_pending, instance.status_message
    assert not Job.objects.filter(instance=instance, kind=JobKind.INSTANCE_DESTROY).exists()
    assert no_job_held_against_the_node(node) and critical_events(node) == events
    # A VM the node may still run keeps its GPU until the reconciler has removed it.
    assert Gpu.objects.get(node=node, index=0).status == ("rented" if held else "free")


def test_the_vm_is_removed_when_the_node_is_back(monkeypatch):
    """The quick path leaves the VM on the node: once an operator accepted the new key and the node is verified
    again, its reconcile removes it and frees what it held."""
    node = make_listed_node(gpu_count=1)
    instance = running(node)
    quarantine(node)
    svc.instance_destroy(instance=instance)
    fake = FakeNode()
    fake.vms[instance.vm_id] = "running"
    Node.objects.filter(pk=node.pk).update(state=NodeState.ACTIVE, host_key_fingerprint=NEW_KEY,
                                           seen_host_key_fingerprint="")
    node.refresh_from_db()
    monkeypatch.setattr("provisioning.services.reconcile.node_session", fake.session)
    node_reconcile(node)
    instance.refresh_from_db()
    assert instance.vm_id not in fake.vms and not instance.vm_cleanup_pending
    assert Gpu.objects.get(node=node, index=0).status == "free"


def test_a_destroy_on_a_reachable_node_still_sends_its_job():
    node = make_listed_node(gpu_count=1)
    instance = stopped(node)
    assert svc.instance_destroy(instance=instance).status == InstanceStatus.DESTROYING
    assert Job.objects.filter(instance=instance, kind=JobKind.INSTANCE_DESTROY).exists()


# ------------------------------------------------------------------------------------ stop, restart, start

def test_a_stop_on_a_quarantined_node_ends_at_once_its_gpus_held_until_the_node_is_back(changed_key, monkeypatch):
    """A running instance on a quarantined node (a job's session opened before the quarantine finished after it):
    its stop queued a job that met the changed key, never touched the VM, and so put the instance back to running
    ("It is still running (and billed); stop it again"), every stop alike, held against the node and quarantining
    it again each time. Now stopped at once, as by a stop job that gave up unconfirmed: its GPU kept (the VM may
    still use it) until the node's reconcile, once the key is accepted, stops the VM and frees it."""
    node = make_listed_node(gpu_count=1)
    instance = running(node)
    quarantine(node)
    events = critical_events(node)

    assert svc.instance_stop(instance=instance).status == InstanceStatus.STOPPED
    run_open_jobs()  # the old code's stop job, run as a worker would
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.STOPPED and instance.vm_cleanup_pending, instance.status_message
    assert "host key" in instance.status_message
    assert not Job.objects.filter(instance=instance, kind=JobKind.INSTANCE_STOP).exists()
    assert no_job_held_against_the_node(node) and critical_events(node) == events
    assert Gpu.objects.get(node=node, index=0).status == "rented"

    fake = FakeNode()
    fake.vms[instance.vm_id] = "running"
    Node.objects.filter(pk=node.pk).update(state=NodeState.ACTIVE, host_key_fingerprint=NEW_KEY,
                                           seen_host_key_fingerprint="")
    node.refresh_from_db()
    monkeypatch.setattr("provisioning.services.reconcile.node_session", fake.session)
    node_reconcile(node)
    instance.refresh_from_db()
    assert fake.vms[instance.vm_id] == "stopped" and not instance.vm_cleanup_pending
    assert instance.status == InstanceStatus.STOPPED and Gpu.objects.get(node=node, index=0).status == "free"


def test_a_restart_on_a_quarantined_node_is_refused_at_once(changed_key):
    """Its restart job met the changed key and failed (held against the node, the node quarantined again); the
    instance went back to running. Now a 409 that says why."""
    from core.errors import Conflict

    node = make_listed_node(gpu_count=1)
    instance = running(node)
    quarantine(node)
    with pytest.raises(Conflict, match="quarantined.*host key"):
        svc.instance_restart(instance=instance)
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.RUNNING
    assert not Job.objects.filter(instance=instance, kind=JobKind.INSTANCE_RESTART).exists()


def test_a_start_on_a_quarantined_node_was_and_is_refused():
    """Coverage (passed before): a start takes GPUs on the node again, refused as a booking is."""
    from core.errors import Conflict

    node = make_listed_node(gpu_count=1)
    instance = stopped(node)
    quarantine(node)
    with pytest.raises(Conflict, match="quarantined"):
        svc.instance_start(instance=instance)
    assert not Job.objects.filter(instance=instance, kind=JobKind.INSTANCE_START).exists()
