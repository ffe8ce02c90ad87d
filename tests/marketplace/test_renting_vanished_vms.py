"""A VM that is gone, or no longer running, under an instance the platform bills: billing ends at the last moment
the VM was seen alive, and the renter is told, whichever part of the platform finds it (the reconciler, a job that
drives the VM, a node it stopped talking to).

The VM's last sighting is the node's last health check: its answer lists the node's VMs, and every instance whose VM
it does not show running is interrupted by that check (billing closed at the check before); so each instance still
running after it was seen alive by it (or started after it, and seen by its own start). The meter bills no further
than that check (billing.services.metering).

Real parts: a simulated server over SSH with the real agent (tests/marketplace/sim_renting.py), the fleet's health
check and reconciler, PostgreSQL. The VM goes as it does on a server: the provider's own `vm destroy` or `vm stop`,
not the platform's."""
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from billing.models import BillingEvent, EventKind
from billing.services.metering import usage_meter
from marketplace.models import Instance, InstanceStatus, Interruption, Node
from marketplace.services import instances as instance_svc
from provisioning import tasks
from provisioning.models import JobKind
from provisioning.services.maintenance import nodes_health_check
from provisioning.services.nodes import node_quarantine
from provisioning.services.reconcile import node_reconcile
from tests.billing.invariants import assert_billing_invariants

from .sim_renting import (  # noqa: F401 (fixtures)
    backdate,
    deliver_until_closed,
    gpu0,
    job_of,
    node_agent,
    running_instance,
    sent_jobs_fixture,
    sim_node_fixture,
    simbase_fixture,
    simnode_fixture,
    stopped_instance,
    vm_state,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def seen_by_a_health_check(node) -> Node:
    """A health check that sees the node's VMs (as beat runs it every minute); the node after it."""
    assert nodes_health_check()["failed"] == 0
    return Node.objects.get(pk=node.pk)


def events(instance: Instance) -> set[str]:
    return set(BillingEvent.objects.filter(user_id=instance.renter_id).values_list("kind", flat=True))


# ------------------------------------------------------------------------------------------- the reconciler

def test_a_vm_gone_before_the_reconciler_came_is_billed_up_to_the_check_that_saw_it_and_the_renter_told(sim_node):
    instance = backdate(running_instance(sim_node), minutes=10)
    node = seen_by_a_health_check(sim_node)
    usage_meter()  # the tick: up to that check
    node_agent(instance, "destroy")  # the provider removed it (or the server lost it) after the check
    time.sleep(1.5)  # the reconciler comes later than the check
    node_reconcile(node)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.FAILED, instance.status_message
    # Before: billed up to the reconciler's pass, for a VM that was gone; the renter got a failure and no word of
    # an interruption, nor its credit.
    assert instance.billed_until <= node.last_seen_at
    interruption = Interruption.objects.get(instance=instance)
    assert (interruption.cause, interruption.outcome) == ("vm_lost", "failed")
    assert interruption.started_at == node.last_seen_at
    assert {EventKind.INSTANCE_INTERRUPTED, EventKind.INSTANCE_LOST} <= events(instance)
    billed = instance.billed_seconds
    usage_meter()
    assert Instance.objects.get(pk=instance.pk).billed_seconds == billed
    assert gpu0(sim_node) == "free"
    assert_billing_invariants()


def test_a_vm_found_stopped_by_the_reconciler_is_interrupted_at_the_check_that_saw_it_and_started_again(sim_node):
    instance = backdate(running_instance(sim_node), minutes=10)
    node = seen_by_a_health_check(sim_node)
    node_agent(instance, "stop")  # it stopped on the server (a crash, or its provider) after the check
    time.sleep(1.5)
    node_reconcile(node)
    instance.refresh_from_db()
    # Before: left running, billed again by each tick after the next health check, until that check noticed.
    assert instance.status == InstanceStatus.STARTING, instance.status_message
    assert instance.billed_until <= node.last_seen_at
    interruption = Interruption.objects.get(instance=instance)
    assert interruption.cause == "vm_lost" and interruption.started_at == node.last_seen_at
    deliver_until_closed(tasks.instance_start, job_of(instance, JobKind.INSTANCE_START))
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.RUNNING and vm_state(instance) == "running"
    assert Interruption.objects.get(instance=instance).outcome == "restarted"
    assert_billing_invariants()


# ----------------------------------------------------------------------------------- a job finds it gone

def test_a_stop_that_finds_the_vm_gone_fails_the_instance_rather_than_bill_a_disk_that_is_not_there(sim_node):
    instance = running_instance(sim_node)
    node_agent(instance, "destroy")
    instance_svc.instance_stop(instance=instance)
    deliver_until_closed(tasks.instance_stop, job_of(instance, JobKind.INSTANCE_STOP))
    instance.refresh_from_db()
    # Before: "Stopped; the disk is kept", its disk billed every minute until the reconciler's pass.
    assert instance.status == InstanceStatus.FAILED, instance.status_message
    assert "no longer on the server" in instance.status_message
    assert gpu0(sim_node) == "free" and not instance.vm_cleanup_pending


def test_a_start_that_finds_the_vm_gone_fails_the_instance_rather_than_leave_it_stopped(sim_node):
    instance = stopped_instance(sim_node)
    node_agent(instance, "destroy")
    instance_svc.instance_start(instance=instance)
    deliver_until_closed(tasks.instance_start, job_of(instance, JobKind.INSTANCE_START))
    instance.refresh_from_db()
    # Before: stopped again ("start it again"), its disk billed, a start that could never work offered.
    assert instance.status == InstanceStatus.FAILED, instance.status_message
    assert "no longer on the server" in instance.status_message
    assert gpu0(sim_node) == "free"


# -------------------------------------------------------------------------------- a node it no longer sees

def test_a_quarantined_nodes_running_instance_is_interrupted_at_its_last_check(sim_node):
    instance = backdate(running_instance(sim_node), minutes=10)
    node = seen_by_a_health_check(sim_node)
    time.sleep(1.5)
    # Its host key changed: the platform talks to it no more (no check, no job) until an operator decides.
    node_quarantine(node_id=node.pk, seen="SHA256:" + "A" * 43)
    instance.refresh_from_db()
    # Before: left running, its renter never told (its checks stopped before they could interrupt it).
    assert instance.status == InstanceStatus.INTERRUPTED, instance.status_message
    assert instance.billed_until <= node.last_seen_at
    assert Interruption.objects.get(instance=instance).started_at == node.last_seen_at
    assert EventKind.INSTANCE_INTERRUPTED in events(instance)
    assert_billing_invariants()


def test_a_stopped_disk_on_a_quarantined_node_is_billed_up_to_its_last_check_not_up_to_the_destroy(sim_node):
    instance = stopped_instance(sim_node)
    Instance.objects.filter(pk=instance.pk).update(stopped_at=timezone.now() - timedelta(minutes=10))
    instance.refresh_from_db()
    node = seen_by_a_health_check(sim_node)
    node_quarantine(node_id=node.pk, seen="SHA256:" + "A" * 43)
    time.sleep(1.5)
    instance_svc.instance_destroy(instance=instance)
    instance.refresh_from_db()
    # Before: its disk billed up to the destroy, for time in which nobody could know whether it was there.
    assert instance.disk_billed_until <= node.last_seen_at
    assert_billing_invariants()
