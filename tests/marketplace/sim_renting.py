"""Shared by the tests/marketplace/test_renting_*.py modules that run instance jobs against a simulated server: a
real sshd with the real agent (its VMs are real sshd processes), one per module, and the platform's own SSH
client; jobs run in the test's process as a worker's delivery runs them. Import the fixtures by name."""
from datetime import timedelta

import pytest
from celery.canvas import Signature
from celery.exceptions import Retry
from django.utils import timezone

from marketplace.models import Gpu, Instance, InstanceStatus, Node
from marketplace.services import instances as instance_svc
from provisioning import sim, tasks
from provisioning.models import Job, JobKind
from provisioning.services.nodes import node_session
from provisioning.ssh import NodeSession
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book


@pytest.fixture(autouse=True, name="sent_jobs")
def sent_jobs_fixture(monkeypatch):
    """Jobs are run by the test, not sent; a retry is recorded, not sent."""
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: None)
    retries = []
    monkeypatch.setattr(Signature, "apply_async", lambda self, *a, **kw: retries.append(self))
    return retries


@pytest.fixture(scope="module", name="simbase")
def simbase_fixture(tmp_path_factory):
    base = tmp_path_factory.mktemp("lost-answers")
    yield base
    sim.nodes_down(base)


@pytest.fixture(scope="module", name="simnode")
def simnode_fixture(simbase):
    return sim.node_up("rtx-a4000-x2", simbase)


@pytest.fixture(name="sim_node")
def sim_node_fixture(simnode, simbase):
    node = make_listed_node(UserFactory(), gpu_model="rtx-a4000", gpu_count=2, address=simnode["address"],
                            ssh_port=simnode["ssh_port"], ssh_user=simnode["ssh_user"],
                            host_key_fingerprint=simnode["host_key_fingerprint"], price="1.000000")
    sim.node_authorize(simnode["ssh_port"], node.ssh_public_key, simbase)
    yield node
    with node_session(Node.objects.get(pk=node.pk)) as session:  # the next test starts on an empty server
        for vm in session.agent("vm", "list", {"runtime": "sim"})["vms"]:
            session.agent("vm", "destroy", {"runtime": "sim", "vm_id": vm["vm_id"]})


class LostAnswers:
    """`lose[("vm", "stop")] = n`: the next n such commands run on the node, and their connection is then cut."""

    def __init__(self):
        self.lose: dict[tuple[str, str], int] = {}
        self.sent: list[str] = []

    def exec_(self, honest):
        def exec_(session, cmd, stdin, timeout):
            command = tuple(cmd.split()[2:4])
            self.sent.append(" ".join(command))
            if self.lose.get(command, 0) > 0:
                self.lose[command] -= 1
                # $PPID is the sshd process of this connection: killing it drops the connection, as a network
                # cut would, after the command has done its work and before its answer is read.
                cmd = f"{cmd} >/dev/null 2>&1; kill -KILL $PPID"
            return honest(session, cmd, stdin, timeout)
        return exec_


@pytest.fixture(name="lost")
def lost_fixture(monkeypatch):
    faults = LostAnswers()
    monkeypatch.setattr(NodeSession, "_exec", faults.exec_(NodeSession._exec))
    return faults


def deliver(task, job: Job, retries: int = 0) -> str:
    """Run the job's task as the worker's delivery number `retries` would: "done" or "retry"."""
    task.push_request(id=f"task-{job.pk}-{retries}-{timezone.now().timestamp()}", args=[job.pk], kwargs={},
                      retries=retries, called_directly=False, delivery_info={"exchange": "", "routing_key": "celery"})
    try:
        tasks.run_job(task, job.pk)
    except Retry:
        return "retry"
    finally:
        task.pop_request()
    return "done"


def deliver_until_closed(task, job: Job) -> None:
    for retries in range(task.max_retries + 1):
        if deliver(task, job, retries) == "done":
            return
    raise AssertionError("the job was still retried after its last delivery")


def vm_state(instance: Instance) -> str | None:
    """The VM's state as the node lists it (None: no such VM), read over a connection of the test's own."""
    with node_session(Node.objects.get(pk=instance.node_id)) as session:
        vms = session.agent("vm", "list", {"runtime": "sim"})["vms"]
    return {vm["vm_id"]: vm["state"] for vm in vms}.get(instance.vm_id)


def gpu0(node) -> str:
    return Gpu.objects.get(node=node, index=0).status


def job_of(instance: Instance, kind: str) -> Job:
    return Job.objects.filter(instance=instance, kind=kind).latest("pk")


def running_instance(node) -> Instance:
    instance = book(UserFactory(), node)
    deliver_until_closed(tasks.instance_provision, job_of(instance, JobKind.INSTANCE_PROVISION))
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.RUNNING, instance.status_message
    return instance


def stopped_instance(node) -> Instance:
    instance = running_instance(node)
    instance_svc.instance_stop(instance=instance)
    deliver_until_closed(tasks.instance_stop, job_of(instance, JobKind.INSTANCE_STOP))
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.STOPPED, instance.status_message
    return instance


def backdate(instance: Instance, **delta) -> Instance:
    """As if it had been running for `delta` already (nothing billed yet)."""
    Instance.objects.filter(pk=instance.pk).update(started_at=timezone.now() - timedelta(**delta))
    instance.refresh_from_db()
    return instance


def node_agent(instance: Instance, verb: str) -> dict:
    """`vm <verb>` on the instance's VM as someone else than the platform's job would (its provider, a crash)."""
    with node_session(Node.objects.get(pk=instance.node_id)) as session:
        return session.agent("vm", verb, {"runtime": "sim", "vm_id": instance.vm_id})
