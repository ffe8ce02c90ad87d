"""A failed volume left on a retired node (its creation failed; a failed volume does not hold a retire back): its
delete sent a job to a server the platform never talks to again, and the volume read `deleting` ("deleted there when
the server answers again") for ever (found by review r51)."""
import pytest
from django.utils import timezone

from core.errors import Conflict
from marketplace.models import NodeState, Volume
from marketplace.services import nodes as node_svc
from marketplace.services import volumes as volume_svc
from provisioning.models import Job
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import sent_jobs_fixture  # noqa: F401

pytestmark = pytest.mark.django_db


def test_deleting_a_failed_volume_of_a_retired_node_queues_no_job_there_and_ends():
    renter = UserFactory()
    node = make_listed_node(gpu_count=1)
    volume = volume_svc.volume_create(owner=renter, node_id=node.pk, size_gb=10)
    volume_svc.volume_mark_failed(volume_id=volume.pk, message="Failed: no room")  # its creation failed
    Job.objects.filter(volume=volume).update(status="failed", finished_at=timezone.now())
    node_svc.node_retire(node=node)  # a failed volume does not hold the retire back
    node.refresh_from_db()
    assert node.state == NodeState.RETIRED
    volume_svc.volume_delete(volume=volume, confirm=volume.name)  # the page offers Delete… for a failed volume
    volume = Volume.objects.get(pk=volume.pk)
    jobs = list(Job.objects.filter(volume=volume, kind="volume_delete").values_list("node__state", "status"))
    # Nothing reaches a retired server again (no reconcile either): no job there, and the volume ends at once.
    assert jobs == [] and volume.state == "deleted", (jobs, volume.state, volume.status_message)
    assert volume.status_message == volume_svc.DELETED_ON_RETIRED_NODE and volume.deleted_at is not None
    assert volume.billed_seconds == 0  # a failed volume was never billed, and is not now
    with pytest.raises(Conflict, match="already deleted"):
        volume_svc.volume_delete(volume=volume, confirm=volume.name)
