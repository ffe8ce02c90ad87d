"""Review r55 (renter web pages).

MEDIUM-1: a VM job's error is worded for the node's provider and the operators (the node's SSH login and address,
"run the node's install command", "retire this node"). It stays the job's (Job.error); the renter is told a sentence
of their own on every surface that shows the instance's state: the web page and its polled part, the API, the
Vast-compatible API and the notification (in-app, e-mail and webhooks carry its message).

LOW-1: Start is not offered for a stopped container whose GPU another instance holds (the click was refused).
LOW-2: no log links where there is no VM to read a log from.
LOW-3: a destroying instance does not say "Actions come back when the current one is done".
"""
import json

import pytest

from marketplace.models import Instance
from marketplace.services import instances as svc
from notifications.models import Notification
from provisioning.models import Job, JobFault, JobKind
from provisioning.services import vms
from provisioning.services.faults import error_fault
from provisioning.ssh_errors import AddressRefused, AgentFailed, AgentTimeout, AuthFailed, NodeUnreachable
from provisioning.tasks import _fail
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import book, run
from tests.web.conftest import fund, logged_in

V0 = "/compat/vast/api/v0"
# What only the node's provider may read: its SSH login and port, and what they are told to do about it.
LEAKS = ("gpuadmin", "52222", "203.0.113.9", "install command", "verify again", "retire this node", "Cannot reach",
         "No SSH answer", "refused the platform's key")

NODE_ERRORS = {
    "auth_failed": AuthFailed("gpuadmin@203.0.113.9:52222 refused the platform's key. Run the node's install "
                              "command as that user, then verify again."),
    "no_answer": NodeUnreachable("No SSH answer from 203.0.113.9:52222 within 10s."),
    "cannot_reach": NodeUnreachable("Cannot reach 203.0.113.9:52222 over SSH: [Errno 111] Connection refused"),
    "address_refused": AddressRefused("The platform does not connect to 203.0.113.9:52222: not a public address. "
                                      "No connection was opened. Register the server at its public address and "
                                      "retire this node."),
    "agent_timeout": AgentTimeout("No SSH answer from 203.0.113.9:52222 within 60s (the agent gpuadmin ran)."),
}


def _node():
    return make_listed_node(ssh_user="gpuadmin", ssh_port=52222, gpu_count=1)


def _job(instance, kind) -> Job:
    return Job.objects.filter(instance=instance, kind=kind).latest("id")


def _everything_the_renter_reads(renter, client_for, instance) -> str:
    """Every surface showing the instance's state to its renter, as one text."""
    web = logged_in(renter)
    api = client_for(renter)
    surfaces = [
        web.get(f"/instances/{instance.pk}/").content.decode(),
        web.get(f"/instances/{instance.pk}/live/").content.decode(),
        web.get("/instances/").content.decode(),
        json.dumps(api.get(f"/api/v1/instances/{instance.pk}/").json()),
        json.dumps(api.get(f"{V0}/instances/{instance.pk}/").json()),
        json.dumps(api.get(f"{V0}/instances/").json()),
        json.dumps([(n.title, n.body, n.payload) for n in Notification.objects.filter(user=renter)]),
    ]
    return "\n".join(surfaces)


def _leaked(text: str) -> list[str]:
    return [leak for leak in LEAKS if leak in text]


@pytest.mark.parametrize("name", sorted(NODE_ERRORS))
def test_a_failed_provision_tells_the_renter_their_own_words_and_keeps_the_error_for_the_provider(
        renter, client_for, name):
    fund(renter)
    instance = book(renter, _node())
    job = _job(instance, JobKind.INSTANCE_PROVISION)
    error = NODE_ERRORS[name]
    _fail(job, error)  # the task's handoff (provisioning.tasks), as a job that gave up
    instance = Instance.objects.get(pk=instance.pk)
    seen = _everything_the_renter_reads(renter, client_for, instance)
    assert _leaked(seen) == []
    assert instance.status == "failed"
    assert "It never ran: nothing was billed." in instance.status_message
    assert instance.status_message in seen
    assert Job.objects.get(pk=job.pk).error == error.message  # the provider's node page and the operators read it


def test_a_failed_provision_given_only_the_words_tells_the_renter_none_of_them(renter, client_for):
    """The review's own test: vm_failed given the error's text (as the reaper gives it) and the node's fault."""
    fund(renter)
    instance = book(renter, _node())
    error = NODE_ERRORS["auth_failed"]
    vms.vm_failed(job=_job(instance, JobKind.INSTANCE_PROVISION), error=error.message, fault=JobFault.NODE)
    assert _leaked(_everything_the_renter_reads(renter, client_for, instance)) == []


def test_a_start_that_failed_on_the_node_tells_the_renter_why_in_their_words(renter, client_for):
    fund(renter)
    instance = run(book(renter, _node()))
    svc.instance_stop(instance=Instance.objects.get(pk=instance.pk))
    svc.instance_mark_stopped(instance_id=instance.pk)
    svc.instance_start(instance=Instance.objects.get(pk=instance.pk))
    _fail(_job(instance, JobKind.INSTANCE_START), NODE_ERRORS["auth_failed"])
    instance = Instance.objects.get(pk=instance.pk)
    assert _leaked(_everything_the_renter_reads(renter, client_for, instance)) == []
    assert instance.status == "stopped"
    assert instance.status_message.startswith("The start did not go through: Its server could not be reached.")


def test_a_stop_that_never_reached_the_node_tells_the_renter_why_in_their_words(renter, client_for):
    fund(renter)
    instance = run(book(renter, _node()))
    svc.instance_stop(instance=Instance.objects.get(pk=instance.pk))
    _fail(_job(instance, JobKind.INSTANCE_STOP), NODE_ERRORS["cannot_reach"])
    instance = Instance.objects.get(pk=instance.pk)
    assert _leaked(_everything_the_renter_reads(renter, client_for, instance)) == []
    assert instance.status == "running"
    assert instance.status_message.startswith("The stop did not reach the server: Its server could not be reached.")


def test_the_renters_own_failure_is_told_as_it_is(renter, client_for):
    """An error of the renter's own (their image refused by its registry) is worded for them: told as it is."""
    fund(renter)
    instance = book(renter, _node())
    refused = AgentFailed({"code": vms.PULL_REFUSED, "message": "The image could not be pulled: manifest unknown"})
    refused.fault = JobFault.RENTER  # as vms._pull_failure declares it
    _fail(_job(instance, JobKind.INSTANCE_PROVISION), refused)
    assert Instance.objects.get(pk=instance.pk).status_message == (
        "The image could not be pulled: manifest unknown It never ran: nothing was billed.")


@pytest.mark.parametrize(("error", "fault", "told"), [
    (NODE_ERRORS["auth_failed"], JobFault.NODE, "Its server could not be reached."),
    (NODE_ERRORS["agent_timeout"], JobFault.NODE, "Its server did not answer in time."),
    (AgentFailed({"code": "libvirt", "message": "virsh: gpuadmin's pool /srv/x is full"}), JobFault.NODE,
     "Its server could not carry it out."),
    (AgentFailed({"code": vms.PULL_NODE_FAILED, "message": "dockerd at /run/docker.sock"}), JobFault.NODE,
     "Its server could not download the image (the server's failure, not a fault of the image); booking it on "
     "another server may work."),
    ("The worker running this job was lost 4 times.", JobFault.PLATFORM,
     "The platform could not carry it out (a failure of its own; its operators have been told)."),
], ids=["auth_failed", "agent_timeout", "agent_failed", "pull_node_failed", "platform"])
def test_the_renters_reason_is_chosen_by_the_errors_kind(error, fault, told):
    assert vms.renter_reason(error, fault) == told
    if not isinstance(error, str):
        assert error_fault(error) == fault


# ------------------------------------------------------------------------------------------------------ LOWs


def test_a_stopped_container_whose_gpu_another_instance_holds_is_not_offered_start(renter, stranger):
    fund(renter)
    fund(stranger)
    node = make_listed_node(gpu_count=1, runtime="docker")
    mine = run(book(renter, node))
    svc.instance_stop(instance=Instance.objects.get(pk=mine.pk))
    svc.instance_mark_stopped(instance_id=mine.pk)
    web = logged_in(renter)
    assert f'action="/instances/{mine.pk}/start/"' in web.get(f"/instances/{mine.pk}/").content.decode()
    run(book(stranger, node))
    page = web.get(f"/instances/{mine.pk}/").content.decode()
    assert f'action="/instances/{mine.pk}/start/"' not in page
    assert "GPU 0 is rented by another instance now" in page  # the service's own reason, before any click


@pytest.mark.parametrize("state", ["requested", "destroyed", "failed_vm_gone"])
def test_no_log_links_where_there_is_no_vm_to_read_a_log_from(renter, state):
    fund(renter)
    instance = book(renter, make_listed_node())
    if state == "destroyed":
        run(instance)
        svc.instance_destroy(instance=Instance.objects.get(pk=instance.pk))
        svc.instance_mark_destroyed(instance_id=instance.pk)
    elif state == "failed_vm_gone":
        svc.instance_mark_failed(instance_id=instance.pk, message="Failed.", vm_gone=True)
    web = logged_in(renter)
    page = web.get(f"/instances/{instance.pk}/").content.decode()
    assert "?tail=100" not in page and 'id="no-log"' in page
    # Asked anyway (an old link): the page says why there is no log, and asks no node.
    assert 'id="no-log"' in web.get(f"/instances/{instance.pk}/?tail=100").content.decode()


def test_a_running_instance_still_offers_its_log_links(renter):
    fund(renter)
    instance = run(book(renter, make_listed_node()))
    page = logged_in(renter).get(f"/instances/{instance.pk}/").content.decode()
    assert "?tail=100" in page and 'id="no-log"' not in page


def test_a_destroying_instance_does_not_say_actions_come_back(renter):
    fund(renter)
    instance = run(book(renter, make_listed_node()))
    svc.instance_destroy(instance=Instance.objects.get(pk=instance.pk))
    assert Instance.objects.get(pk=instance.pk).status == "destroying"
    page = logged_in(renter).get(f"/instances/{instance.pk}/").content.decode()
    assert "Actions come back when the current one is done" not in page
    assert 'id="destroying"' in page
