"""Races between an instance's VM jobs and the renter's destroy, and volumes of instances whose VM is still on the
node (found by review; each test failed before its fix). The node is a fake session answering as the agent's
`vm` commands do (a destroy of a VM not there yet answers existed: false; a create after it goes ahead)."""
import pytest
from celery.exceptions import Retry
from django.utils import timezone

from marketplace.models import Gpu, GpuAllocation, Instance, InstanceStatus, InterruptionCause, Node
from marketplace.services import instances as instance_svc
from marketplace.services import volumes as volume_svc
from provisioning import tasks
from provisioning.models import OPEN, Job, JobKind, JobStatus
from provisioning.services.reconcile import node_reconcile
from provisioning.services.vms import vm_destroy_failed
from provisioning.ssh_errors import AgentFailed, NodeError
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book, run

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def sent_jobs(monkeypatch):
    sent = []
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: sent.append((job_id, kind)))
    monkeypatch.setattr("provisioning.services.vms.wait_for_ssh", lambda host, port, timeout=0: None)
    return sent


class FakeNode:
    """A node's VMs as the agent keeps them; `hooks[(cmd, sub)]` runs before the agent answers that command;
    `on_enter` runs when a session opens (the job is connecting)."""

    def __init__(self):
        self.vms: dict[str, str] = {}
        self.calls: list[tuple[str, str, str]] = []
        self.hooks: dict[tuple[str, str], object] = {}
        self.on_enter = []

    def session(self, node, *args, **kwargs):
        fake = self

        class Session:
            def __enter__(self):
                while fake.on_enter:
                    fake.on_enter.pop(0)()
                return self

            def __exit__(self, *exc):
                return False

            def agent(self, cmd, sub=None, request=None, timeout=None):
                hook = fake.hooks.pop((cmd, sub), None)
                if hook is not None:
                    hook()
                vm_id = (request or {}).get("vm_id", "")
                fake.calls.append((cmd, sub, vm_id))
                if (cmd, sub) == ("vm", "create"):
                    fake.vms[vm_id] = "running"
                elif (cmd, sub) == ("vm", "destroy"):
                    existed = fake.vms.pop(vm_id, None) is not None
                    return {"vm_id": vm_id, "state": "destroyed", "existed": existed}
                elif (cmd, sub) == ("vm", "stop"):
                    fake.vms[vm_id] = "stopped"
                elif (cmd, sub) == ("vm", "start"):
                    fake.vms[vm_id] = "running"
                elif (cmd, sub) == ("vm", "status") and vm_id not in fake.vms:
                    raise AgentFailed({"code": "not_found", "message": f"no VM {vm_id} on this node"})
                return {"vm_id": vm_id, "state": fake.vms.get(vm_id, "running"), "ssh_host": "10.0.0.9",
                        "ssh_port": 40022, "ssh_user": "root"}

        return Session()


@pytest.fixture
def fake_node(monkeypatch):
    fake = FakeNode()
    monkeypatch.setattr("provisioning.services.vms.node_session", fake.session)
    return fake


def run_in_worker(task, job: Job):
    """As tests/provisioning/test_control_plane_faults.py: the job's task as a worker delivery runs it."""
    task.push_request(id=f"task-{job.pk}-{timezone.now().timestamp()}", args=[job.pk], kwargs={}, retries=0,
                      called_directly=False, delivery_info={"exchange": "", "routing_key": "celery"})
    try:
        tasks.run_job(task, job.pk)
    finally:
        task.pop_request()


def running_instance(node):
    instance = run(book(UserFactory(), node))
    Job.objects.filter(instance=instance).update(status=JobStatus.SUCCEEDED, finished_at=timezone.now())
    return Instance.objects.get(pk=instance.pk)


def destroy(instance_id: int) -> None:
    instance_svc.instance_destroy(instance=Instance.objects.get(pk=instance_id))


# ------------------------------------------------------------------------------------------------ 1

def test_a_destroy_asked_while_the_stop_job_stops_the_vm_is_not_turned_into_a_failure(fake_node):
    """vms.vm_stop calls instance_mark_stopped after the agent's stop; a destroy asked meanwhile (STOPPING ->
    DESTROYING is allowed) makes it raise InvalidTransition, which tasks._run takes as a crash: vm_failed fails
    the instance ("Internal error: InvalidTransition"), and the destroy job then finds it failed and does nothing.
    The renter asked for a destroy and gets a failed instance (its VM stopped, not removed)."""
    node = make_listed_node(gpu_count=1)
    instance = running_instance(node)
    instance_svc.instance_stop(instance=instance)
    stop_job = Job.objects.get(instance=instance, kind=JobKind.INSTANCE_STOP)
    fake_node.vms[instance.vm_id] = "running"
    fake_node.hooks[("vm", "stop")] = lambda: destroy(instance.pk)  # the renter's DELETE while the VM stops

    run_in_worker(tasks.instance_stop, stop_job)  # raised InvalidTransition, taken as a crash
    assert Job.objects.get(pk=stop_job.pk).status == JobStatus.SUCCEEDED
    destroy_job = Job.objects.get(instance=instance, kind=JobKind.INSTANCE_DESTROY)
    run_in_worker(tasks.instance_destroy, destroy_job)

    instance.refresh_from_db()
    assert instance.status == InstanceStatus.DESTROYED, (instance.status, instance.status_message)
    assert instance.vm_id not in fake_node.vms


# ------------------------------------------------------------------------------------------------ 2

def test_a_provision_that_fails_after_a_destroy_was_asked_leaves_the_instance_to_the_destroy(fake_node):
    """vms.vm_failed (the failure handler of provision/start/stop/restart jobs) calls instance_mark_failed, which
    fails any state but failed/destroyed, DESTROYING included: a create that fails (here the image pull) after
    the renter asked for a destroy turns the destroy into 'failed', and the destroy job then ends 'nothing done'
    (a failed destroy job, counted against the provider's reliability). vms._running already leaves such an
    instance to its destroy when the create *succeeds* (docs/ARCHITECTURE.md, faults table)."""
    node = make_listed_node(gpu_count=1)
    instance = book(UserFactory(), node)
    provision = Job.objects.get(instance=instance, kind=JobKind.INSTANCE_PROVISION)

    def destroy_then_fail():
        destroy(instance.pk)
        raise AgentFailed({"code": "pull_failed", "message": "manifest unknown"})

    fake_node.hooks[("vm", "create")] = destroy_then_fail
    run_in_worker(tasks.instance_provision, provision)
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.DESTROYING, \
        Instance.objects.get(pk=instance.pk).status_message
    destroy_job = Job.objects.get(instance=instance, kind=JobKind.INSTANCE_DESTROY)
    run_in_worker(tasks.instance_destroy, destroy_job)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.DESTROYED
    assert Job.objects.get(pk=destroy_job.pk).status == JobStatus.SUCCEEDED


# ------------------------------------------------------------------------------------------------ 3

def test_a_destroy_waits_for_the_provision_so_no_vm_is_made_on_gpus_it_freed(fake_node):
    """The renter destroyed while the provision job connected (before `vm create`); the destroy job, on another
    worker, found no VM, freed the GPU, and the provision then created the VM on it: a VM on a GPU listed as free
    (the next renter's create got gpu_busy). Now the destroy waits while a job that makes or starts the VM is
    open, and removes the VM that job made."""
    node = make_listed_node(gpu_count=1)
    instance = book(UserFactory(), node)
    provision = Job.objects.get(instance=instance, kind=JobKind.INSTANCE_PROVISION)
    waited = []

    def renter_destroys_and_the_destroy_job_runs():
        destroy(instance.pk)
        with pytest.raises(Retry):  # a busy node's retry: uncounted, until the destroy's deadline
            run_in_worker(tasks.instance_destroy, Job.objects.get(instance=instance, kind=JobKind.INSTANCE_DESTROY))
        waited.append(Job.objects.get(instance=instance, kind=JobKind.INSTANCE_DESTROY).log[-1]["message"])

    fake_node.on_enter.append(renter_destroys_and_the_destroy_job_runs)  # while the provision job connects
    run_in_worker(tasks.instance_provision, provision)
    assert "is still under way; the destroy follows it" in waited[0]
    assert Job.objects.get(pk=provision.pk).status == JobStatus.SUCCEEDED  # not a failure: left to the destroy
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.DESTROYING
    assert Gpu.objects.get(node=node, index=0).status == "rented" and instance.vm_id in fake_node.vms

    run_in_worker(tasks.instance_destroy, Job.objects.get(instance=instance, kind=JobKind.INSTANCE_DESTROY))
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.DESTROYED and not instance.vm_cleanup_pending
    assert instance.vm_id not in fake_node.vms and Gpu.objects.get(node=node, index=0).status == "free"
    assert [c[:2] for c in fake_node.calls] == [("vm", "create"), ("vm", "destroy")]


def test_a_vm_made_for_an_instance_destroyed_meanwhile_is_removed_by_the_job_that_made_it(fake_node):
    """Destroyed at once while the provision ran (its destroy job gave up at its deadline: destroyed for the
    renter, its GPU kept for a VM still to be removed): the provision job that then made the VM removes it and
    frees the GPU, rather than leave it to a destroy job that is over."""
    from provisioning.services.vms import vm_destroy_failed
    from provisioning.ssh_errors import NodeError

    node = make_listed_node(gpu_count=1)
    instance = book(UserFactory(), node)
    provision = Job.objects.get(instance=instance, kind=JobKind.INSTANCE_PROVISION)

    def destroyed_for_the_renter():
        destroy(instance.pk)
        vm_destroy_failed(job=Job.objects.get(instance=instance, kind=JobKind.INSTANCE_DESTROY),
                          error=NodeError("The node stayed busy until this job's deadline."))
        assert Gpu.objects.get(node=node, index=0).status == "rented"  # kept: a VM may yet be made on it

    fake_node.hooks[("vm", "create")] = destroyed_for_the_renter
    run_in_worker(tasks.instance_provision, provision)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.DESTROYED and not instance.vm_cleanup_pending
    assert instance.vm_id not in fake_node.vms and Gpu.objects.get(node=node, index=0).status == "free"
    assert Job.objects.get(pk=provision.pk).status == JobStatus.SUCCEEDED


# ------------------------------------------------------------------------------------------------ 4

def test_a_volume_whose_destroyed_instance_still_has_its_vm_on_the_node_cannot_be_mounted_again(fake_node):
    """A running instance with a volume is interrupted (node missed 2 checks; still `active` until the 3rd), the
    renter destroys it: destroyed at once with vm_cleanup_pending, its GPU held 'so nobody is given a GPU its VM
    may still use'. Its volume, though, counts as free (volumes._live_mount only looks at the instance's status),
    so a new booking on the same node mounts the same volume while the old VM (mounting it) is still there."""
    node = make_listed_node(gpu_count=2)
    owner = UserFactory()
    volume = volume_svc.volume_create(owner=owner, node_id=node.pk, size_gb=5)
    volume_svc.volume_mark_available(volume_id=volume.pk)
    first = book(owner, node, volumes=[{"volume": volume.pk, "mount": "/data"}])
    first = run(first)
    Job.objects.filter(instance=first).update(status=JobStatus.SUCCEEDED, finished_at=timezone.now())
    Node.objects.filter(pk=node.pk).update(health_failures=2)
    instance_svc.instance_interrupt(instance_id=first.pk, since=None, cause=InterruptionCause.NODE_LOST,
                                    detail="2 health checks failed")
    destroy(first.pk)
    first.refresh_from_db()
    assert first.status == InstanceStatus.DESTROYED and first.vm_cleanup_pending
    assert GpuAllocation.objects.filter(instance=first, released_at__isnull=True).exists()  # its VM may run on

    from core.errors import Conflict
    with pytest.raises(Conflict):
        book(owner, node, volumes=[{"volume": volume.pk, "mount": "/data"}])


def test_same_after_a_destroy_job_that_could_not_reach_an_otherwise_healthy_node(fake_node):
    """The same through vms.vm_destroy_failed (a destroy job that gave up: the node stays active and healthy, so
    nothing else stops the booking): the old VM, still mounting the volume, is removed only at the next reconcile;
    the new instance's `vm create` mounts the same volume (the agent does not refuse a volume another VM mounts)."""
    from provisioning.services.vms import vm_destroy_failed
    from provisioning.ssh_errors import NodeError

    node = make_listed_node(gpu_count=2)
    owner = UserFactory()
    volume = volume_svc.volume_create(owner=owner, node_id=node.pk, size_gb=5)
    volume_svc.volume_mark_available(volume_id=volume.pk)
    first = run(book(owner, node, volumes=[{"volume": volume.pk, "mount": "/data"}]))
    Job.objects.filter(instance=first).update(status=JobStatus.SUCCEEDED, finished_at=timezone.now())
    destroy(first.pk)
    vm_destroy_failed(job=Job.objects.get(instance=first, kind=JobKind.INSTANCE_DESTROY),
                      error=NodeError("The node did not answer."))
    first.refresh_from_db()
    assert first.status == InstanceStatus.DESTROYED and first.vm_cleanup_pending

    from core.errors import Conflict
    with pytest.raises(Conflict):
        book(owner, node, volumes=[{"volume": volume.pk, "mount": "/data"}])


# ------------------------------------------------------------------------------------------------ 6

class ListingNode(FakeNode):
    def session(self, node, *args, **kwargs):
        inner = super().session(node, *args, **kwargs)
        fake = self
        base_agent = inner.agent

        def agent(cmd, sub=None, request=None, timeout=None):
            if (cmd, sub) == ("vm", "list"):
                return {"vms": [{"vm_id": v, "state": s} for v, s in fake.vms.items()]}
            if (cmd, sub) == ("volume", "list"):
                return {"volumes": []}
            return base_agent(cmd, sub, request, timeout)

        inner.agent = agent
        return inner


def test_the_reconciler_frees_no_gpu_while_a_job_making_the_vm_is_open(monkeypatch):
    """A provision may run 900 s (an image pull), a destroy waits 300 s: given up, the instance is destroyed for
    its renter, its GPU kept for the VM still to be made. The periodic reconcile listed no VM yet and freed the
    GPU under the job about to make it (found by review). Now the job removes the VM and frees it."""
    fake = ListingNode()
    monkeypatch.setattr("provisioning.services.vms.node_session", fake.session)
    monkeypatch.setattr("provisioning.services.reconcile.node_session", fake.session)
    node = make_listed_node(gpu_count=1)
    instance = book(UserFactory(), node)
    provision = Job.objects.get(instance=instance, kind=JobKind.INSTANCE_PROVISION)
    seen = {}

    def destroyed_for_renter_then_reconcile():
        # Pulling the image (long): the renter destroys; the destroy job waits for this job until its 300 s
        # deadline (NodeBusy) and gives up: destroyed for the renter, GPU kept "for a VM still to be made".
        destroy(instance.pk)
        vm_destroy_failed(job=Job.objects.get(instance=instance, kind=JobKind.INSTANCE_DESTROY),
                          error=NodeError("The node stayed busy until this job's deadline."))
        # The node is healthy: the periodic reconcile lists its VMs (none yet) and cleans the instance up.
        node_reconcile(node)
        seen["gpu"] = Gpu.objects.get(node=node, index=0).status
        seen["job_open"] = Job.objects.filter(OPEN, pk=provision.pk).exists()

    fake.hooks[("vm", "create")] = destroyed_for_renter_then_reconcile
    run_in_worker(tasks.instance_provision, provision)
    assert seen["job_open"]
    # The VM is created right after this on the GPU: it must not be free for the next renter meanwhile.
    assert seen["gpu"] == "rented", "the reconciler freed the GPU while the provision job was still making the VM"
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.DESTROYED and not instance.vm_cleanup_pending
    assert instance.vm_id not in fake.vms and Gpu.objects.get(node=node, index=0).status == "free"
