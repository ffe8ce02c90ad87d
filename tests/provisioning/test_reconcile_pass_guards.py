"""The reconciler's pass against a node that refuses or garbles part of its answer, and against an instance that
changes while the node lists its VMs (provisioning/services/reconcile.py; found by review, each test failed before
its fix)."""
import pytest
from django.utils import timezone

from marketplace.models import Instance, InstanceStatus, Interruption, InterruptionCause, Node, NodeState
from marketplace.services import instances as svc
from provisioning.models import Job, JobKind, JobStatus, NodeEvent
from provisioning.services import fleet
from provisioning.services.nodes import HealthResult
from provisioning.services.reconcile import node_reconcile
from provisioning.ssh_errors import AgentFailed, AgentGarbage
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book, run

pytestmark = pytest.mark.django_db

ORPHAN = "vol-0123456789abcdef"


@pytest.fixture(autouse=True)
def sent_jobs(monkeypatch):
    sent = []
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: sent.append((job_id, kind)))
    return sent


class VolumeRefusingNode:
    """A node with one orphan volume (no VM of its records mounts it) whose `volume delete` its engine refuses:
    an unrecorded container the reconciler failed to remove still mounts it."""

    def __init__(self, vms):
        self.vms = dict(vms)
        self.deletes = 0

    def session(self, node, *args, **kwargs):
        fake = self

        class Session:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def agent(self, cmd, sub=None, request=None, timeout=None):
                if (cmd, sub) == ("vm", "list"):
                    return {"vms": [{"vm_id": k, "state": v} for k, v in fake.vms.items()]}
                if (cmd, sub) == ("volume", "list"):
                    return {"volumes": [{"name": ORPHAN, "size_gb": 1, "used_by": []}]}
                if (cmd, sub) == ("volume", "delete"):
                    fake.deletes += 1
                    raise AgentFailed({"code": "command_failed", "message": "docker volume rm: volume is in use"})
                return {"vm_id": (request or {}).get("vm_id"), "state": "running"}

        return Session()


# ------------------------------------------------------------------ an orphan volume the node cannot delete

def test_an_orphan_volume_the_node_cannot_delete_does_not_end_the_reconcile_pass(monkeypatch):
    """Unguarded, the node's refusal (AgentFailed) ended the pass, every pass. Now it is reported once, for
    operators, and tried again at the next pass."""
    node = make_listed_node(UserFactory(), gpu_count=1)
    fake = VolumeRefusingNode({})
    monkeypatch.setattr("provisioning.services.reconcile.node_session", fake.session)
    counts = node_reconcile(node)
    counts_again = node_reconcile(node)
    assert fake.deletes == 2  # tried again at the next pass
    assert counts["orphan_volumes_deleted"] == counts_again["orphan_volumes_deleted"] == 0
    events = NodeEvent.objects.filter(node=node, kind="orphan_volume_delete_failed")
    assert events.count() == 1 and ORPHAN in events.get().message and "in use" in events.get().message
    assert not NodeEvent.objects.filter(node=node, kind="orphan_volume_deleted").exists()


@pytest.mark.django_db(transaction=True)  # the health batch reconciles recovering nodes in threads of their own
def test_a_node_back_after_an_outage_with_an_undeletable_orphan_volume_is_not_kept_offline(monkeypatch):
    """The health check reconciles a node that answers after an outage: the refusal made its good answer a failed
    check ("it answered, but reconciling its VMs failed"), the node stayed offline, and its renters were resumed
    and interrupted again at every check."""
    node = make_listed_node(UserFactory(), gpu_count=1)
    instance = run(book(UserFactory(), node))
    Job.objects.filter(instance=instance).update(status=JobStatus.SUCCEEDED, finished_at=timezone.now())
    svc.instance_interrupt(instance_id=instance.pk, since=timezone.now(), cause=InterruptionCause.NODE_LOST,
                           detail="silent")
    Node.objects.filter(pk=node.pk).update(state=NodeState.OFFLINE, health_failures=5)
    monkeypatch.setattr("provisioning.services.reconcile.node_session",
                        VolumeRefusingNode({instance.vm_id: "running"}).session)
    monkeypatch.setattr(fleet, "nodes_probe", lambda nodes, *args, **kwargs: [
        HealthResult(n.pk, True, "", vms={instance.vm_id: "running"}, probed_at=timezone.now()) for n in nodes])
    fleet.nodes_health_batch([node.pk], pool=object())
    node.refresh_from_db()
    instance.refresh_from_db()
    assert (node.state, node.health_failures) == (NodeState.ACTIVE, 0), (node.state, node.health_failures,
                                                                         node.last_error)
    assert instance.status == InstanceStatus.RUNNING, instance.status_message


# ------------------------------------------------------------- an instance restarted while the node listed its VMs

def _restart_done_meanwhile(fake, instance):
    """The renter's restart, asked and finished while the node answers `vm list` (listed mid-restart: stopped)."""
    def restart():
        svc.instance_restart(instance=Instance.objects.get(pk=instance.pk))
        svc.instance_mark_running(instance_id=instance.pk, ssh_host="10.0.0.1", ssh_port=40001, ssh_user="root",
                                  message="Running (restarted)")
        Job.objects.filter(instance=instance).update(status=JobStatus.SUCCEEDED, finished_at=timezone.now())
        fake.vms[instance.vm_id] = "running"
    return restart


def test_an_instance_restarted_while_the_node_listed_its_vms_is_not_interrupted(monkeypatch):
    """Running before and after the list, it was judged by it: interrupted (the renter told, credited at the
    provider's expense) and a START job queued, for a VM the list showed mid-restart. Only an instance whose
    current run began before the list is judged by it, as the health check does (`started_before`)."""
    from tests.provisioning.test_reconcile_instances import FakeNode

    fake = FakeNode()
    monkeypatch.setattr("provisioning.services.reconcile.node_session", fake.session)
    node = make_listed_node(UserFactory(), gpu_count=1)
    instance = run(book(UserFactory(), node))
    Job.objects.filter(instance=instance).update(status=JobStatus.SUCCEEDED, finished_at=timezone.now())
    fake.vms[instance.vm_id] = "stopped"  # listed mid-restart
    fake.on_list.append(_restart_done_meanwhile(fake, instance))
    node_reconcile(node)
    instance.refresh_from_db()
    assert not Interruption.objects.filter(instance=instance).exists(), instance.status_message
    assert instance.status == InstanceStatus.RUNNING, instance.status_message
    assert not Job.objects.filter(instance=instance, kind=JobKind.INSTANCE_START).exists()


def test_an_instance_restarted_after_the_reconciler_read_it_is_not_interrupted_either(monkeypatch):
    """The same restart finished after the pass read the database (its running row, started before the list), and
    before the pass interrupts it: decided under the instance's row lock, by its current run."""
    from provisioning.services import reconcile
    from tests.provisioning.test_reconcile_instances import FakeNode

    fake = FakeNode()
    monkeypatch.setattr("provisioning.services.reconcile.node_session", fake.session)
    node = make_listed_node(UserFactory(), gpu_count=1)
    instance = run(book(UserFactory(), node))
    Job.objects.filter(instance=instance).update(status=JobStatus.SUCCEEDED, finished_at=timezone.now())
    fake.vms[instance.vm_id] = "stopped"
    restart = _restart_done_meanwhile(fake, instance)
    judge = reconcile._running_vm_lost

    def restarted_first(*args, **kwargs):
        restart()
        return judge(*args, **kwargs)
    monkeypatch.setattr(reconcile, "_running_vm_lost", restarted_first)
    node_reconcile(node)
    instance.refresh_from_db()
    assert not Interruption.objects.filter(instance=instance).exists(), instance.status_message
    assert instance.status == InstanceStatus.RUNNING, instance.status_message


def test_an_instance_running_since_before_the_list_whose_vm_it_shows_stopped_is_still_interrupted(monkeypatch):
    from tests.provisioning.test_reconcile_instances import FakeNode

    fake = FakeNode()
    monkeypatch.setattr("provisioning.services.reconcile.node_session", fake.session)
    node = make_listed_node(UserFactory(), gpu_count=1)
    instance = run(book(UserFactory(), node))
    Job.objects.filter(instance=instance).update(status=JobStatus.SUCCEEDED, finished_at=timezone.now())
    fake.vms[instance.vm_id] = "stopped"
    counts = node_reconcile(node)
    instance.refresh_from_db()
    assert Interruption.objects.filter(instance=instance, cause=InterruptionCause.VM_LOST).count() == 1
    assert counts["restarted"] == 1 and instance.status == InstanceStatus.STARTING
    assert Job.objects.filter(instance=instance, kind=JobKind.INSTANCE_START).count() == 1


# ------------------------------------------------------------------------- the node's garbage in its lists

class Lists:
    """A node answering `vm list` and `volume list` with what the test gives, as its provider may make it."""

    def __init__(self, vms, volumes):
        self.vms, self.volumes, self.calls = vms, volumes, []

    def session(self, node, *args, **kwargs):
        fake = self

        class Session:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def agent(self, cmd, sub=None, request=None, timeout=None):
                fake.calls.append((cmd, sub))
                if (cmd, sub) == ("vm", "list"):
                    return {"vms": fake.vms}
                if (cmd, sub) == ("volume", "list"):
                    return {"volumes": fake.volumes}
                return {}
        return Session()


@pytest.mark.parametrize("used_by", [[1], [None], 5, "inst-1", "", {"inst-1": True}, [["inst-1"]]])
def test_a_volume_list_whose_used_by_is_no_list_of_vm_names_is_the_nodes_garbage(monkeypatch, used_by):
    """`', '.join(vol['used_by'])` of [1] raised TypeError out of the pass (the fleet batch counts it an error of
    its own, not the node's); a string or an object was read as the VMs mounting it, and an empty string as none,
    so the volume was deleted. The node's garbage (AgentGarbage): its volumes are left for the next pass, its VMs
    reconciled all the same."""
    fake = Lists([], [{"name": ORPHAN, "size_gb": 1, "used_by": used_by}])
    monkeypatch.setattr("provisioning.services.reconcile.node_session", fake.session)
    node = make_listed_node(UserFactory(), gpu_count=1)
    try:
        counts = node_reconcile(node)
    except TypeError as exc:
        raise AssertionError(f"the node's garbage crashed the reconcile: {exc!r}") from exc
    assert counts["orphan_volumes_deleted"] == 0 and ("volume", "delete") not in fake.calls
    assert not NodeEvent.objects.filter(node=node, kind__startswith="orphan_volume").exists()


def test_a_volume_list_whose_used_by_is_left_out_or_empty_is_no_vm_mounting_it(monkeypatch):
    fake = Lists([], [{"name": ORPHAN, "size_gb": 1}, {"name": "vol-fedcba9876543210", "size_gb": 1,
                                                       "used_by": []}])
    monkeypatch.setattr("provisioning.services.reconcile.node_session", fake.session)
    node = make_listed_node(UserFactory(), gpu_count=1)
    assert node_reconcile(node)["orphan_volumes_deleted"] == 2


@pytest.mark.parametrize("vm", [{"state": 5}, {"state": None}, {"state": ["running"]}, {},
                                {"state": "unknown", "error": {"why": "x"}}])
def test_a_vm_list_whose_state_is_no_string_is_the_nodes_garbage_not_a_lost_vm(monkeypatch, vm):
    """A VM listed with no state, or one that is no string, was judged not running: its renter's running instance
    interrupted (told, credited at the provider's expense) and started again. The node's garbage: nothing is
    judged by that list."""
    node = make_listed_node(UserFactory(), gpu_count=1)
    instance = run(book(UserFactory(), node))
    Job.objects.filter(instance=instance).update(status=JobStatus.SUCCEEDED, finished_at=timezone.now())
    monkeypatch.setattr("provisioning.services.reconcile.node_session",
                        Lists([{"vm_id": instance.vm_id, **vm}], []).session)
    with pytest.raises(AgentGarbage, match="`vms` list"):
        node_reconcile(node)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.RUNNING and not Interruption.objects.filter(instance=instance).exists()
