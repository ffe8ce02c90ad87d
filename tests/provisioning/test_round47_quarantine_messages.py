"""What a renter reads when their instance is destroyed while its node is quarantined (its SSH host key changed;
no job talks to it until an operator accepts the new key): its destroy ends at once, its VM left for the node's
reconcile once the key is accepted (lifecycle._node_reach).

Before: the message was the unreachable node's, "Its server could not be reached, so the VM and its disk are
removed when it answers again", though the server answers: the platform holds it for an operator's check. Now it
says so, in the words of the restart's 409 there. An unreachable node's destroy keeps its own message.

Real parts: a simulated server over real SSH whose host key really changes (round47_quarantine_sim), the fleet's
health check, the API, the jobs as worker deliveries, PostgreSQL."""
import pytest

from marketplace.models import InstanceStatus
from provisioning import sim, tasks
from provisioning.models import Job, JobKind
from provisioning.services.maintenance import nodes_health_check
from tests.marketplace.sim_renting import deliver_until_closed, sent_jobs_fixture  # noqa: F401 (fixture)

from .round47_quarantine_sim import (  # noqa: F401 (fixtures)
    funded_renter,
    instance_running_via_api,
    qnode_fixture,
    simbase_fixture,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

URL = "/api/v1/instances/"


def _stopped(client, instance):
    assert client.post(f"{URL}{instance.pk}/stop/").status_code == 202
    deliver_until_closed(tasks.instance_stop, Job.objects.get(instance=instance, kind=JobKind.INSTANCE_STOP))
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.STOPPED, instance.status_message
    return instance


@pytest.mark.parametrize("stop_first", [False, True], ids=["running-then-interrupted", "stopped"])
def test_a_destroy_on_a_quarantined_node_says_its_host_key_changed_not_that_it_could_not_be_reached(
        qnode, client_for, stop_first):
    client = client_for(funded_renter())
    instance = instance_running_via_api(client, qnode.node)
    if stop_first:
        _stopped(client, instance)
    qnode.quarantined_by_a_health_check()  # a running one is interrupted by it

    answer = client.delete(f"{URL}{instance.pk}/")
    assert answer.status_code == 202, answer.content
    body = answer.json()
    assert body["status"] == InstanceStatus.DESTROYED
    message = body["status_message"]
    assert "could not be reached" not in message, message
    assert "quarantined" in message and "host key changed" in message and "operator" in message, message
    # The restart's 409 there says the same of the node.
    assert "its node is quarantined: its SSH host key changed" in message


def test_an_unreachable_nodes_destroy_keeps_its_message(qnode, client_for, settings):
    client = client_for(funded_renter())
    instance = _stopped(client, instance_running_via_api(client, qnode.node))
    sim.node_cut(qnode.info["ssh_port"], qnode.simbase)  # it stops answering
    for _ in range(settings.NODE_INTERRUPT_AFTER_FAILED_CHECKS):
        nodes_health_check()
    answer = client.delete(f"{URL}{instance.pk}/")
    assert answer.status_code == 202, answer.content
    message = answer.json()["status_message"]
    assert answer.json()["status"] == InstanceStatus.DESTROYED
    assert message.startswith("Destroyed. Its server could not be reached") and "host key" not in message
