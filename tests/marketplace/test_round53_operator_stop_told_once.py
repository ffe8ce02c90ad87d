"""An operator's Stop of a renter's instance tells the renter once, when it is stopped (review r53): the operator's
notice ("its disk is kept", with the reason) was sent when the stop was asked, and the worker's confirmation then
sent the generic "Instance stopped" as well; a stop that never reached the server (the instance running again)
had still told the renter it was stopped."""
import pytest

from marketplace.models import Instance, InstanceStatus, Node, NodeState
from marketplace.services import instances as instance_svc
from notifications.models import Kind, Notification
from provisioning import tasks
from provisioning.models import Job, JobKind
from tests.factories import make_listed_node
from tests.provisioning.test_vm_job_failures import (  # noqa: F401 (fixtures)
    RETRIES_SPENT,
    fake_node,
    run_in_worker,
    running_instance,
    sent_jobs,
)

pytestmark = pytest.mark.django_db

REASON = "Mining on a rental, against the terms"
STOP_NOTICES = [Kind.INSTANCE_STOPPED, Kind.INSTANCE_STOPPED_BY_OPERATOR]


def _stop_notices(instance) -> list[Notification]:
    return list(Notification.objects.filter(user=instance.renter, kind__in=STOP_NOTICES))


def _stop_job(instance) -> Job:
    return Job.objects.get(instance=instance, kind=JobKind.INSTANCE_STOP)


def test_an_operators_stop_is_told_once_when_the_worker_has_stopped_it(fake_node):  # noqa: F811
    instance = running_instance(make_listed_node(gpu_count=1), fake_node)
    instance_svc.instance_end_by_operator(instance=instance, action="stop", reason=REASON)
    assert _stop_notices(instance) == []  # not yet: the stop may still fail
    run_in_worker(tasks.instance_stop, _stop_job(instance))
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.STOPPED
    [told] = _stop_notices(instance)
    assert told.kind == Kind.INSTANCE_STOPPED_BY_OPERATOR
    assert "operator" in told.body and REASON in told.body and "disk is kept" in told.body


def test_an_operators_stop_that_never_reached_the_server_tells_nothing(fake_node):  # noqa: F811
    instance = running_instance(make_listed_node(gpu_count=1), fake_node)
    instance_svc.instance_end_by_operator(instance=instance, action="stop", reason=REASON)
    fake_node.unreachable = True
    run_in_worker(tasks.instance_stop, _stop_job(instance), retries=RETRIES_SPENT)
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.RUNNING
    assert _stop_notices(instance) == []


def test_the_renters_own_stop_after_an_operators_is_the_generic_notice(fake_node):  # noqa: F811
    instance = running_instance(make_listed_node(gpu_count=1), fake_node)
    instance_svc.instance_end_by_operator(instance=instance, action="stop")
    run_in_worker(tasks.instance_stop, _stop_job(instance))
    [told] = _stop_notices(instance)
    assert told.kind == Kind.INSTANCE_STOPPED_BY_OPERATOR and "Contact support" in told.body
    instance_svc.instance_start(instance=instance)
    run_in_worker(tasks.instance_start, Job.objects.get(instance=instance, kind=JobKind.INSTANCE_START))
    instance_svc.instance_stop(instance=Instance.objects.get(pk=instance.pk))
    run_in_worker(tasks.instance_stop, Job.objects.filter(instance=instance, kind=JobKind.INSTANCE_STOP).first())
    assert [n.kind for n in _stop_notices(instance)] == [Kind.INSTANCE_STOPPED, Kind.INSTANCE_STOPPED_BY_OPERATOR]


def test_an_operators_stop_on_a_quarantined_node_is_told_once(fake_node):  # noqa: F811
    instance = running_instance(make_listed_node(gpu_count=1), fake_node)
    Node.objects.filter(pk=instance.node_id).update(state=NodeState.QUARANTINED)
    instance_svc.instance_end_by_operator(instance=instance, action="stop", reason=REASON)
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.STOPPED  # at once: no job reaches it
    [told] = _stop_notices(instance)
    assert told.kind == Kind.INSTANCE_STOPPED_BY_OPERATOR and REASON in told.body
