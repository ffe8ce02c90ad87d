"""A VM command whose answer is lost: the node ran it, then the connection dropped before its answer came back.

Real parts: a simulated GPU server (a real sshd, the real agent, VMs that are real sshd processes), the platform's
own SSH client, PostgreSQL; the job runs in this process as a worker delivery would run it. The fault is made on
the node itself: the agent's command runs to its end, then the SSH connection's own sshd process is killed
(`kill -KILL $PPID`), so the platform reads what a dropped connection really gives (the agent "printed nothing").

What must hold whatever answer is lost: the instance ends where the VM really is (a stop whose answer is lost is
stopped, a start whose answer is lost is running, a destroyed VM's instance destroyed), never running-and-billed
on a stopped VM nor stopped-and-unbilled on a running one; GPU time is billed up to the stop's request, and from
the moment a start is confirmed."""
from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.models import Instance, InstanceStatus
from marketplace.services import instances as instance_svc
from provisioning import tasks
from provisioning.models import JobKind, JobStatus
from tests.factories import UserFactory
from tests.marketplace.renting_helpers import book

from .sim_renting import (  # noqa: F401 (fixtures)
    backdate,
    deliver_until_closed,
    gpu0,
    job_of,
    lost_fixture,
    running_instance,
    sent_jobs_fixture,
    sim_node_fixture,
    simbase_fixture,
    simnode_fixture,
    stopped_instance,
    vm_state,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


# ----------------------------------------------------------------------------------------------------- stop

def test_a_stop_whose_answer_is_lost_is_confirmed_stopped_and_billed_up_to_the_request(sim_node, lost):
    instance = backdate(running_instance(sim_node), minutes=10)
    asked = timezone.now()
    instance_svc.instance_stop(instance=instance)
    lost.lose[("vm", "stop")] = 1
    deliver_until_closed(tasks.instance_stop, job_of(instance, JobKind.INSTANCE_STOP))
    instance.refresh_from_db()
    assert vm_state(instance) == "stopped"
    assert instance.status == InstanceStatus.STOPPED, instance.status_message
    assert not instance.vm_cleanup_pending and gpu0(sim_node) == "free"  # confirmed: the GPU is free for others
    assert "did not confirm" not in instance.status_message
    assert job_of(instance, JobKind.INSTANCE_STOP).status == JobStatus.SUCCEEDED  # the node did its part
    assert asked - timedelta(seconds=2) <= instance.billed_until <= asked  # ten minutes, up to the request
    assert instance.billed_seconds >= 598 and instance.cost_micros == 1_000_000 * instance.billed_seconds // 3600


def test_a_stop_whose_answer_is_lost_each_time_ends_stopped_never_running(sim_node, lost):
    instance = running_instance(sim_node)
    instance_svc.instance_stop(instance=instance)
    billed = Instance.objects.get(pk=instance.pk).billed_seconds
    lost.lose[("vm", "stop")] = 99
    lost.lose[("vm", "status")] = 99
    deliver_until_closed(tasks.instance_stop, job_of(instance, JobKind.INSTANCE_STOP))
    instance.refresh_from_db()
    assert vm_state(instance) == "stopped"
    assert instance.status == InstanceStatus.STOPPED, instance.status_message
    assert instance.billed_seconds == billed
    # Never confirmed: the GPU stays held for the VM until the node shows it stopped (the reconciler).
    assert instance.vm_cleanup_pending and gpu0(sim_node) == "rented"


# ---------------------------------------------------------------------------------------------------- start

def test_a_start_whose_answer_is_lost_runs_and_is_billed_from_its_confirmation(sim_node, lost):
    instance = stopped_instance(sim_node)
    before = timezone.now()
    instance_svc.instance_start(instance=instance)
    lost.lose[("vm", "start")] = 1
    deliver_until_closed(tasks.instance_start, job_of(instance, JobKind.INSTANCE_START))
    instance.refresh_from_db()
    assert vm_state(instance) == "running"
    # Before: the running VM was stopped again and the renter told the start did not go through.
    assert instance.status == InstanceStatus.RUNNING, instance.status_message
    assert instance.started_at > before and instance.ssh_port
    assert gpu0(sim_node) == "rented"
    assert job_of(instance, JobKind.INSTANCE_START).status == JobStatus.SUCCEEDED


def test_a_start_whose_answer_is_lost_each_time_leaves_no_running_unbilled_vm(sim_node, lost):
    instance = stopped_instance(sim_node)
    instance_svc.instance_start(instance=instance)
    lost.lose[("vm", "start")] = 99
    lost.lose[("vm", "status")] = 99
    deliver_until_closed(tasks.instance_start, job_of(instance, JobKind.INSTANCE_START))
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.STOPPED, instance.status_message
    assert vm_state(instance) == "stopped"  # the platform stopped it: nobody runs on it unbilled
    assert instance.billed_until is None or instance.billed_until < instance.stopped_at


def test_a_restart_whose_answers_are_lost_runs_again(sim_node, lost):
    instance = running_instance(sim_node)
    instance_svc.instance_restart(instance=instance)
    lost.lose[("vm", "stop")] = 1
    lost.lose[("vm", "start")] = 1
    deliver_until_closed(tasks.instance_restart, job_of(instance, JobKind.INSTANCE_RESTART))
    instance.refresh_from_db()
    assert vm_state(instance) == "running"
    assert instance.status == InstanceStatus.RUNNING, instance.status_message


def test_a_provision_whose_answer_is_lost_runs(sim_node, lost):
    instance = book(UserFactory(), sim_node)
    lost.lose[("vm", "create")] = 1
    deliver_until_closed(tasks.instance_provision, job_of(instance, JobKind.INSTANCE_PROVISION))
    instance.refresh_from_db()
    # Before: the VM was made, then destroyed, and the renter's instance failed.
    assert vm_state(instance) == "running"
    assert instance.status == InstanceStatus.RUNNING, instance.status_message


# -------------------------------------------------------------------------------------------------- destroy

def test_a_destroy_whose_answer_is_lost_is_confirmed_and_frees_the_gpu(sim_node, lost):
    instance = running_instance(sim_node)
    instance_svc.instance_destroy(instance=instance)
    lost.lose[("vm", "destroy")] = 1
    deliver_until_closed(tasks.instance_destroy, job_of(instance, JobKind.INSTANCE_DESTROY))
    instance.refresh_from_db()
    assert vm_state(instance) is None
    assert instance.status == InstanceStatus.DESTROYED and not instance.vm_cleanup_pending
    assert gpu0(sim_node) == "free"
