"""The reconciler and a running or interrupted instance whose container the engine keeps restarting (the agent's
"restarting", docker; found by the second review): judged lost, the running instance was interrupted, its renter
credited at the provider's expense and the VM started again, every pass. It is left running on its GPUs, billed,
its renter told once; the message goes when the VM runs again. (A stopped or failed instance's restarting VM is
stopped: test_reconcile_instances.py.)"""
import pytest

from marketplace.models import Instance, InstanceStatus, Interruption, InterruptionCause
from marketplace.services import instances as svc
from provisioning.services.fleet_record import RESTARTING_MESSAGE
from provisioning.services.reconcile import node_reconcile
from tests.factories import make_listed_node
from tests.provisioning.test_reconcile_instances import fake_node, running_instance, sent_jobs  # noqa: F401

pytestmark = pytest.mark.django_db


def test_a_running_instances_restarting_vm_is_not_lost(fake_node):  # noqa: F811
    node = make_listed_node(gpu_count=1)
    instance = running_instance(node, fake_node)
    fake_node.vms[instance.vm_id] = "restarting"
    for _ in range(2):
        counts = node_reconcile(node)
        assert counts["restarted"] == counts["instances_failed"] == 0, counts
        instance.refresh_from_db()
        assert (instance.status, instance.status_message) == (InstanceStatus.RUNNING, RESTARTING_MESSAGE)
    assert not Interruption.objects.filter(instance=instance).exists()
    assert [c for c in fake_node.calls if c[0] == "vm" and c[1] != "list"] == []  # neither stopped nor started
    fake_node.vms[instance.vm_id] = "running"  # its command runs again
    node_reconcile(node)
    instance.refresh_from_db()
    assert (instance.status, instance.status_message) == (InstanceStatus.RUNNING, "")


def test_an_interrupted_instances_restarting_vm_resumes_it(fake_node):  # noqa: F811
    """Interrupted for another cause (its node silent a while): its container, restarting as before, is the
    renter's own; the instance resumes as for a running VM, not started again as for a stopped one."""
    node = make_listed_node(gpu_count=1)
    instance = running_instance(node, fake_node)
    svc.instance_interrupt(instance_id=instance.pk, since=None, cause=InterruptionCause.NODE_LOST, detail="silent")
    fake_node.vms[instance.vm_id] = "restarting"
    counts = node_reconcile(node)
    assert (counts["resumed"], counts["restarted"]) == (1, 0), counts
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.RUNNING
