"""A health answer that lists a running instance's VM stopped (or gone) interrupts the instance only if its current
run began before the probe (`started_before`), decided under the instance's row lock. The health check read its
running instances, filtered by that, without a lock, then interrupted each under its lock asking only "still
running?": a renter's restart that finished between the two (the probe caught the VM mid-restart, stopped) left it
running, started after the probe, and it was interrupted all the same (its renter told, credited at the provider's
expense, a start queued by the next reconcile) for a VM that runs. The reconciler decides it under the lock already
(reconcile._running_vm_lost).

Real parts: a simulated server over SSH with the real agent (tests/marketplace/sim_renting.py), a real probe, the
renter's restart run as its job runs, PostgreSQL."""
import pytest
from django.db import connection, transaction

from marketplace.models import Instance, InstanceStatus, Interruption
from marketplace.services import instances as instance_svc
from provisioning import tasks
from provisioning.models import JobKind
from provisioning.services.fleet_record import nodes_record_health
from provisioning.services.nodes import node_health_probe, running_vm_ids_by_node
from tests.marketplace.sim_renting import (  # noqa: F401 (fixtures)
    backdate,
    deliver_until_closed,
    job_of,
    node_agent,
    running_instance,
    sent_jobs_fixture,
    sim_node_fixture,
    simbase_fixture,
    simnode_fixture,
    vm_state,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _restart(instance: Instance) -> None:
    """The renter's restart, asked and run to its end as the worker runs its job."""
    with transaction.atomic():
        instance_svc.instance_restart(instance=Instance.objects.get(pk=instance.pk))
    deliver_until_closed(tasks.instance_restart, job_of(instance, JobKind.INSTANCE_RESTART))


def _right_after_the_unlocked_read(then):
    """A query wrapper: `then()` once, right after the first read of instances filtered by their start that takes
    no row lock (the health check's list of those to interrupt): what another worker commits meanwhile."""
    done = []

    def wrapper(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if not done and 'FROM "marketplace_instance"' in sql and '"started_at" <' in sql and "FOR UPDATE" not in sql:
            done.append(True)
            then()
        return result
    return wrapper, done


def test_an_instance_restarted_between_the_checks_read_and_its_lock_is_not_interrupted(sim_node):
    instance = backdate(running_instance(sim_node), minutes=10)
    node_agent(instance, "stop")  # the probe finds the VM mid-restart: stopped
    result = node_health_probe(sim_node)
    assert result.ok and result.vms.get(instance.vm_id) == "stopped", result
    running = running_vm_ids_by_node(node_ids=[sim_node.pk], probed_before=result.probed_at)
    assert instance.vm_id in running[sim_node.pk]  # running since before the probe: judged by it
    wrapper, done = _right_after_the_unlocked_read(lambda: _restart(instance))
    with connection.execute_wrapper(wrapper):
        interrupted = nodes_record_health([result], running_vm_ids=running)
    assert done, "the check never read the instances it judges"
    instance.refresh_from_db()
    assert instance.started_at > result.probed_at  # its current run began after the probe
    assert interrupted == {} and not Interruption.objects.filter(instance=instance).exists(), instance.status_message
    assert instance.status == InstanceStatus.RUNNING and vm_state(instance) == "running"


def test_an_instance_running_since_before_the_probe_whose_vm_it_shows_stopped_is_still_interrupted(sim_node):
    instance = backdate(running_instance(sim_node), minutes=10)
    node_agent(instance, "stop")
    result = node_health_probe(sim_node)
    running = running_vm_ids_by_node(node_ids=[sim_node.pk], probed_before=result.probed_at)
    assert nodes_record_health([result], running_vm_ids=running) == {sim_node.pk: [instance.pk]}
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.INTERRUPTED
    assert Interruption.objects.get(instance=instance).cause == "vm_lost"
