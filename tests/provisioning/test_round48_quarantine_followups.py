"""What is recorded and said when something meets a quarantined node's changed SSH host key (left after f87aad2).

1. A job opened before the quarantine that meets the same changed key is the key's failure (JobFault.HOST_KEY),
   counted once by the quarantine: not the node's again, and not the platform's (it was fault=platform: the
   operators' dashboard counted it among the platform's own failed jobs).
2. A verification that meets the changed key leaves the node's last_error as the quarantine wrote it (both keys,
   the quarantine, that an operator must confirm the new key): before, the check's own failure replaced it, which
   does not say the node is quarantined (and, for the key met again, called it "the platform's failure").
3. A start refused on a quarantined node says what makes it possible (the new key accepted), not "Try again
   later"; the restart's refusal and an interrupted instance's refusals there say the same.

Real parts: a simulated server over real SSH whose host key really changes (round47_quarantine_sim), the fleet's
health check, the API, the jobs as worker deliveries, PostgreSQL."""
import pytest

from marketplace.models import Instance, InstanceStatus, Node, NodeState, Volume, VolumeState
from marketplace.services.instances.lifecycle import instance_start_refusal
from operations.dashboard import fleet_figures
from provisioning import tasks
from provisioning.models import Job, JobKind, JobStatus
from provisioning.services.nodes import HostKeyStillChanged
from provisioning.services.verification import node_verify_failed, node_verify_request, node_verify_run
from tests.marketplace.sim_renting import deliver_until_closed, sent_jobs_fixture  # noqa: F401 (fixture)

from .round47_quarantine_sim import (  # noqa: F401 (fixtures)
    funded_renter,
    instance_running_via_api,
    jobs_held_against,
    qnode_fixture,
    simbase_fixture,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

URL = "/api/v1/instances/"
VOLUMES = "/api/v1/volumes/"
HOST_KEY = "host_key"  # JobFault.HOST_KEY, by value: the old code has no such member


def _platform_failed_jobs() -> int:
    return fleet_figures({"jobs"})["platform_failed_jobs_day"]


def _stopped(client, qnode) -> Instance:
    instance = instance_running_via_api(client, qnode.node)
    assert client.post(f"{URL}{instance.pk}/stop/").status_code == 202
    deliver_until_closed(tasks.instance_stop, Job.objects.get(instance=instance, kind=JobKind.INSTANCE_STOP))
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.STOPPED, instance.status_message
    return instance


def _open_stop(client, qnode) -> tuple[Job, object]:
    instance = instance_running_via_api(client, qnode.node)
    assert client.post(f"{URL}{instance.pk}/stop/").status_code == 202
    return Job.objects.get(instance=instance, kind=JobKind.INSTANCE_STOP), tasks.instance_stop


def _open_start(client, qnode) -> tuple[Job, object]:
    instance = _stopped(client, qnode)
    assert client.post(f"{URL}{instance.pk}/start/").status_code == 202
    return Job.objects.get(instance=instance, kind=JobKind.INSTANCE_START), tasks.instance_start


def _open_volume_create(client, qnode) -> tuple[Job, object]:
    answer = client.post(VOLUMES, {"offer": qnode.node.pk, "size_gb": 1}, format="json")
    assert answer.status_code == 201, answer.content
    return Job.objects.get(volume_id=answer.json()["id"], kind=JobKind.VOLUME_CREATE), tasks.volume_create


OPENERS = {"stop": _open_stop, "start": _open_start, "volume_create": _open_volume_create}


# ------------------------------------------------------------------------------ 1. whose failure the job is

@pytest.mark.parametrize("kind", list(OPENERS))
def test_a_job_meeting_the_key_again_is_the_keys_failure_not_the_platforms(qnode, client_for, kind):
    client = client_for(funded_renter())
    job, task = OPENERS[kind](client, qnode)  # queued before the quarantine, run after it
    qnode.quarantined_by_a_health_check()
    held, platform = jobs_held_against(qnode.fresh()), _platform_failed_jobs()

    deliver_until_closed(task, job)
    job.refresh_from_db()
    assert job.status == JobStatus.FAILED and "quarantined for this key already" in job.error, job.error
    assert job.fault == HOST_KEY, (job.fault, job.error)
    # Said as it is: not the platform's failure, not counted against the node again.
    assert "the platform's failure" not in job.error and "does not count against the node" in job.error, job.error
    # Operators' figures: the platform's failed jobs and the node's are as the quarantine left them.
    assert _platform_failed_jobs() == platform
    assert jobs_held_against(qnode.fresh()) == held
    if kind == "volume_create":
        assert Volume.objects.get(pk=job.volume_id).state == VolumeState.FAILED


# --------------------------------------------------------------------- 2. a verification meeting the key

def _says_what_to_do(last_error: str, node) -> None:
    assert "quarantined" in last_error and "operator" in last_error, last_error
    assert node.host_key_fingerprint in last_error and node.seen_host_key_fingerprint in last_error, last_error


def test_a_verification_that_meets_the_changed_key_first_leaves_the_quarantines_words(qnode, client_for):
    node = qnode.fresh()
    job = node_verify_request(node=node, reason="the schedule")  # an active node is checked in place
    qnode.change_host_key()  # no health check ran: the verification is first to meet it

    deliver_until_closed(tasks.node_verify, job)
    job.refresh_from_db()
    node = qnode.fresh()
    assert node.state == "quarantined" and job.status == JobStatus.FAILED, (node.state, job.status)
    _says_what_to_do(node.last_error, node)
    # What its provider reads through the API is that.
    provider = client_for(node.provider)
    assert provider.get(f"/api/v1/nodes/{node.pk}/").json()["last_error"] == node.last_error
    assert job.fault == "node"  # the change itself: counted once, by this check


def test_a_verification_that_meets_the_key_again_keeps_the_quarantine_reason(qnode):
    job = node_verify_request(node=qnode.fresh(), reason="the schedule")
    begun = Job.objects.select_related("node").get(pk=job.pk)  # the worker read the node active...
    quarantined = qnode.quarantined_by_a_health_check()  # ...and the fleet's health check met the key meanwhile
    reason = quarantined.last_error
    _says_what_to_do(reason, quarantined)

    with pytest.raises(HostKeyStillChanged) as raised:
        node_verify_run(job=begun)
    node_verify_failed(job=begun, error=raised.value)
    node = qnode.fresh()
    assert node.last_error == reason, node.last_error
    job.refresh_from_db()
    assert job.status == JobStatus.FAILED and job.fault == HOST_KEY, (job.status, job.fault, job.error)
    assert "the platform's failure" not in job.error, job.error


# --------------------------------------------------------------------------- 3. the refusals' advice

def _no_try_again_later(message: str) -> None:
    assert "try again later" not in message.lower(), message
    assert "once the new key is accepted" in message and "quarantined" in message, message


def test_a_start_refused_on_a_quarantined_node_says_what_makes_it_possible(qnode, client_for):
    client = client_for(funded_renter())
    instance = _stopped(client, qnode)
    qnode.quarantined_by_a_health_check()

    answer = client.post(f"{URL}{instance.pk}/start/")
    assert answer.status_code == 409, answer.content
    _no_try_again_later(answer.json()["detail"])
    _no_try_again_later(instance_start_refusal(instance=instance))  # the pages' Start button asks it
    # A stopped instance's restart points at start, which says it.
    assert client.post(f"{URL}{instance.pk}/restart/").status_code == 409

    # What it says holds: accepted, the node takes the start.
    qnode.accepted_and_verified()
    assert instance_start_refusal(instance=Instance.objects.get(pk=instance.pk)) == ""


def test_an_interrupted_instances_verbs_on_a_quarantined_node_say_what_to_do(qnode, client_for):
    client = client_for(funded_renter())
    instance = instance_running_via_api(client, qnode.node)
    qnode.quarantined_by_a_health_check()  # interrupts it
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.INTERRUPTED, instance.status

    for verb in ("start", "restart", "stop"):
        answer = client.post(f"{URL}{instance.pk}/{verb}/")
        assert answer.status_code == 409, (verb, answer.content)
        message = answer.json()["detail"]
        assert "quarantined" in message and "once the new key is accepted" in message, (verb, message)
        assert "destroy" in message, (verb, message)


def test_a_running_instances_restart_refused_on_a_quarantined_node_says_what_to_do(qnode, client_for):
    client = client_for(funded_renter())
    instance = instance_running_via_api(client, qnode.node)
    # Its node quarantined, the instance still running (node_quarantine interrupts it right after the node's row is
    # committed): the restart's own refusal.
    Node.objects.filter(pk=qnode.node.pk).update(state=NodeState.QUARANTINED)

    answer = client.post(f"{URL}{instance.pk}/restart/")
    assert answer.status_code == 409, answer.content
    message = answer.json()["detail"]
    assert "once the node is back" not in message, message
    assert "quarantined" in message and "once the new key is accepted" in message, message
