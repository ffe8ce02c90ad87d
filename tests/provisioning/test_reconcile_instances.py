"""The reconciler's rules for instances that are not running (provisioning/services/reconcile.py): a stopped
instance whose VM vanished, a stopped instance whose VM runs, an interrupted instance whose START job is still
open (found by review; each test failed before its fix). The node is a fake session answering `vm list` with the
VMs it keeps, as the agent does (stopped ones included)."""
from datetime import timedelta

import pytest
from django.utils import timezone

from billing.models import AccountKind, BillingEvent, EventKind, LedgerTransaction, TransactionKind
from billing.services.storage import storage_cost, storage_meter
from marketplace.models import Gpu, Instance, InstanceStatus, InterruptionCause
from marketplace.selectors import instances_awaiting_cleanup
from marketplace.services import instances as svc
from provisioning.models import OPEN, Job, JobKind, JobStatus, NodeEvent
from provisioning.services.jobs import job_create
from provisioning.services.reconcile import node_reconcile
from provisioning.ssh_errors import AgentFailed, AgentGarbage
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book, run

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def sent_jobs(monkeypatch):
    sent = []
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: sent.append((job_id, kind)))
    return sent


class FakeNode:
    """A node's VMs as the agent keeps them (vm_id -> state); `on_list` runs right after it answers `vm list`."""

    def __init__(self):
        self.vms: dict[str, str] = {}
        self.calls: list[tuple[str, str, str]] = []
        self.on_list = []
        self.refused: set[str] = set()  # VMs whose `vm destroy` the node fails (its engine cannot remove them)

    def session(self, node, *args, **kwargs):
        fake = self

        class Session:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def agent(self, cmd, sub=None, request=None, timeout=None):
                vm_id = (request or {}).get("vm_id", "")
                fake.calls.append((cmd, sub, vm_id))
                if (cmd, sub) == ("vm", "list"):
                    answer = {"vms": [{"vm_id": k, "state": v} for k, v in fake.vms.items()]}
                    while fake.on_list:
                        fake.on_list.pop(0)()
                    return answer
                if (cmd, sub) == ("volume", "list"):
                    return {"volumes": []}
                if (cmd, sub) == ("vm", "destroy") and vm_id in fake.refused:
                    raise AgentFailed({"code": "command_failed", "message": "docker rm: device or resource busy"})
                if (cmd, sub) == ("vm", "destroy") and request.get("only_if_missing"):
                    if fake.vms.get(vm_id, "missing") != "missing":
                        raise AgentFailed({"code": "conflict", "message": f"VM {vm_id} is on this node"})
                    return {"vm_id": vm_id, "existed": fake.vms.pop(vm_id, None) is not None}
                if (cmd, sub) == ("vm", "destroy"):
                    return {"vm_id": vm_id, "existed": fake.vms.pop(vm_id, None) is not None}
                if (cmd, sub) == ("vm", "stop"):
                    fake.vms[vm_id] = "stopped"
                elif (cmd, sub) == ("vm", "start"):
                    fake.vms[vm_id] = "running"
                return {"vm_id": vm_id, "state": fake.vms.get(vm_id)}

        return Session()


@pytest.fixture
def fake_node(monkeypatch):
    fake = FakeNode()
    monkeypatch.setattr("provisioning.services.reconcile.node_session", fake.session)
    return fake


def _close_jobs(instance) -> None:
    Job.objects.filter(OPEN, instance=instance).update(status=JobStatus.SUCCEEDED, finished_at=timezone.now())


def running_instance(node, fake) -> Instance:
    instance = run(book(UserFactory(), node))
    _close_jobs(instance)
    fake.vms[instance.vm_id] = "running"
    return Instance.objects.get(pk=instance.pk)


def stopped_instance(node, fake, *, stopped_ago=timedelta(0)) -> Instance:
    """A renter's stopped instance (its stop job done), its VM stopped on the node, its disk billed from
    `stopped_ago` before now."""
    instance = running_instance(node, fake)
    svc.instance_stop(instance=instance)
    svc.instance_mark_stopped(instance_id=instance.pk, message="Stopped; the disk is kept.")
    _close_jobs(instance)
    fake.vms[instance.vm_id] = "stopped"
    if stopped_ago:
        Instance.objects.filter(pk=instance.pk).update(stopped_at=timezone.now() - stopped_ago)
    return Instance.objects.get(pk=instance.pk)


# ------------------------------------------------------------------------------------------------ stopped

def test_a_stopped_instance_whose_vm_vanished_fails_and_its_disk_is_billed_no_more(fake_node):
    """Its VM and disk were removed on the node (reinstalled, an operator's cleanup): before, the reconciler judged
    only running and interrupted instances, so it stayed `stopped`, its missing disk billed every minute and its
    start bound to fail."""
    node = make_listed_node(gpu_count=1)
    instance = stopped_instance(node, fake_node, stopped_ago=timedelta(hours=1))
    del fake_node.vms[instance.vm_id]
    counts = node_reconcile(node)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.FAILED, (instance.status, instance.status_message)
    assert counts["instances_failed"] == 1
    assert "disk" in instance.status_message and "destroy" in instance.status_message.lower()
    assert NodeEvent.objects.filter(node=node, kind="vm_vanished", message__contains=f"instance {instance.pk}")
    # Billed up to the moment it was found gone, then never again.
    assert instance.disk_billed_seconds >= 3600
    billed = (instance.disk_billed_seconds, instance.disk_cost_micros)
    storage_meter(now=timezone.now() + timedelta(hours=2))
    instance.refresh_from_db()
    assert (instance.disk_billed_seconds, instance.disk_cost_micros) == billed


def test_a_stopped_instance_whose_vm_is_there_is_left_as_it_is(fake_node):
    node = make_listed_node(gpu_count=1)
    instance = stopped_instance(node, fake_node)
    counts = node_reconcile(node)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.STOPPED and counts["instances_failed"] == 0
    assert not any(call[:2] in (("vm", "stop"), ("vm", "destroy")) for call in fake_node.calls)


def test_a_stopped_instance_with_a_vm_job_open_is_not_judged_by_the_list(fake_node):
    """A start asked and its job done, or one still open, while the node listed its VMs (the list cannot show
    what that job does): judged next time, not failed nor stopped now."""
    node = make_listed_node(gpu_count=1)
    instance = stopped_instance(node, fake_node)
    del fake_node.vms[instance.vm_id]
    # A START job open for it (e.g. one the worker lost after it marked the instance stopped again).
    Job.objects.create(kind=JobKind.INSTANCE_START, node=node, instance=instance, status=JobStatus.RUNNING,
                       deadline=timezone.now() + timedelta(minutes=5))
    counts = node_reconcile(node)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.STOPPED and counts["instances_failed"] == 0


def test_an_instance_stopped_while_the_node_listed_its_vms_is_judged_next_time(fake_node):
    """Stopping when the node answered its list (the VM listed running), stopped by the time the database is
    read: its VM is not stopped again nor its instance judged on that list."""
    node = make_listed_node(gpu_count=1)
    instance = running_instance(node, fake_node)
    svc.instance_stop(instance=instance)

    def stopped_meanwhile():
        svc.instance_mark_stopped(instance_id=instance.pk, message="Stopped; the disk is kept.")
        _close_jobs(instance)
    fake_node.on_list.append(stopped_meanwhile)
    node_reconcile(node)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.STOPPED
    assert ("vm", "stop", instance.vm_id) not in fake_node.calls


@pytest.mark.parametrize("vm_state", ["running", "restarting"])
def test_a_vm_found_running_for_a_stopped_instance_is_stopped(fake_node, vm_state):
    """A stopped instance's GPUs were released (another renter may hold them now): a VM of it that runs (started
    behind the platform's back, or a stop the node did not carry out) is stopped, as a failed instance's is. So is
    a container the engine keeps restarting (the agent's "restarting" since it is no longer called running): it
    holds its GPUs too."""
    node = make_listed_node(gpu_count=1)
    instance = stopped_instance(node, fake_node)
    fake_node.vms[instance.vm_id] = vm_state
    node_reconcile(node)
    assert ("vm", "stop", instance.vm_id) in fake_node.calls
    assert fake_node.vms[instance.vm_id] == "stopped"
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.STOPPED
    assert NodeEvent.objects.filter(node=node, kind="stopped_vm_running", message__contains=instance.vm_id)

# ------------------------------------------------------------------------------------------------ interrupted

def test_an_interrupted_instance_whose_start_job_is_still_open_waits_for_it_then_is_started_again(fake_node):
    """Interrupted while its START job was still open (the worker marked it running and was lost before closing
    the job; then the node dropped off). When the node answers with the VM stopped, queuing its start again met
    the open job (JobConflict) and the reconcile raised. It stays interrupted until that job is closed (the
    reaper's, at its deadline), then is started again."""
    node = make_listed_node(gpu_count=1)
    instance = running_instance(node, fake_node)
    fake_node.vms[instance.vm_id] = "stopped"
    stale = job_create(kind=JobKind.INSTANCE_START, node=node, instance=instance)
    svc.instance_interrupt(instance_id=instance.pk, since=timezone.now(), cause=InterruptionCause.NODE_LOST,
                           detail="no answer")
    counts = node_reconcile(node)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.INTERRUPTED and counts["restarted"] == 0
    assert instance.interruptions.get().ended_at is None  # still out of reach: credited, not billed
    Job.objects.filter(pk=stale.pk).update(status=JobStatus.FAILED, finished_at=timezone.now())
    counts = node_reconcile(node)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.STARTING and counts["restarted"] == 1
    assert Job.objects.filter(OPEN, instance=instance, kind=JobKind.INSTANCE_START).exclude(pk=stale.pk).exists()


# ------------------------------------------------------------------ GPUs held until the node confirms the VM

def _gpu(node) -> str:
    return Gpu.objects.get(node=node, index=0).status


def stopped_unconfirmed(node, fake, vm_state: str) -> Instance:
    """Stopped for its renter, but the node never confirmed its VM stopped (the stop job gave up after sending
    it): it keeps its GPU, waiting for its cleanup. The node has the VM in `vm_state`."""
    instance = running_instance(node, fake)
    svc.instance_stop(instance=instance)
    svc.instance_mark_stopped(instance_id=instance.pk, message="Stopped.", cleanup_pending=True)
    _close_jobs(instance)
    fake.vms[instance.vm_id] = vm_state
    return Instance.objects.get(pk=instance.pk)


@pytest.mark.parametrize("vm_state", ["stopped", "running", "restarting", None])
def test_a_stopped_instances_held_gpu_is_freed_once_the_node_shows_its_vm_stopped_or_gone(fake_node, vm_state):
    """Its stop's answer was lost: the GPU stays held until the node shows the VM not running (listed stopped,
    stopped here, or gone). Before, only destroyed instances were cleaned up: the GPU stayed held for good."""
    node = make_listed_node(gpu_count=1)
    instance = stopped_unconfirmed(node, fake_node, vm_state or "stopped")
    if vm_state is None:
        del fake_node.vms[instance.vm_id]
    assert _gpu(node) == "rented" and instance.pk in instances_awaiting_cleanup(node_id=node.pk)
    counts = node_reconcile(node)
    instance.refresh_from_db()
    assert _gpu(node) == "free" and not instance.vm_cleanup_pending
    assert counts["cleaned_up"] == (0 if vm_state is None else 1)  # gone: failed, its GPU released with it
    if vm_state in ("running", "restarting"):
        assert fake_node.vms[instance.vm_id] == "stopped"  # stopped first, then the GPU freed
    assert instance.status == (InstanceStatus.FAILED if vm_state is None else InstanceStatus.STOPPED)


def test_a_held_gpu_stays_held_while_a_job_of_its_instance_is_open(fake_node):
    node = make_listed_node(gpu_count=1)
    instance = stopped_unconfirmed(node, fake_node, "running")
    Job.objects.create(kind=JobKind.INSTANCE_START, node=node, instance=instance, status=JobStatus.RUNNING,
                       deadline=timezone.now() + timedelta(minutes=5))
    node_reconcile(node)
    instance.refresh_from_db()
    assert _gpu(node) == "rented" and instance.vm_cleanup_pending
    assert ("vm", "stop", instance.vm_id) not in fake_node.calls


@pytest.mark.parametrize("vm_state", ["running", "restarting", None])
def test_a_failed_provisions_held_gpu_is_freed_once_its_vm_is_removed_or_gone(fake_node, vm_state):
    """A provision whose answer was lost failed with its GPU held (the VM may run on it): the reconciler
    removes the VM (it never ran for the renter) or finds it gone, then frees the GPU."""
    node = make_listed_node(gpu_count=1)
    instance = book(UserFactory(), node)
    svc.instance_mark_failed(instance_id=instance.pk, message="lost", cleanup_pending=True)
    _close_jobs(instance)
    if vm_state:
        fake_node.vms[instance.vm_id] = vm_state
    assert _gpu(node) == "rented"
    node_reconcile(node)
    instance.refresh_from_db()
    assert _gpu(node) == "free" and not instance.vm_cleanup_pending and instance.vm_id not in fake_node.vms


# ----------------------------------------------------------------------------------- the node's garbage

@pytest.mark.parametrize("vms", [[5], [{"vm_id": 5, "state": "running"}], None, {"inst-1": "running"}, "x"])
def test_a_malformed_vm_list_is_the_nodes_error_not_a_crash(fake_node, monkeypatch, vms):
    """Indexed unchecked, {"vms": [5]} raised AttributeError or TypeError, which the fleet's batches did not
    catch (found by review): one provider's node stopped the health recording and reconciling of its batch."""
    node = make_listed_node(gpu_count=1)
    session = fake_node.session(node)

    class Garbage(type(session)):
        def agent(self, cmd, sub=None, request=None, timeout=None):
            return {"vms": vms} if (cmd, sub) == ("vm", "list") else super().agent(cmd, sub, request, timeout)

    monkeypatch.setattr("provisioning.services.reconcile.node_session", lambda *a, **k: Garbage())
    with pytest.raises(AgentGarbage, match="`vms` list"):
        node_reconcile(node)


def test_a_malformed_volume_list_leaves_the_vms_reconciled(fake_node, monkeypatch):
    node = make_listed_node(gpu_count=1)
    instance = stopped_instance(node, fake_node)
    fake_node.vms[instance.vm_id] = "running"
    session = fake_node.session(node)

    class Garbage(type(session)):
        def agent(self, cmd, sub=None, request=None, timeout=None):
            if (cmd, sub) == ("volume", "list"):
                return {"volumes": [{"name": None}]}
            return super().agent(cmd, sub, request, timeout)

    monkeypatch.setattr("provisioning.services.reconcile.node_session", lambda *a, **k: Garbage())
    counts = node_reconcile(node)
    assert counts["stopped_vms_stopped"] == 1 and fake_node.vms[instance.vm_id] == "stopped"


# ------------------------------------------------------------------------------------------------ odd VM names

def test_a_vm_name_the_platform_never_gave_is_an_orphan_not_an_instances_vm(fake_node):
    """The node's answer is its provider's to write: "inst-<Arabic-Indic digits of an instance's id>" (\\d took
    them, int() read them as the id) passed for that instance's VM, so an instance whose VM was gone stayed running
    and billed; a name with a trailing newline ("$" let it through) did too. Only the platform's own spelling
    counts: the instance is judged by its real VM (gone: interrupted), the others are no VMs of the platform's,
    left alone (reported once each)."""
    node = make_listed_node(gpu_count=1)
    instance = running_instance(node, fake_node)
    del fake_node.vms[instance.vm_id]
    arabic = "inst-" + str(instance.pk).translate(str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩"))
    fake_node.vms[arabic] = "running"
    fake_node.vms[instance.vm_id + "\n"] = "running"
    node_reconcile(node)
    instance.refresh_from_db()
    assert instance.status != InstanceStatus.RUNNING, instance.status_message
    assert not [c for c in fake_node.calls if c[:2] == ("vm", "destroy")]
    assert NodeEvent.objects.filter(node=node, kind="foreign_vm").count() == 2


def test_a_vm_name_with_thousands_of_digits_does_not_end_the_nodes_pass(fake_node):
    """int() refuses over 4,300 digits: the ValueError ended the node's whole pass, every pass (its vanished VMs
    never judged). Now it is a name the platform never gives: left alone, reported once (its name cut short)."""
    node = make_listed_node(gpu_count=1)
    instance = running_instance(node, fake_node)
    huge = "inst-" + "9" * 5000
    fake_node.vms[huge] = "running"
    node_reconcile(node)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.RUNNING
    assert ("vm", "destroy", huge) not in fake_node.calls
    assert len(NodeEvent.objects.get(node=node, kind="foreign_vm").message) < 200


def test_a_vm_under_a_name_the_platform_never_gives_is_left_alone(fake_node):
    """Any VM the node lists that no instance owns was destroyed as an orphan, whatever its name: the agent
    removed any gpumarket-* container or domain (libvirt: its work folder and disk too), also one a person made
    (found by review). Only inst-<id> names are the platform's; another is left, with one event for operators."""
    node = make_listed_node(gpu_count=1)
    fake_node.vms["ghost"] = "running"
    fake_node.vms["inst-0"] = "stopped"
    fake_node.vms["inst-999999"] = "stopped"  # the platform's name, no instance of it: an orphan, removed
    for _ in range(2):
        counts = node_reconcile(node)
    assert fake_node.vms == {"ghost": "running", "inst-0": "stopped"}
    assert [c[2] for c in fake_node.calls if c[:2] == ("vm", "destroy")] == ["inst-999999"]
    assert sorted(NodeEvent.objects.filter(node=node, kind="foreign_vm").values_list("message", flat=True)) == [
        "VM 'ghost' on the node is not one the platform makes (inst-<instance id>); left as it is.",
        "VM 'inst-0' on the node is not one the platform makes (inst-<instance id>); left as it is."]
    assert counts["orphans_destroyed"] == 0


def test_the_platform_and_the_agent_agree_on_the_platforms_vm_names():
    """The reconciler removes only what it reads as inst-<id>, and the agent removes an unrecorded VM only under
    such a name: the same set."""
    from provisioning.agent.gpumarket_agent import PLATFORM_VM_ID_RE
    from provisioning.services.reconcile import _VM_ID
    for name in ("inst-1", "inst-42", "inst-" + "9" * 19, "inst-0", "inst-01", "inst-" + "9" * 20, "inst-1\n",
                 "inst-١", "ghost", "inst-", "inst-1-x", "xinst-1"):
        assert bool(PLATFORM_VM_ID_RE.fullmatch(name)) == bool(_VM_ID.fullmatch(name)), name
    assert Instance(pk=7).vm_id == "inst-7" and PLATFORM_VM_ID_RE.fullmatch(Instance(pk=7).vm_id)


# ------------------------------------------------------------------ a VM the node lists as missing, orphans

@pytest.mark.parametrize("status", [InstanceStatus.STOPPED, InstanceStatus.RUNNING, InstanceStatus.INTERRUPTED])
def test_a_vm_the_node_lists_as_missing_is_judged_gone(fake_node, status):
    """The agent lists a recorded VM whose container or domain was removed on the node with state `missing`.
    Taken as there: a stopped instance stayed stopped (its absent disk billed for good), a running or interrupted
    one was started again, and that start failed (found by review). Now it is gone, as a VM not listed: failed,
    its GPU freed; a running one at the second look (the first interrupts it)."""
    node = make_listed_node(gpu_count=1)
    instance = stopped_instance(node, fake_node) if status == InstanceStatus.STOPPED \
        else running_instance(node, fake_node)
    if status == InstanceStatus.INTERRUPTED:
        svc.instance_interrupt(instance_id=instance.pk, since=timezone.now(), cause=InterruptionCause.NODE_LOST,
                               detail="no answer")
    fake_node.vms[instance.vm_id] = "missing"
    if status == InstanceStatus.RUNNING:
        node_reconcile(node)
    counts = node_reconcile(node)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.FAILED, (instance.status, instance.status_message)
    assert counts["instances_failed"] == 1 and counts["restarted"] == 0
    assert not Job.objects.filter(OPEN, instance=instance).exists()  # no start queued
    assert _gpu(node) == "free"
    # Its record on the node is kept in the pass that failed it (an engine outage may end; found by review), and
    # removed once the instance has been failed a while.
    assert fake_node.vms[instance.vm_id] == "missing" and ("vm", "destroy", instance.vm_id) not in fake_node.calls
    Instance.objects.filter(pk=instance.pk).update(updated_at=timezone.now() - timedelta(hours=2))
    node_reconcile(node)
    assert instance.vm_id not in fake_node.vms
    assert fake_node.calls.count(("vm", "destroy", instance.vm_id)) == 1


def test_the_record_of_a_failed_instances_missing_vm_is_removed_and_no_other(fake_node):
    """A failed instance whose VM the node lists as missing: the node is asked to remove that record (only if
    missing: it counted as mounting the instance's volumes, found by review). A failed instance whose VM is there,
    stopped, is not asked; nor one whose VM is missing while a job of it is open."""
    node = make_listed_node(gpu_count=3)
    gone, there, busy = (stopped_instance(node, fake_node) for _ in range(3))
    for instance in (gone, there, busy):
        svc.instance_mark_failed(instance_id=instance.pk, message="failed")
    fake_node.vms[gone.vm_id] = fake_node.vms[busy.vm_id] = "missing"
    job_create(kind=JobKind.INSTANCE_STOP, node=node, instance=busy)
    node_reconcile(node)
    assert not [c for c in fake_node.calls if c[:2] == ("vm", "destroy")]  # not in the hour after the failure
    Instance.objects.filter(pk__in=(gone.pk, there.pk, busy.pk)).update(
        updated_at=timezone.now() - timedelta(hours=2))
    node_reconcile(node)
    destroys = [c[2] for c in fake_node.calls if c[:2] == ("vm", "destroy")]
    assert destroys == [gone.vm_id], destroys
    assert fake_node.vms == {there.vm_id: "stopped", busy.vm_id: "missing"}


def test_an_orphan_the_node_cannot_remove_is_reported_once_and_the_pass_goes_on(fake_node):
    """A `vm destroy` the node refused ended the node's whole pass, every pass: a stopped instance whose VM
    vanished beside it stayed stopped and billed. Now the pass goes on; the refusal is one warning event, not
    one per pass, and the orphan is tried again each time."""
    node = make_listed_node(gpu_count=1)
    instance = stopped_instance(node, fake_node)
    del fake_node.vms[instance.vm_id]
    fake_node.vms["inst-999999"] = "running"
    fake_node.refused.add("inst-999999")
    for _ in range(2):
        counts = node_reconcile(node)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.FAILED, instance.status_message
    assert counts["orphans_destroyed"] == 0 and fake_node.calls.count(("vm", "destroy", "inst-999999")) == 2
    assert list(NodeEvent.objects.filter(node=node, kind__in=("vm_destroy_failed", "orphan_destroyed"))
                .values_list("kind", flat=True)) == ["vm_destroy_failed"]
    fake_node.refused.clear()
    assert node_reconcile(node)["orphans_destroyed"] == 1 and "inst-999999" not in fake_node.vms


def test_a_destroyed_instances_vm_the_node_cannot_remove_keeps_its_gpu(fake_node):
    node = make_listed_node(gpu_count=1)
    instance = running_instance(node, fake_node)
    svc.instance_interrupt(instance_id=instance.pk, since=timezone.now(), cause=InterruptionCause.NODE_LOST,
                           detail="no answer")
    svc.instance_destroy(instance=Instance.objects.get(pk=instance.pk))  # at once: its node away, GPU kept
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.DESTROYED and _gpu(node) == "rented"
    fake_node.refused.add(instance.vm_id)
    node_reconcile(node)
    assert _gpu(node) == "rented" and instance.vm_id in fake_node.vms
    fake_node.refused.clear()
    node_reconcile(node)
    assert _gpu(node) == "free" and instance.vm_id not in fake_node.vms


def test_an_orphan_gone_by_itself_before_its_destroy_is_no_event(fake_node):
    """Listed, then gone when its destroy came (existed: false): nothing was destroyed, nothing is reported."""
    node = make_listed_node(gpu_count=1)
    fake_node.vms["inst-999999"] = "stopped"
    fake_node.on_list.append(lambda: fake_node.vms.pop("inst-999999"))
    assert node_reconcile(node)["orphans_destroyed"] == 0
    assert not NodeEvent.objects.filter(node=node, kind="orphan_destroyed").exists()


def test_a_running_instance_whose_vm_is_listed_missing_once_is_interrupted_not_failed(fake_node):
    """Belt and braces over the agent's own check (a libvirt lookup that failed for a moment read as missing, found
    by review): one `missing` in the list fails no running instance. It is interrupted (billing stops, the renter
    is told and credited), keeps its GPU, and no start is queued; found running at the next look, it resumes. Before,
    the one answer failed it and freed its GPU, and the next pass stopped its VM as a failed instance's."""
    node = make_listed_node(gpu_count=1)
    instance = running_instance(node, fake_node)
    fake_node.vms[instance.vm_id] = "missing"
    counts = node_reconcile(node)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.INTERRUPTED, instance.status_message  # before: failed
    assert counts["instances_failed"] == 0 and _gpu(node) == "rented"
    assert not Job.objects.filter(OPEN, instance=instance).exists()  # nothing to start: its VM may be gone
    assert NodeEvent.objects.filter(node=node, kind="vm_missing", message__contains=f"instance {instance.pk} ")
    fake_node.vms[instance.vm_id] = "running"
    counts = node_reconcile(node)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.RUNNING and counts["resumed"] == 1
    assert ("vm", "stop", instance.vm_id) not in fake_node.calls and _gpu(node) == "rented"


# ------------------------------------------------------------------ a stopped disk found gone, billed past its sighting

def _disk_paid(instance) -> int:
    """What the renter's wallet paid for the instance's disk, net of what came back (the ledger's word)."""
    charges = list(LedgerTransaction.objects.filter(kind=TransactionKind.STORAGE,
                                                    idempotency_key__startswith=f"storage:disk:{instance.pk}:"))
    txns = charges + list(LedgerTransaction.objects.filter(reverses__in=charges))
    return -sum(e.amount_micros for t in txns for e in t.entries.select_related("account")
                if e.account.kind == AccountKind.CUSTOMER_WALLET and e.account.user_id == instance.renter_id)


def _stopped_disk_gone(fake_node) -> tuple[Instance, int]:
    """A 500 GB disk stopped an hour ago, last seen by the node's health check 10 min ago, gone from the node since.
    Returns the instance and what its disk costs up to that sighting (all it is to pay)."""
    node = make_listed_node(gpu_count=1)
    instance = stopped_instance(node, fake_node, stopped_ago=timedelta(hours=1))
    Instance.objects.filter(pk=instance.pk).update(disk_gb=500, disk_price_per_gb_month_micros=300_000)
    sighting = timezone.now() - timedelta(minutes=10)
    type(node).objects.filter(pk=node.pk).update(last_seen_at=sighting)
    del fake_node.vms[instance.vm_id]
    instance.refresh_from_db()
    seconds = int((sighting - instance.stopped_at).total_seconds())
    return instance, storage_cost(size_gb=500, price_per_gb_month_micros=300_000, seconds=seconds)


@pytest.mark.parametrize("verb", ["start", "destroy"])
def test_a_request_while_the_node_lists_its_vms_is_not_billed_for_the_lost_disk_after_its_sighting(fake_node, verb):
    """The renter's start or destroy of a stopped instance came while the node answered its list, which does not
    show the VM (its disk gone, last seen by the node's health check 10 min before): the request billed the disk up
    to itself, and the pass, finding the instance no longer stopped, left it. The disk's charge ends at the sighting,
    as the health check's (fleet_record._disk_after_loss_given_back) and the failure's would: before, the renter
    paid those 10 min of a disk that was gone."""
    instance, due = _stopped_disk_gone(fake_node)
    fake_node.on_list.append(lambda: getattr(svc, f"instance_{verb}")(instance=Instance.objects.get(pk=instance.pk)))
    node_reconcile(node=instance.node)
    instance.refresh_from_db()
    assert instance.status != InstanceStatus.FAILED
    assert due > 0 and _disk_paid(instance) == due
    assert BillingEvent.objects.filter(user_id=instance.renter_id, kind=EventKind.CREDIT,
                                       data__instance=instance.pk, data__disk=True).count() == 1
    node_reconcile(node=instance.node)  # once
    assert _disk_paid(instance) == due


@pytest.mark.parametrize("verb", ["start", "destroy"])
def test_a_request_before_the_pass_fails_the_stopped_instance_is_not_billed_for_the_lost_disk(fake_node, monkeypatch,
                                                                                              verb):
    """The same request, after the list was read but before the pass came to fail the stopped instance
    (_judge_stopped: the failure, decided under its row lock, leaves it): its disk is billed up to the sighting."""
    instance, due = _stopped_disk_gone(fake_node)
    fail = svc.instance_mark_failed

    def asked_first(**kwargs):
        getattr(svc, f"instance_{verb}")(instance=Instance.objects.get(pk=instance.pk))
        return fail(**kwargs)
    monkeypatch.setattr(svc, "instance_mark_failed", asked_first)
    node_reconcile(node=instance.node)
    instance.refresh_from_db()
    assert instance.status != InstanceStatus.FAILED
    assert due > 0 and _disk_paid(instance) == due


def test_a_stopped_instance_failed_for_its_lost_disk_is_billed_up_to_its_sighting(fake_node):
    """Still stopped when the pass fails it: billed up to the sighting by the failure; nothing to give back."""
    instance, due = _stopped_disk_gone(fake_node)
    node_reconcile(node=instance.node)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.FAILED and _disk_paid(instance) == due
    assert not BillingEvent.objects.filter(user_id=instance.renter_id, kind=EventKind.CREDIT).exists()
