"""Where the platform takes no simulated GPUs (settings.SIM_NODES_ALLOWED off), a sim node registered while it did
is off the offers and refuses bookings and volumes (offer_rules.node_refusal, models.nodes.offerable), but the start
of a stopped instance on it went ahead: it took the node's "GPUs" again and ran the renter, billed at a GPU's price,
on hardware that is no GPU. A start is new load, refused as a booking is: a 409 naming the reason. What runs there
already is left alone, as for a deactivated provider's node (a restart keeps the GPUs it holds)."""
import pytest
from django.test import override_settings
from django.utils import timezone

from core.errors import Conflict
from marketplace.models import Gpu, Instance, InstanceStatus
from marketplace.services import instances as svc
from provisioning.models import OPEN, Job, JobKind, JobStatus
from tests.factories import make_listed_node

from .renting_helpers import add_key, book, run, sent_jobs_fixture  # noqa: F401

pytestmark = pytest.mark.django_db


def _close_jobs() -> None:
    Job.objects.filter(OPEN).update(status=JobStatus.SUCCEEDED, finished_at=timezone.now())


def running(user, node) -> Instance:
    instance = run(book(user, node))
    _close_jobs()
    return Instance.objects.get(pk=instance.pk)


def stopped(user, node) -> Instance:
    instance = running(user, node)
    svc.instance_stop(instance=instance)
    svc.instance_mark_stopped(instance_id=instance.pk)
    _close_jobs()
    return Instance.objects.get(pk=instance.pk)


def test_a_start_on_a_sim_node_is_refused_where_simulated_gpus_are_not_taken(api):
    node = make_listed_node(runtime="sim", gpu_count=1)
    instance = stopped(api.user, node)
    with override_settings(SIM_NODES_ALLOWED=False):
        with pytest.raises(Conflict, match="simulated"):
            svc.instance_start(instance=instance)
        r = api.post(f"/api/v1/instances/{instance.pk}/start/")
        assert r.status_code == 409 and "simulated" in str(r.json()), r.json()
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.STOPPED
    assert not Job.objects.filter(instance=instance, kind=JobKind.INSTANCE_START).exists()
    assert Gpu.objects.get(node=node, index=0).status == "free"


def test_it_still_starts_where_they_are_taken_and_on_a_real_node(user):
    """Coverage: the tests and the demo take simulated GPUs; a docker node is not concerned."""
    sim = make_listed_node(runtime="sim", gpu_count=1)
    assert svc.instance_start(instance=stopped(user, sim)).status == InstanceStatus.STARTING
    real = make_listed_node(runtime="docker", gpu_count=1)
    instance = stopped(user, real)
    with override_settings(SIM_NODES_ALLOWED=False):
        assert svc.instance_start(instance=instance).status == InstanceStatus.STARTING


def test_a_running_instance_on_it_is_left_alone(user):
    """Decided, not a gap: a restart keeps the GPUs it holds (no new load), and a stop or destroy ends load."""
    node = make_listed_node(runtime="sim", gpu_count=1)
    instance = running(user, node)
    with override_settings(SIM_NODES_ALLOWED=False):
        assert svc.instance_restart(instance=instance).status == InstanceStatus.STARTING
