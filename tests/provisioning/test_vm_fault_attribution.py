"""Whose failure a VM job's failure is, where the renter could make the node take the blame, or the platform's
own doing failed a job as the node's (found by review):

- a catalogue image's silent SSH server was always the node's, though the renter's onstart (root, run right after
  sshd starts) runs before the platform judges SSH: `pkill sshd` in onstart took 0.02 of any node's reliability per
  booking, free of charge. With one the own image's rule decides. The env and volumes no longer can silence it (the
  env is not the entry wrapper's environment, no volume goes over a system folder): with them, the silence is the
  node's (tests/provisioning/test_vm_entry_hardening*.py, tests/marketplace/test_vm_entry_hardening_volumes.py);
- after a start or restart the VM's disk is the renter's (they had root on it): every image gets that rule;
- a `vm status` answer without a state (confirming a create whose answer was lost) crashed the job (KeyError: the
  platform's "internal error"): it is the node's garbage;
- the agent's `busy` (it waited 60 s for its node-wide allocate lock, held by another of the platform's jobs on
  the node) failed the job at once as the node's: it is retried, and the platform's failure once retries run out.
"""
import pytest
from celery.canvas import Signature
from celery.exceptions import Retry
from django.utils import timezone

from marketplace.models import Instance, InstanceStatus
from marketplace.services import instances as svc
from marketplace.services import volumes as volume_svc
from marketplace.services.instances.options import instance_options
from provisioning import tasks
from provisioning.models import Job, JobFault, JobKind, JobStatus
from provisioning.services import vms
from provisioning.services.faults import error_fault
from provisioning.services.fleet_record import health_samples_record, nodes_reliability
from provisioning.ssh_errors import AgentFailed, AgentGarbage
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book, run
from tests.provisioning.test_lifecycle_races import FakeNode

pytestmark = pytest.mark.django_db

RETRIES_SPENT = tasks.JOB_TASK_OPTIONS["max_retries"]
NOT_COUNTED = "does not count against the node"


@pytest.fixture(autouse=True)
def sent_jobs(monkeypatch):
    sent = []
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: sent.append((job_id, kind)))
    return sent


@pytest.fixture
def resent(monkeypatch):
    """Tasks sent to the broker again (a retry), recorded instead of sent."""
    sent = []
    monkeypatch.setattr(Signature, "apply_async", lambda self, *a, **kw: sent.append(self))
    return sent


def run_in_worker(task, job, retries=0):
    task.push_request(id=f"task-{job.pk}-{timezone.now().timestamp()}", args=[job.pk], kwargs={},
                      retries=retries, called_directly=False, delivery_info={"exchange": "", "routing_key": "celery"})
    try:
        tasks.run_job(task, job.pk)
    finally:
        task.pop_request()


def checked_node():
    node = make_listed_node(UserFactory(), gpu_count=2)
    for _ in range(10):
        health_samples_record(ok_ids=[node.pk], failed_ids=[], day=timezone.now().date())
    return node


def reliability(node):
    return nodes_reliability(node_ids=[node.pk], now=timezone.now())[node.pk]


def failed(job):
    job.refresh_from_db()
    assert job.status == JobStatus.FAILED, (job.status, job.error)
    return job


def accepted_no_banner(host, port, timeout=0):
    silent = vms.VmSshSilent(f"The VM's SSH server at {host}:{port} did not answer within 120s (no SSH banner).")
    silent.reached = True  # docker-proxy accepted: the way works
    raise silent


def refused(host, port, timeout=0):
    raise vms.VmSshSilent(f"The VM's SSH server at {host}:{port} did not answer within 120s "
                          "([Errno 111] Connection refused).")


def running_instance(fake, node, **kwargs):
    instance = run(book(UserFactory(), node, **kwargs))
    Job.objects.filter(instance=instance).update(status=JobStatus.SUCCEEDED, finished_at=timezone.now())
    fake.vms[instance.vm_id] = "running"
    return instance


def probing(fake, monkeypatch, *, ssh_answers):
    """The fake node whose `vm status` with probe_ssh answers `ssh_answers` (the node's own look at the VM's SSH
    port); the probe requests it received are listed."""
    session, probes = fake.session, []

    def answering(node, *args, **kwargs):
        opened = session(node, *args, **kwargs)
        agent = opened.agent

        def answer(command, sub=None, request=None, timeout=None):
            out = agent(command, sub, request, timeout)
            if (command, sub) == ("vm", "status") and (request or {}).get("probe_ssh"):
                probes.append(request)
                out = {**out, "ssh_answers": ssh_answers}
            return out

        opened.agent = answer
        return opened

    monkeypatch.setattr("provisioning.services.vms.node_session", answering)
    return probes


# ------------------------------------------------------------------ a catalogue image with the renter's code


def test_a_catalogue_image_whose_renter_onstart_kills_sshd_does_not_count_against_the_node(monkeypatch):
    fake = FakeNode()
    monkeypatch.setattr("provisioning.services.vms.node_session", fake.session)
    monkeypatch.setattr("provisioning.services.vms.wait_for_ssh", accepted_no_banner)
    node = checked_node()
    assert reliability(node) == 1.0
    instance = book(UserFactory(), node, options=instance_options(onstart="pkill -x sshd\n"))
    assert instance.image is not None and instance.onstart
    job = instance.jobs.get(kind=JobKind.INSTANCE_PROVISION)
    run_in_worker(tasks.instance_provision, job, retries=RETRIES_SPENT)
    job = failed(job)
    assert job.fault == JobFault.RENTER, (job.fault, job.error)
    assert "onstart" in job.error and NOT_COUNTED in job.error
    assert "must start an SSH server" not in job.error  # the image is the catalogue's: it has one
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.FAILED and "onstart" in instance.status_message
    assert reliability(node) == 1.0


def test_a_catalogue_image_without_renter_code_whose_sshd_is_silent_still_counts_against_the_node(monkeypatch):
    fake = FakeNode()
    probes = probing(fake, monkeypatch, ssh_answers=False)
    monkeypatch.setattr("provisioning.services.vms.wait_for_ssh", accepted_no_banner)
    node = checked_node()
    instance = book(UserFactory(), node, options=instance_options(ports=[8888]))  # nothing that runs in the VM
    job = instance.jobs.get(kind=JobKind.INSTANCE_PROVISION)
    run_in_worker(tasks.instance_provision, job, retries=RETRIES_SPENT)
    assert failed(job).fault == JobFault.NODE and probes == []
    assert reliability(node) == pytest.approx(0.98)


def test_a_catalogue_image_with_renter_env_and_volumes_whose_sshd_is_silent_is_the_nodes(monkeypatch):
    """Found by review: the renter's env was the entry wrapper's environment (PATH=/nowhere: no host key made, sshd
    cannot start) and a volume could go over /etc/ssh, so with either the silence was judged the renter's and a
    node's own fault went uncounted. The env now reaches only onstart and SSH sessions, and no volume goes over a
    system folder: the silence is the node's, and the node is asked nothing."""
    fake = FakeNode()
    probes = probing(fake, monkeypatch, ssh_answers=False)
    monkeypatch.setattr("provisioning.services.vms.wait_for_ssh", refused)
    node = checked_node()
    owner = UserFactory()
    volume = volume_svc.volume_create(owner=owner, node_id=node.pk, size_gb=5)
    volume_svc.volume_mark_available(volume_id=volume.pk)
    instance = book(owner, node, options=instance_options(env={"PATH": "/nowhere"}),
                    volumes=[{"volume": volume.pk, "mount": "/data"}])
    assert instance.image is not None and instance.env_names and not instance.onstart
    job = instance.jobs.get(kind=JobKind.INSTANCE_PROVISION)
    run_in_worker(tasks.instance_provision, job, retries=RETRIES_SPENT)
    job = failed(job)
    assert job.fault == JobFault.NODE and NOT_COUNTED not in job.error, (job.fault, job.error)
    assert "your env" not in job.error and "your volumes" not in job.error, job.error
    assert probes == [] and reliability(node) == pytest.approx(0.98)


def test_a_catalogue_image_with_renter_code_whose_ssh_answers_on_the_node_only_is_the_nodes(monkeypatch):
    """The own image's rule, not a free pass: SSH answers on the node and not from outside (a firewall, a port not
    published) is the node's, onstart or not."""
    fake = FakeNode()
    probes = probing(fake, monkeypatch, ssh_answers=True)
    monkeypatch.setattr("provisioning.services.vms.wait_for_ssh", refused)
    node = checked_node()
    instance = book(UserFactory(), node, options=instance_options(onstart="echo hi\n"))
    job = instance.jobs.get(kind=JobKind.INSTANCE_PROVISION)
    run_in_worker(tasks.instance_provision, job, retries=RETRIES_SPENT)
    assert failed(job).fault == JobFault.NODE and len(probes) == 1
    assert reliability(node) == pytest.approx(0.98)


# ------------------------------------------------------------------ start and restart: the disk is the renter's


def test_a_restart_whose_vm_the_renter_left_without_sshd_does_not_count_against_the_node(monkeypatch):
    fake = FakeNode()
    monkeypatch.setattr("provisioning.services.vms.node_session", fake.session)
    monkeypatch.setattr("provisioning.services.vms.wait_for_ssh", accepted_no_banner)
    node = checked_node()
    instance = running_instance(fake, node)
    assert instance.image is not None and not instance.onstart
    svc.instance_restart(instance=Instance.objects.get(pk=instance.pk))
    job = Job.objects.get(instance=instance, kind=JobKind.INSTANCE_RESTART)
    run_in_worker(tasks.instance_restart, job, retries=RETRIES_SPENT)
    job = failed(job)
    assert job.fault == JobFault.RENTER, (job.fault, job.error)
    assert "restart" in job.error and NOT_COUNTED in job.error
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.STOPPED and "The restart did not go through" in instance.status_message
    assert reliability(node) == 1.0


def test_a_start_whose_vm_the_node_sees_without_ssh_does_not_count_against_the_node(monkeypatch):
    fake = FakeNode()
    probes = probing(fake, monkeypatch, ssh_answers=False)
    monkeypatch.setattr("provisioning.services.vms.wait_for_ssh", refused)
    node = checked_node()
    instance = running_instance(fake, node)
    svc.instance_stop(instance=Instance.objects.get(pk=instance.pk))
    svc.instance_mark_stopped(instance_id=instance.pk, message="Stopped.")
    Job.objects.filter(instance=instance).update(status=JobStatus.SUCCEEDED, finished_at=timezone.now())
    fake.vms[instance.vm_id] = "stopped"
    svc.instance_start(instance=Instance.objects.get(pk=instance.pk))
    job = Job.objects.get(instance=instance, kind=JobKind.INSTANCE_START)
    run_in_worker(tasks.instance_start, job, retries=RETRIES_SPENT)
    job = failed(job)
    assert job.fault == JobFault.RENTER and "start" in job.error, (job.fault, job.error)
    assert [p["vm_id"] for p in probes] == [instance.vm_id] and reliability(node) == 1.0


def test_a_restart_whose_ssh_answers_on_the_node_and_not_from_outside_still_counts_against_the_node(monkeypatch):
    fake = FakeNode()
    probes = probing(fake, monkeypatch, ssh_answers=True)
    monkeypatch.setattr("provisioning.services.vms.wait_for_ssh", refused)
    node = checked_node()
    instance = running_instance(fake, node)
    svc.instance_restart(instance=Instance.objects.get(pk=instance.pk))
    job = Job.objects.get(instance=instance, kind=JobKind.INSTANCE_RESTART)
    run_in_worker(tasks.instance_restart, job, retries=RETRIES_SPENT)
    assert failed(job).fault == JobFault.NODE and len(probes) == 1
    assert reliability(node) == pytest.approx(0.98)


# ------------------------------------------------------------------ a garbage `vm status` answer


def test_a_vm_status_answer_without_state_after_a_lost_create_answer_is_the_nodes_garbage_not_a_crash(monkeypatch):
    fake = FakeNode()
    session = fake.session

    def garbage_node(node, *args, **kwargs):
        opened = session(node, *args, **kwargs)
        agent = opened.agent

        def answer(command, sub=None, request=None, timeout=None):
            if (command, sub) == ("vm", "create"):
                agent(command, sub, request, timeout)
                raise AgentGarbage("The agent's answer to vm create is not JSON: b'\\x00'")
            if (command, sub) == ("vm", "status"):
                return {"ok": True}
            return agent(command, sub, request, timeout)

        opened.agent = answer
        return opened

    monkeypatch.setattr("provisioning.services.vms.node_session", garbage_node)
    monkeypatch.setattr("provisioning.services.vms.wait_for_ssh", lambda host, port, timeout=0: None)
    node = make_listed_node(UserFactory(), gpu_count=1)
    instance = book(UserFactory(), node)
    job = instance.jobs.get(kind=JobKind.INSTANCE_PROVISION)
    try:
        run_in_worker(tasks.instance_provision, job, retries=RETRIES_SPENT)
    except KeyError:
        pass
    job = failed(job)
    assert "KeyError" not in job.error and "Internal error" not in job.error, job.error
    assert job.fault == JobFault.NODE, (job.fault, job.error)
    assert "state" in job.error and "vm status" in job.error
    # The VM the create made is destroyed with the failed provision (the node confirmed it).
    assert instance.vm_id not in fake.vms
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.FAILED and not instance.vm_cleanup_pending


@pytest.mark.parametrize("state", [None, 7, ["running"], {"x": 1}])
def test_a_vm_status_answer_whose_state_is_not_text_is_garbage(state, monkeypatch):
    fake = FakeNode()
    session = fake.session

    def odd_status(node, *args, **kwargs):
        opened = session(node, *args, **kwargs)
        agent = opened.agent

        def answer(command, sub=None, request=None, timeout=None):
            out = agent(command, sub, request, timeout)
            return {**out, "state": state} if (command, sub) == ("vm", "status") else out

        opened.agent = answer
        return opened

    monkeypatch.setattr("provisioning.services.vms.node_session", odd_status)
    node = make_listed_node(UserFactory(), gpu_count=1)
    instance = book(UserFactory(), node)
    fake.vms[instance.vm_id] = "running"
    with vms.node_session(node) as opened, pytest.raises(AgentGarbage) as garbage:
        vms._vm_status(opened, instance)
    assert "state" in garbage.value.message


# ------------------------------------------------------------------ the agent's own lock, held by the platform


def busy():
    raise AgentFailed({"code": "busy", "message": "another agent run holds the allocate lock"})


def test_a_create_that_waited_for_the_agents_allocate_lock_held_by_another_platform_job_is_retried(
        monkeypatch, resent):
    fake = FakeNode()
    monkeypatch.setattr("provisioning.services.vms.node_session", fake.session)
    monkeypatch.setattr("provisioning.services.vms.wait_for_ssh", lambda host, port, timeout=0: None)
    fake.hooks[("vm", "create")] = busy
    node = checked_node()
    instance = book(UserFactory(), node)
    job = instance.jobs.get(kind=JobKind.INSTANCE_PROVISION)
    with pytest.raises(Retry):
        run_in_worker(tasks.instance_provision, job, retries=0)
    job.refresh_from_db()
    instance.refresh_from_db()
    assert job.status != JobStatus.FAILED, (job.fault, job.error)
    assert instance.status != InstanceStatus.FAILED, instance.status_message
    assert len(resent) == 1 and reliability(node) == 1.0
    # The retry finds the lock free and makes the VM.
    run_in_worker(tasks.instance_provision, job, retries=1)
    job.refresh_from_db()
    instance.refresh_from_db()
    assert (job.status, instance.status) == (JobStatus.SUCCEEDED, InstanceStatus.RUNNING), job.error


def test_a_start_still_refused_busy_when_its_retries_run_out_is_the_platforms_failure(monkeypatch, resent):
    fake = FakeNode()
    monkeypatch.setattr("provisioning.services.vms.node_session", fake.session)
    monkeypatch.setattr("provisioning.services.vms.wait_for_ssh", lambda host, port, timeout=0: None)
    node = checked_node()
    instance = running_instance(fake, node)
    svc.instance_restart(instance=Instance.objects.get(pk=instance.pk))
    job = Job.objects.get(instance=instance, kind=JobKind.INSTANCE_RESTART)
    fake.hooks[("vm", "start")] = busy
    run_in_worker(tasks.instance_restart, job, retries=RETRIES_SPENT)
    job = failed(job)
    assert job.fault == JobFault.PLATFORM and NOT_COUNTED in job.error, (job.fault, job.error)
    assert "lock" in job.error and resent == []
    assert reliability(node) == pytest.approx(1.0)


def test_busy_is_the_platforms_only_as_the_vm_commands_answer():
    """Read by the VM jobs only (they contend for the agent's locks); elsewhere an AgentFailed stays the node's."""
    assert error_fault(AgentFailed({"code": "busy", "message": "x"})) == JobFault.NODE
    converted = vms.AgentBusy({"code": "busy", "message": "x"})
    assert converted.transient and error_fault(converted) == JobFault.PLATFORM
