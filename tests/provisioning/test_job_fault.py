"""Whose failure a failed job is (Job.fault): only the node's count against its reliability, the figure renters
filter and sort offers by. Each path below failed a job that was the platform's doing, or the renter's, and the
node lost 0.02 of reliability for it (each test failed before the fix): a job that waited for the platform's own
SSH sessions until its deadline, a time limit that ran out while the platform waited on itself, a lost worker, the
reaper, the platform's own exception, a key it cannot read, a request its own agent refused, the renter's own image,
a job superseded meanwhile. What the node did (silent, slow, garbage) still counts."""
import contextlib
import functools
import signal
import socket
import threading
from datetime import timedelta

import pytest
from celery.exceptions import SoftTimeLimitExceeded
from django.core.cache import cache
from django.db import OperationalError, connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from marketplace.models import Instance, InstanceStatus, Node, NodeState, Verdict, Volume, VolumeState
from marketplace.services import volumes as volume_svc
from provisioning import tasks
from provisioning.concurrency import MAX_SESSIONS_PER_NODE, node_slot
from provisioning.models import Job, JobFault, JobKind, JobStatus, NodeEvent
from provisioning.services import faults, maintenance, spot_checks, vms
from provisioning.services.fleet_record import health_samples_record, nodes_reliability
from provisioning.services.runner import job_begin, job_finish
from provisioning.services.verification import node_verify_request
from provisioning.ssh_errors import (
    AddressRefused,
    AgentFailed,
    AgentGarbage,
    AgentTimeout,
    NodeError,
    NodeUnreachable,
    PlatformKeyUnreadable,
)
from tests import migration_steps
from tests.factories import UserFactory, make_listed_node, make_node
from tests.marketplace.renting_helpers import book
from tests.web.conftest import logged_in

from .test_lifecycle_races import FakeNode

pytestmark = pytest.mark.django_db

RETRIES_SPENT = tasks.JOB_TASK_OPTIONS["max_retries"]
NOT_COUNTED = "does not count against the node"


@pytest.fixture(autouse=True)
def sent_jobs(monkeypatch):
    """Jobs handed to Celery on commit are recorded instead (the tests run each job as a worker delivery would)."""
    sent = []
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: sent.append((job_id, kind)))
    monkeypatch.setattr("provisioning.services.vms.wait_for_ssh", lambda host, port, timeout=0: None)
    return sent


@pytest.fixture
def fake_node(monkeypatch):
    fake = FakeNode()
    monkeypatch.setattr("provisioning.services.vms.node_session", fake.session)
    return fake


@pytest.fixture
def resent(monkeypatch):
    """Tasks sent to the broker again (a retry), recorded instead of sent."""
    from celery.canvas import Signature

    sent = []
    monkeypatch.setattr(Signature, "apply_async", lambda self, *a, **kw: sent.append(self))
    return sent


def run_in_worker(task, job: Job, retries: int = 0, task_id: str | None = None):
    """The job's task as a worker delivery runs it; `retries` as the delivery's retry number."""
    task.push_request(id=task_id or f"task-{job.pk}-{timezone.now().timestamp()}", args=[job.pk], kwargs={},
                      retries=retries, called_directly=False, delivery_info={"exchange": "", "routing_key": "celery"})
    try:
        tasks.run_job(task, job.pk)
    finally:
        task.pop_request()


def checked_node(**fields) -> Node:
    """A listed node that answered its ten health checks: reliability 1.0 until a failed job counts."""
    node = make_listed_node(UserFactory(), gpu_count=2, **fields)
    for _ in range(10):
        health_samples_record(ok_ids=[node.pk], failed_ids=[], day=timezone.now().date())
    assert reliability(node) == 1.0
    return node


def reliability(node: Node) -> float:
    """The node's figure as the health checks compute it (fleet_record.nodes_reliability)."""
    return nodes_reliability(node_ids=[node.pk], now=timezone.now())[node.pk]


def take_every_slot(node: Node) -> None:
    """The platform's other work holds every SSH session it allows to the node."""
    for slot in range(MAX_SESSIONS_PER_NODE):
        assert cache.add(f"node-ssh-slot:{node.pk}:{slot}", "another-worker", timeout=60)


def provision(node: Node, **booking) -> tuple[Instance, Job]:
    instance = book(UserFactory(), node, **booking)
    return instance, instance.jobs.get(kind=JobKind.INSTANCE_PROVISION)


def failed(job: Job) -> Job:
    job.refresh_from_db()
    assert job.status == JobStatus.FAILED, (job.status, job.step)
    return job


@contextlib.contextmanager
def soft_time_limit(seconds: float):
    """Celery's soft time limit as a pool process gets it: a signal whose handler raises SoftTimeLimitExceeded
    wherever the task is at that moment (billiard's soft_timeout_sighandler)."""
    def raise_it(signum, frame):
        raise SoftTimeLimitExceeded()

    previous = signal.signal(signal.SIGALRM, raise_it)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def silent_node():
    """A server that takes SSH connections and never says a word (no banner): the node the platform waits for."""
    server = socket.create_server(("127.0.0.1", 0))
    held, stop = [], threading.Event()

    def accept():
        server.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        for conn in held:
            conn.close()
        server.close()


# ----------------------------------------------------------------- (a) waiting for the platform's own sessions

def test_a_job_kept_waiting_by_the_platforms_own_sessions_until_its_deadline_is_not_the_nodes_failure(
        short_slot_wait, resent, settings):
    """Every SSH session the platform allows per node was taken by its own work until the provision's deadline:
    the job failed "the node stayed busy", and the node lost 0.02 of reliability for the platform's load."""
    settings.NODE_BUSY_RETRY_S = 30
    node = checked_node()
    instance, job = provision(node)
    Job.objects.filter(pk=job.pk).update(deadline=timezone.now() + timedelta(seconds=20))
    take_every_slot(node)
    run_in_worker(tasks.instance_provision, job)
    job = failed(job)
    assert job.fault == JobFault.PLATFORM and NOT_COUNTED in job.error
    assert "platform's own work kept this job waiting until its deadline" in job.error
    assert "node stayed busy" not in job.error
    assert reliability(node) == 1.0
    # Its provider reads the same on the node's page.
    page = logged_in(node.provider).get(f"/nodes/{node.pk}/").content.decode()
    assert NOT_COUNTED in page


@pytest.fixture
def short_slot_wait(monkeypatch):
    """Sessions wait 0.2 s for a free slot instead of a minute."""
    monkeypatch.setattr("provisioning.services.nodes.node_slot", functools.partial(node_slot, wait_s=0.2))


# ------------------------------------------------------------------------- (b) Celery's soft time limit

def test_a_time_limit_that_ran_out_while_the_platform_waited_for_its_own_session_is_not_the_nodes(resent):
    """The soft time limit landed while the job waited for one of the platform's SSH slots (its own work held
    them): it was "the node answered too slowly" (AgentTimeout), counted against a node never asked anything."""
    node = checked_node()
    instance, job = provision(node)
    take_every_slot(node)
    with soft_time_limit(0.5):
        run_in_worker(tasks.instance_provision, job)  # waits for a slot (a minute at most)
    job = failed(job)
    assert job.fault == JobFault.PLATFORM and NOT_COUNTED in job.error
    assert "while the platform waited for one of the SSH sessions it allows per node" in job.error
    assert "answered too slowly" not in job.error
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.FAILED  # the renter's side as before
    assert reliability(node) == 1.0


@pytest.mark.django_db(transaction=True)  # as a worker's connection: no test transaction around the job
def test_a_time_limit_that_ran_out_while_the_platform_waited_on_its_database_is_not_the_nodes(fake_node,
                                                                                             monkeypatch):
    def locked(*args, **kwargs):  # the limit lands in a query (as one waiting for a lock another holds)
        with soft_time_limit(0.2), connection.cursor() as cursor:
            cursor.execute("SELECT pg_sleep(5)")

    node = checked_node()
    instance, job = provision(node)
    monkeypatch.setattr(vms, "create_request", locked)
    run_in_worker(tasks.instance_provision, job)
    job = failed(job)
    assert job.fault == JobFault.PLATFORM and "while the platform waited on its database" in job.error
    assert reliability(node) == 1.0


def test_a_time_limit_that_ran_out_while_the_platform_waited_for_the_node_is_the_nodes():
    """The other side of the rule: the node was being waited for (it took the connection and said nothing)
    when the time ran out. The node's, as before (a review's finding: a node answering each step just inside its
    bound must not keep its listing)."""
    with silent_node() as port:
        node = checked_node(address="127.0.0.1", ssh_port=port)
        instance, job = provision(node)
        with soft_time_limit(0.5):
            run_in_worker(tasks.instance_provision, job)
    job = failed(job)
    assert job.fault == JobFault.NODE and NOT_COUNTED not in job.error
    assert "while the platform waited for the node's answer: the node answered too slowly" in job.error
    assert reliability(node) == pytest.approx(0.98)


def test_a_verification_timed_out_on_the_platforms_side_is_not_a_dropped_check():
    """An active node's verification whose time ran out on the platform's side counted as the node dropping it
    (AgentTimeout): two in a row rejected the node and took it off the offers."""
    node = checked_node()
    for _ in range(3):
        job = node_verify_request(node=node)
        take_every_slot(node)
        with soft_time_limit(0.3):
            run_in_worker(tasks.node_verify, job)
        cache.delete_many([f"node-ssh-slot:{node.pk}:{slot}" for slot in range(MAX_SESSIONS_PER_NODE)])
        assert failed(job).fault == JobFault.PLATFORM
    node.refresh_from_db()
    assert (node.state, node.verdict, node.listed) == (NodeState.ACTIVE, Verdict.VERIFIED, True)
    assert not NodeEvent.objects.filter(node=node, kind="verification_dropped").exists()
    assert NOT_COUNTED in node.last_error


# ----------------------------------------------------------------------------- (c) the other platform paths

def test_a_job_whose_worker_was_lost_too_often_is_the_platforms_failure(settings):
    settings.JOB_MAX_LOST_RUNS = 3
    node = checked_node()
    instance, job = provision(node)
    Job.objects.filter(pk=job.pk).update(status=JobStatus.RUNNING, runner="job-5-a w@h:1:x", lost_runs=3,
                                         heartbeat_at=timezone.now() - timedelta(minutes=5))
    run_in_worker(tasks.instance_provision, job, task_id="job-5-b")  # the dispatcher's copy takes it over
    job = failed(job)
    assert "lost 4 times" in job.error and job.fault == JobFault.PLATFORM and NOT_COUNTED in job.error
    assert reliability(node) == 1.0


def test_a_job_redelivered_after_its_worker_died_and_then_failing_by_the_node_still_counts(fake_node):
    """acks_late redelivery resumes the job; what then fails it decides. Here the node: counted."""
    node = checked_node()
    instance, job = provision(node)
    Job.objects.filter(pk=job.pk).update(status=JobStatus.RUNNING, runner="msg-1 w@h:1:x",
                                         heartbeat_at=timezone.now())

    def garbage():
        raise AgentGarbage("The agent's answer to vm create is not JSON: b'\\x00'")

    fake_node.hooks[("vm", "create")] = garbage
    fake_node.hooks[("vm", "status")] = garbage  # not a lost answer: the node answers garbage again when asked
    run_in_worker(tasks.instance_provision, job, task_id="msg-1")  # reject_on_worker_lost: the same message again
    job = failed(job)
    assert job.lost_runs == 1 and job.fault == JobFault.NODE
    assert reliability(node) == pytest.approx(0.98)


def test_a_job_the_reaper_stops_is_the_platforms_failure(fake_node):
    """Open past its deadline with no live execution: no worker took it, or its worker was lost."""
    node = checked_node()
    instance, job = provision(node)
    Job.objects.filter(pk=job.pk).update(deadline=timezone.now() - timedelta(seconds=1))
    assert maintenance.jobs_reap()["reaped"] == 1
    job = failed(job)
    assert job.fault == JobFault.PLATFORM and NOT_COUNTED in job.error
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.FAILED
    assert reliability(node) == 1.0


def test_the_platforms_own_exception_during_a_job_is_not_the_nodes_failure(fake_node, monkeypatch):
    """A database error (or any bug of ours) while the job ran: "Internal error", counted against the node."""
    def broken(instance):
        raise OperationalError("server closed the connection unexpectedly")

    node = checked_node()
    instance, job = provision(node)
    monkeypatch.setattr(vms, "create_request", broken)
    with pytest.raises(OperationalError):
        run_in_worker(tasks.instance_provision, job)
    job = failed(job)
    assert "Internal error: OperationalError" in job.error and job.fault == JobFault.PLATFORM
    assert ("vm", "create", instance.vm_id) not in fake_node.calls
    assert reliability(node) == 1.0


def test_a_key_the_platform_cannot_read_is_not_the_nodes_failure():
    """The platform's own record of the node's key is broken: it refuses before it connects."""
    node = checked_node()
    Node.objects.filter(pk=node.pk).update(ssh_private_key_encrypted=b"not a fernet token")
    instance, job = provision(node)
    with pytest.raises(Exception):  # noqa: B017 (whatever the decryption raises: the platform's own error)
        run_in_worker(tasks.instance_provision, job)
    job = failed(job)
    assert job.fault == JobFault.PLATFORM and "Internal error" in job.error
    assert reliability(node) == 1.0


def test_a_request_the_platforms_agent_refuses_as_invalid_is_not_the_nodes_failure(fake_node):
    node = checked_node()
    instance, job = provision(node)

    def invalid():
        raise AgentFailed({"code": "invalid_request", "message": "gpu_indices: not a list", "field": "gpu_indices"})

    fake_node.hooks[("vm", "create")] = invalid
    run_in_worker(tasks.instance_provision, job)
    assert failed(job).fault == JobFault.PLATFORM
    assert reliability(node) == 1.0


def test_an_address_the_platform_refuses_to_connect_to_is_the_nodes_failure():
    """The provider registered it, or points the node's name at it: only they can change that. Were it the
    platform's, a pending node would be retried for ever and a listed one could dodge its spot checks."""
    refused = AddressRefused("The platform does not connect to 10.0.0.1:22.")
    assert faults.error_fault(refused) == JobFault.NODE
    assert spot_checks.spot_check_dodged(refused)


def test_a_node_key_the_platform_cannot_read_is_not_the_nodes_failure():
    unreadable = PlatformKeyUnreadable("The platform's key for this node cannot be read: bad padding")
    assert faults.error_fault(unreadable) == JobFault.PLATFORM
    assert not spot_checks.spot_check_dodged(unreadable)


def test_the_renters_own_image_that_does_not_pull_is_not_the_nodes_failure(fake_node):
    """The renter's own reference (no catalogue image): its registry's refusal is theirs to fix. A catalogue
    image the node cannot pull still counts."""
    node = checked_node()

    def manifest_unknown():
        raise AgentFailed({"code": "pull_failed", "message": "manifest for x:missing not found: manifest unknown"})

    own, own_job = provision(node, image="registry.example.com/team/x:missing")
    fake_node.hooks[("vm", "create")] = manifest_unknown
    run_in_worker(tasks.instance_provision, own_job)
    own_job = failed(own_job)
    assert own_job.fault == JobFault.RENTER and "could not be pulled" in own_job.error and NOT_COUNTED in own_job.error
    assert reliability(node) == 1.0

    catalogue, catalogue_job = provision(node)
    fake_node.hooks[("vm", "create")] = manifest_unknown
    run_in_worker(tasks.instance_provision, catalogue_job)
    assert failed(catalogue_job).fault == JobFault.NODE
    assert reliability(node) == pytest.approx(0.98)


def test_the_renters_own_image_that_never_opens_ssh_does_not_count_against_the_node(fake_node, monkeypatch):
    """An own image with no SSH server (ubuntu:24.04) never answers, whatever the node does: before, each such
    booking took 0.02 off the node's reliability, free of charge (found by review). A catalogue image's silence
    still counts."""
    node = checked_node()

    def silent(host, port, timeout=0):
        raise vms.VmSshSilent(f"The VM's SSH server at {host}:{port} did not answer within 120s (no SSH banner).")

    monkeypatch.setattr("provisioning.services.vms.wait_for_ssh", silent)
    own, own_job = provision(node, image="ubuntu:24.04")
    run_in_worker(tasks.instance_provision, own_job, retries=RETRIES_SPENT)
    own_job = failed(own_job)
    assert own_job.fault == JobFault.RENTER and "must start an SSH server" in own_job.error
    assert NOT_COUNTED in own_job.error and reliability(node) == 1.0

    catalogue, catalogue_job = provision(node)
    run_in_worker(tasks.instance_provision, catalogue_job, retries=RETRIES_SPENT)
    assert failed(catalogue_job).fault == JobFault.NODE
    assert reliability(node) == pytest.approx(0.98)


def test_an_own_image_whose_sshd_made_its_key_and_stays_silent_counts_against_the_node(fake_node, monkeypatch):
    """The image has sshd (the agent read the host key it made): a silent port is the node's (a firewall, a port
    not published), not the renter's (found by the second review round: every own image's silence was theirs)."""
    node = checked_node()
    session = fake_node.session

    def with_host_key(node_, *args, **kwargs):
        opened = session(node_, *args, **kwargs)
        agent = opened.agent

        def answer(command, sub=None, request=None, timeout=None):
            out = agent(command, sub, request, timeout)
            if (command, sub) == ("vm", "create"):
                out = {**out, "ssh_host_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIEXAMPLEKEY"}
            return out

        opened.agent = answer
        return opened

    monkeypatch.setattr("provisioning.services.vms.node_session", with_host_key)

    def refused(host, port, timeout=0):
        raise vms.VmSshSilent(f"The VM's SSH server at {host}:{port} did not answer within 120s "
                              "([Errno 111] Connection refused).")

    monkeypatch.setattr("provisioning.services.vms.wait_for_ssh", refused)
    own, job = provision(node, image="registry.example.com/team/with-sshd:1")
    run_in_worker(tasks.instance_provision, job, retries=RETRIES_SPENT)
    assert failed(job).fault == JobFault.NODE and "must start an SSH server" not in job.error


def node_answering(fake_node, monkeypatch, *, host_key, ssh_answers):
    """The fake node with `vm create` answering `host_key` and `vm status` with probe_ssh answering `ssh_answers`
    (the node's own look at the VM's SSH port); the probe requests it received are listed."""
    session, probes = fake_node.session, []

    def answering(node_, *args, **kwargs):
        opened = session(node_, *args, **kwargs)
        agent = opened.agent

        def answer(command, sub=None, request=None, timeout=None):
            out = agent(command, sub, request, timeout)
            if (command, sub) == ("vm", "create") and host_key:
                out = {**out, "ssh_host_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIEXAMPLEKEY"}
            if (command, sub) == ("vm", "status") and (request or {}).get("probe_ssh"):
                probes.append(request)
                out = {**out, "ssh_answers": ssh_answers}
            return out

        opened.agent = answer
        return opened

    monkeypatch.setattr("provisioning.services.vms.node_session", answering)

    def refused(host, port, timeout=0):
        raise vms.VmSshSilent(f"The VM's SSH server at {host}:{port} did not answer within 120s "
                              "([Errno 111] Connection refused).")

    monkeypatch.setattr("provisioning.services.vms.wait_for_ssh", refused)
    return probes


def test_an_own_image_with_a_host_key_file_and_no_ssh_server_is_the_renters(fake_node, monkeypatch):
    """A renter's image can carry /etc/ssh/ssh_host_ed25519_key.pub and no sshd (or an sshd that cannot start as
    its user): the agent reads that key, and the silence was counted against the node, any renter taking a node's
    reliability down at no cost (found by review). The node's own probe of the VM's port decides now."""
    node = checked_node()
    probes = node_answering(fake_node, monkeypatch, host_key=True, ssh_answers=False)
    own, job = provision(node, image="registry.example.com/team/key-no-sshd:1")
    run_in_worker(tasks.instance_provision, job, retries=RETRIES_SPENT)
    job = failed(job)
    assert job.fault == JobFault.RENTER and "must start an SSH server" in job.error
    assert reliability(node) == 1.0
    assert [p["vm_id"] for p in probes] == [own.vm_id] and probes[0]["probe_ssh"] is True


def test_an_own_image_whose_ssh_answers_on_the_node_and_not_from_outside_is_the_nodes(fake_node, monkeypatch):
    """Its SSH server answers on the node itself: the silence from outside is the node's network (a firewall, a
    port not published), whatever the image (no host key read from it here)."""
    node = checked_node()
    probes = node_answering(fake_node, monkeypatch, host_key=False, ssh_answers=True)
    _, job = provision(node, image="registry.example.com/team/app:1")
    run_in_worker(tasks.instance_provision, job, retries=RETRIES_SPENT)
    job = failed(job)
    assert job.fault == JobFault.NODE and "must start an SSH server" not in job.error and len(probes) == 1
    assert reliability(node) == pytest.approx(0.98)


def test_an_own_image_reached_from_outside_that_never_says_ssh_is_the_renters_whatever_the_node_sees(
        fake_node, monkeypatch):
    """The platform's connection was accepted (the way to the port works) and no banner came: the image's server
    can answer the node's probe and not the platform (found by the second review round), so the probe is not
    asked."""
    node = checked_node()
    probes = node_answering(fake_node, monkeypatch, host_key=True, ssh_answers=True)

    def accepted_and_closed(host, port, timeout=0):
        silent = vms.VmSshSilent(f"The VM's SSH server at {host}:{port} did not answer within 120s (no SSH banner).")
        silent.reached = True
        raise silent

    monkeypatch.setattr("provisioning.services.vms.wait_for_ssh", accepted_and_closed)
    _, job = provision(node, image="registry.example.com/team/trick:1")
    run_in_worker(tasks.instance_provision, job, retries=RETRIES_SPENT)
    job = failed(job)
    assert job.fault == JobFault.RENTER and "must start an SSH server" in job.error and probes == []
    assert reliability(node) == 1.0


def test_an_own_image_the_node_sees_answering_gets_a_second_look_and_runs_when_it_answers(fake_node, monkeypatch):
    """Its SSH answered on the node, not within the platform's wait: a second look from the platform finds it up
    (it started late), and the instance runs; no one's failure."""
    node = checked_node()
    probes = node_answering(fake_node, monkeypatch, host_key=False, ssh_answers=True)
    looks = []

    def late(host, port, timeout=vms.SSH_READY_TIMEOUT_S):
        looks.append(timeout)
        if len(looks) == 1:
            raise vms.VmSshSilent(f"The VM's SSH server at {host}:{port} did not answer within 120s (timed out).")

    monkeypatch.setattr("provisioning.services.vms.wait_for_ssh", late)
    own, job = provision(node, image="registry.example.com/team/slow:1")
    run_in_worker(tasks.instance_provision, job, retries=RETRIES_SPENT)
    job.refresh_from_db()
    own.refresh_from_db()
    assert (job.status, own.status) == (JobStatus.SUCCEEDED, InstanceStatus.RUNNING), job.error
    assert looks == [vms.SSH_READY_TIMEOUT_S, vms.SSH_LOOK_AGAIN_S] and len(probes) == 1


REAL_WAIT_FOR_SSH = vms.wait_for_ssh  # sent_jobs replaces it in every test


def test_wait_for_ssh_says_whether_the_port_was_reached():
    with socket.create_server(("127.0.0.1", 0)) as server:  # accepts (the kernel's backlog) and never says SSH
        with pytest.raises(vms.VmSshSilent) as silent:
            REAL_WAIT_FOR_SSH("127.0.0.1", server.getsockname()[1], timeout=1)
        assert silent.value.reached is True
    with socket.socket() as bound:  # the port held, nothing listening: refused
        bound.bind(("127.0.0.1", 0))
        with pytest.raises(vms.VmSshSilent) as refused:
            REAL_WAIT_FOR_SSH("127.0.0.1", bound.getsockname()[1], timeout=1)
    assert refused.value.reached is False


def test_a_catalogue_images_silence_asks_the_node_nothing(fake_node, monkeypatch):
    node = checked_node()
    probes = node_answering(fake_node, monkeypatch, host_key=False, ssh_answers=False)
    _, job = provision(node)
    run_in_worker(tasks.instance_provision, job, retries=RETRIES_SPENT)
    assert failed(job).fault == JobFault.NODE and probes == []


def test_a_node_that_stays_unreachable_still_counts(fake_node):
    node = checked_node()
    instance, job = provision(node)

    def away():
        raise NodeUnreachable("connection timed out")

    fake_node.hooks[("vm", "create")] = away
    fake_node.hooks[("vm", "status")] = away  # nor can it be asked whether the VM was made
    run_in_worker(tasks.instance_provision, job, retries=RETRIES_SPENT)
    assert failed(job).fault == JobFault.NODE
    assert reliability(node) == pytest.approx(0.98)


def test_volume_jobs_with_nothing_left_to_do_are_never_the_nodes_failure():
    """A volume job delivered again after its worker died having done the work (acks_late) failed "nothing
    done"; one overtaken by a change of the volume's state failed the same, and neither is the node's doing."""
    node = checked_node()
    volume = volume_svc.volume_create(owner=UserFactory(), node_id=node.pk, size_gb=5)
    create = Job.objects.get(volume=volume, kind=JobKind.VOLUME_CREATE)
    volume_svc.volume_mark_available(volume_id=volume.pk)  # the lost delivery's work
    run_in_worker(tasks.volume_create, create)
    create.refresh_from_db()
    assert create.status == JobStatus.SUCCEEDED and create.fault == ""

    again = Job.objects.create(kind=JobKind.VOLUME_CREATE, node=node, volume=volume, deadline=create.deadline)
    Volume.objects.filter(pk=volume.pk).update(state=VolumeState.DELETING)  # the renter's delete came first
    run_in_worker(tasks.volume_create, again)
    again = failed(again)
    assert again.fault == JobFault.RENTER and "nothing done" in again.error and NOT_COUNTED in again.error


def test_a_node_job_superseded_meanwhile_is_not_the_nodes_failure():
    """The provider put the node in maintenance while its spot check waited in the queue."""
    node = checked_node()
    job = spot_checks.node_spot_check_request(node=node)
    Node.objects.filter(pk=node.pk).update(state=NodeState.MAINTENANCE)
    run_in_worker(tasks.node_spot_check, job)
    job = failed(job)
    assert job.fault == JobFault.PLATFORM and "nothing done" in job.error


# ------------------------------------------------------------- the same rule wherever failures are counted

def test_a_spot_check_failed_by_the_platform_is_not_a_dodge():
    """An agent refusing the platform's own request as invalid brought the node's full verification forward as
    if the node had dodged the check."""
    node = checked_node()
    Node.objects.filter(pk=node.pk).update(next_check_at=timezone.now() + timedelta(days=5))
    job = spot_checks.node_spot_check_request(node=node)
    job = job_begin(job_id=job.pk)
    spot_checks.node_spot_check_failed(job=job, error=AgentFailed({"code": "invalid_request", "message": "bad"}))
    assert failed(job).fault == JobFault.PLATFORM
    node.refresh_from_db()
    assert node.next_check_at > timezone.now() + timedelta(days=4)  # not brought forward
    event = NodeEvent.objects.get(node=node, kind="spot_check_failed_to_run")
    assert NOT_COUNTED in event.message and event.level == NodeEvent.Level.INFO


def test_pending_retries_are_not_stopped_by_the_platforms_failures():
    """Four failed verifications in a row stop the automatic retries and tell the provider to fix the server:
    four the platform failed (busy, lost, its own error) told them to fix what was never wrong."""
    node = make_node()
    for attempt in range(1, maintenance.PENDING_RETRY_MAX_FAILURES + 1):
        reason = f"{maintenance.PENDING_RETRY_REASON} (try {attempt} of {maintenance.PENDING_RETRY_MAX_FAILURES})"
        job = job_begin(job_id=node_verify_request(node=node, reason=reason).pk)
        tasks._fail(job, faults.PlatformError("Internal error: OperationalError. Operators have been told."))
        assert failed(job).fault == JobFault.PLATFORM
    later = timezone.now() + timedelta(hours=3)
    assert maintenance.nodes_verify_pending(now=later)["queued"] == 1
    assert not NodeEvent.objects.filter(node=node, kind="verification_retries_stopped").exists()


@pytest.mark.parametrize(("error", "fault"), [
    (NodeUnreachable("reset"), JobFault.NODE),
    (AgentTimeout("silent"), JobFault.NODE),
    (AgentGarbage("not JSON"), JobFault.NODE),
    (AgentFailed({"code": "gpu_busy", "message": "in use"}), JobFault.NODE),
    (AgentFailed({"code": "platform_error", "message": "the node's word for it"}), JobFault.NODE),
    (AgentFailed({"code": "invalid_request", "message": "bad"}), JobFault.PLATFORM),
    (NodeError("Internal error: TypeError."), JobFault.PLATFORM),
    (faults.PlatformError("lost"), JobFault.PLATFORM),
    (vms.VmSshSilent("no SSH"), JobFault.NODE),
])
def test_whose_failure_each_error_is(error, fault):
    assert faults.error_fault(error) == fault
    from provisioning.concurrency import NodeBusy
    assert faults.error_fault(NodeBusy("taken")) == JobFault.PLATFORM


def test_a_failure_must_say_whose_it_is():
    node = checked_node()
    job = node_verify_request(node=node)
    with pytest.raises(ValueError, match="whose failure"):
        job_finish(job=job, error="something")
    assert Job.objects.get(pk=job.pk).status == JobStatus.QUEUED


def test_operators_see_and_filter_whose_failure_it_was(fake_node):
    from tests.web.conftest import logged_in as as_user

    node = checked_node()
    _, platform_job = provision(node)
    Job.objects.filter(pk=platform_job.pk).update(deadline=timezone.now() - timedelta(seconds=1))
    maintenance.jobs_reap()
    _, node_job = provision(node)

    def away():
        raise NodeUnreachable("connection timed out")

    fake_node.hooks[("vm", "create")] = away
    fake_node.hooks[("vm", "status")] = away
    run_in_worker(tasks.instance_provision, node_job, retries=RETRIES_SPENT)
    ops = as_user(UserFactory(is_staff=True, is_superuser=True))
    page = ops.get("/admin/provisioning/job/?fault__exact=platform").content.decode()
    assert f"/admin/provisioning/job/{platform_job.pk}/change/" in page
    assert f"/admin/provisioning/job/{node_job.pk}/change/" not in page
    assert 'column-fault"' in page and 'field-fault">The platform&#x27;s<' in page  # the column
    assert "?fault__exact=renter" in page  # the filter
    dashboard = ops.get("/admin/").content.decode()
    assert 'id="platform-failed-jobs">1<' in dashboard


# ------------------------------------------------------------------------------------------ the migration

def _migrate(targets=None):
    """To `targets`, or (None) to the latest migration of every app (tests/migration_steps.py)."""
    migration_steps.migrate(MigrationExecutor(connection), targets)


@pytest.mark.django_db(transaction=True)
def test_jobs_that_failed_before_the_fault_was_recorded_keep_counting_against_their_node():
    node = checked_node()
    now = timezone.now()
    before = Job.objects.create(kind=JobKind.INSTANCE_START, node=node, status=JobStatus.FAILED, error="unreachable",
                                finished_at=now, deadline=now)
    done = Job.objects.create(kind=JobKind.INSTANCE_START, node=node, status=JobStatus.SUCCEEDED, finished_at=now,
                              deadline=now)
    try:
        _migrate([("provisioning", "0007_job_relay")])  # the rows as they were: no fault recorded
    finally:
        _migrate()
    assert Job.objects.get(pk=before.pk).fault == JobFault.NODE and Job.objects.get(pk=done.pk).fault == ""
    assert reliability(node) == pytest.approx(0.98)
