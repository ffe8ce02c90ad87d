"""The health batch reconciles only nodes with something to recover (fleet._nodes_with_instances_to_recover);
a destroyed MIG instance holds no GPU allocation, and a reverse-join `isnull` counted it as holding one (found by
review: every health check of such a node ran a full reconcile)."""
import pytest
from django.utils import timezone

from marketplace.models import Instance, InstanceStatus
from marketplace.services import instances as instance_svc
from provisioning.models import Job, JobStatus
from provisioning.services import fleet
from tests.factories import UserFactory
from tests.marketplace.mig_helpers import SEVEN, make_mig_node
from tests.marketplace.renting_helpers import book, run

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def sent_jobs(monkeypatch):
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: None)


def test_a_destroyed_mig_instance_that_holds_nothing_does_not_make_every_health_check_reconcile_its_node():
    """`Q(status=DESTROYED, allocations__released_at__isnull=True)` is a reverse join (LEFT OUTER JOIN): an
    instance with no GpuAllocation rows at all -- every MIG instance, which holds slices -- matches. So a node that
    ever had a MIG instance destroyed normally (slices released, VM removed) is 'pending' forever, and each health
    check (every 60 s) runs a full node_reconcile (vm list + volume list over SSH) on it. The same trap the commit
    0aa3cfa fixed in selectors.instances_awaiting_cleanup; this copy in provisioning/services/fleet.py kept it."""
    node = make_mig_node({0: SEVEN})
    instance = run(book(UserFactory(), node, num_gpus=1, mig_profile="1g.10gb"))
    Job.objects.filter(instance=instance).update(status=JobStatus.SUCCEEDED, finished_at=timezone.now())
    instance_svc.instance_destroy(instance=Instance.objects.get(pk=instance.pk))
    instance_svc.instance_mark_destroyed(instance_id=instance.pk)  # the destroy job: VM gone, slices released
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.DESTROYED
    assert not instance.slice_allocations.filter(released_at__isnull=True).exists()
    assert fleet._nodes_with_instances_to_recover([node.pk]) == set()


def test_so_every_health_check_of_that_healthy_node_runs_a_full_reconcile(monkeypatch):
    """The consequence through the health batch: a healthy node (0 failures, active) is reconciled on every
    check, two checks -> two reconciles."""
    from provisioning.services.nodes import HealthResult

    node = make_mig_node({0: SEVEN})
    instance = run(book(UserFactory(), node, num_gpus=1, mig_profile="1g.10gb"))
    Job.objects.filter(instance=instance).update(status=JobStatus.SUCCEEDED, finished_at=timezone.now())
    instance_svc.instance_destroy(instance=Instance.objects.get(pk=instance.pk))
    instance_svc.instance_mark_destroyed(instance_id=instance.pk)
    reconciles = []
    monkeypatch.setattr(fleet, "nodes_probe", lambda nodes, parallelism, pool=None: [
        HealthResult(n.pk, True, vms={}, probed_at=timezone.now()) for n in nodes])
    monkeypatch.setattr(fleet, "node_reconcile", lambda node, pool=None: reconciles.append(node.pk) or {
        "resumed": 0, "restarted": 0, "instances_failed": 0})
    for _ in range(2):
        fleet.nodes_health_batch([node.pk], pool=object())
    assert reconciles == []
