"""Review r55 (endpoint_events), after e08bb12:

- LOW-6: a provider who corrects the address, SSH port or user of a node never contacted (its first contact failed;
  not retried since 5141fb1, and the pending beat skips it once its retries stopped, b68dfdd) got the change
  stored, but its `last_error` still described the old endpoint and nothing tried the new one until they found
  Verify. Now the change clears that error and queues the first contact once it commits, through
  node_verify_request (as Verify does); the API's answer (state, current_job) and the page say so.
- Two changes of the same node at once both proved and the last one stored won: now the store is compare-and-set
  under the node's lock, the later one refused (409) when the node's endpoint is no longer the one it was proven
  from.

The interleavings are forced in one thread: the other request runs whole while this one is at its check or proof.
"""
from unittest import mock

import pytest
from django.utils import timezone

from core.errors import Conflict
from marketplace.models import Node, NodeState
from marketplace.services import nodes as node_svc
from marketplace.templatetags.marketplace_web import usd_decimal
from provisioning.models import OPEN_JOB_STATUSES, Job, JobFault, JobKind, JobStatus, NodeEvent
from provisioning.services import endpoint_change, jobs
from provisioning.services.maintenance import nodes_verify_pending
from tests.factories import make_listed_node, make_node

URL = "/api/v1/nodes/"
FP = "SHA256:" + "A" * 43
OLD_ERROR = "Could not open an SSH session at 10.0.0.7:22: connection timed out."


def stuck_node(provider, address="10.0.0.7"):
    """A pending node never contacted: its first contact failed, the retries stopped and its provider was told."""
    node = make_node(provider, address=address)
    job = jobs.job_create(kind=JobKind.NODE_VERIFY, node=node)
    Job.objects.filter(pk=job.pk).update(status=JobStatus.FAILED, finished_at=timezone.now(), error=OLD_ERROR,
                                         fault=JobFault.NODE)
    NodeEvent.objects.create(node=node, kind="verification_retries_stopped", level=NodeEvent.Level.WARNING,
                             message=OLD_ERROR)
    Node.objects.filter(pk=node.pk).update(last_error=OLD_ERROR)
    node.refresh_from_db()
    return node


def proven_node(provider, **kwargs):
    node = make_listed_node(provider, gpu_model="rtx-a4000", gpu_count=2, host_key_fingerprint=FP, **kwargs)
    Node.objects.filter(pk=node.pk).update(control_proven_at=timezone.now())
    node.refresh_from_db()
    return node


def open_verifications(node):
    return Job.objects.filter(node=node, kind=JobKind.NODE_VERIFY, status__in=OPEN_JOB_STATUSES)


@pytest.fixture
def sent():
    """The jobs sent to the broker once their transaction commits."""
    with mock.patch.object(jobs, "_send") as send:
        yield send


@pytest.fixture
def proof():
    with mock.patch.object(endpoint_change, "endpoint_prove") as prove:
        yield prove


def settings_post(client, node, **changes):
    return client.post(f"/nodes/{node.pk}/settings/", {
        "price_per_gpu_hour": str(usd_decimal(node.price_per_gpu_hour_micros)), "listed": "on" if node.listed else "",
        "address": node.address, "ssh_port": str(node.ssh_port), "ssh_user": node.ssh_user, **changes})


# ------------------------------------------------------------------------------------------ LOW-6


@pytest.mark.django_db(transaction=True)  # the first contact is queued when the change commits
def test_correcting_a_never_contacted_nodes_address_starts_its_first_contact(api, sent):
    node = stuck_node(api.user)
    sent.reset_mock()  # the failed first contact's
    assert nodes_verify_pending()["queued"] == 0  # the beat skips it: its retries stopped
    r = api.patch(f"{URL}{node.pk}/", {"address": "10.0.0.8"}, format="json")
    assert r.status_code == 200, r.json()
    body = r.json()
    assert body["address"] == "10.0.0.8"
    assert body["last_error"] == "", "the old address's error is still shown after the address was corrected"
    assert body["state"] == NodeState.VERIFYING
    assert body["current_job"]["kind"] == JobKind.NODE_VERIFY
    assert body["current_job"]["status"] == JobStatus.QUEUED
    assert "gpu@10.0.0.8:" in body["current_job"]["step"]
    job = open_verifications(node).get()
    sent.assert_called_once_with(job.pk, JobKind.NODE_VERIFY)


@pytest.mark.django_db(transaction=True)
def test_the_settings_page_says_the_first_contact_started(client, user, sent):
    node = stuck_node(user)
    client.force_login(user)
    r = settings_post(client, node, ssh_port="2222")
    assert r.status_code == 302, r.content.decode()[:2000]
    page = client.get(r["Location"]).content.decode()
    assert "A first contact with the server at gpu@10.0.0.7:2222 has started" in page
    node.refresh_from_db()
    assert (node.ssh_port, node.last_error, node.state) == (2222, "", NodeState.VERIFYING)
    assert open_verifications(node).count() == 1
    assert sent.called


@pytest.mark.django_db(transaction=True)
def test_a_first_contact_refused_keeps_the_change_and_says_to_press_verify(client, user, sent):
    node = stuck_node(user)
    client.force_login(user)
    with mock.patch.object(endpoint_change, "node_verify_request", create=True,
                           side_effect=Conflict("A pending node cannot be verified.")):
        r = settings_post(client, node, address="10.0.0.8")
    assert r.status_code == 302
    assert "Press “Verify now” for a first contact with the server at gpu@10.0.0.8:" in client.get(
        r["Location"]).content.decode()
    node.refresh_from_db()
    assert (node.address, node.state, node.last_error) == ("10.0.0.8", NodeState.PENDING, "")
    assert not open_verifications(node).exists()


def test_a_proven_nodes_change_queues_no_verification(api, proof, django_capture_on_commit_callbacks):
    node = proven_node(api.user, address="10.0.0.7")
    with django_capture_on_commit_callbacks(execute=True):
        r = api.patch(f"{URL}{node.pk}/", {"address": "10.0.0.8"}, format="json")
    assert r.status_code == 200, r.json()
    assert proof.called
    assert r.json()["state"] == NodeState.ACTIVE
    assert not open_verifications(node).exists()


# ------------------------------------------------------------------------------------------ two changes at once


def test_a_change_proven_while_another_was_stored_is_refused_not_stored_over_it(api, proof):
    node = proven_node(api.user, address="10.0.0.7")

    def the_other_change_meanwhile(**kwargs):
        if kwargs["address"] == "10.0.0.8":  # this request's proof: the other request runs whole meanwhile
            endpoint_change.node_change(node=node, endpoint={"address": "10.0.0.9"})

    proof.side_effect = the_other_change_meanwhile
    r = api.patch(f"{URL}{node.pk}/", {"address": "10.0.0.8", "name": "moved"}, format="json")
    assert r.status_code == 409, r.json()
    assert "changed to gpu@10.0.0.9:" in r.json()["detail"] and "try again" in r.json()["detail"]
    node.refresh_from_db()
    assert (node.address, node.name) == ("10.0.0.9", "node"), "the later change was stored over the first"
    assert NodeEvent.objects.filter(node=node, kind=node_svc.ENDPOINT_CHANGED).count() == 1


def test_a_never_contacted_nodes_two_changes_at_once_the_later_is_refused(user):
    node = make_node(user, address="10.0.0.7")
    check = endpoint_change.node_endpoint_check

    def the_other_change_meanwhile(**kwargs):
        if kwargs["address"] == "10.0.0.8":
            endpoint_change.node_change(node=node, endpoint={"ssh_user": "admin"})
        return check(**kwargs)

    with mock.patch.object(endpoint_change, "node_endpoint_check", side_effect=the_other_change_meanwhile), \
            pytest.raises(Conflict, match="changed to admin@10.0.0.7:"):
        endpoint_change.node_endpoint_change(node=node, address="10.0.0.8")
    node.refresh_from_db()
    assert (node.address, node.ssh_user) == ("10.0.0.7", "admin")


def test_the_same_change_twice_at_once_is_no_conflict(api, proof):
    node = proven_node(api.user, address="10.0.0.7")

    def the_same_change_meanwhile(**kwargs):
        if proof.call_count == 1:
            endpoint_change.node_change(node=node, endpoint={"address": "10.0.0.8"})

    proof.side_effect = the_same_change_meanwhile
    r = api.patch(f"{URL}{node.pk}/", {"address": "10.0.0.8"}, format="json")
    assert r.status_code == 200, r.json()
    assert r.json()["address"] == "10.0.0.8"
    assert NodeEvent.objects.filter(node=node, kind=node_svc.ENDPOINT_CHANGED).count() == 1


def test_the_steps_called_directly_store_only_the_first_proven(user, proof):
    node = proven_node(user, address="10.0.0.7")
    first = endpoint_change.node_endpoint_prove(node=node, address="10.0.0.8")
    second = endpoint_change.node_endpoint_prove(node=node, ssh_port=2222)
    for proven in (first, second):
        assert proven is not None and proven.was == ("10.0.0.7", node.ssh_port, "gpu")

    def store(proven):
        return node_svc.node_endpoint_set(node=node, address=proven.address, ssh_port=proven.ssh_port,
                                          ssh_user=proven.ssh_user, proven_with=proven.proven_with, was=proven.was)

    store(first)
    with pytest.raises(Conflict, match="changed to gpu@10.0.0.8:"):
        store(second)
    node.refresh_from_db()
    assert (node.address, node.ssh_port) == ("10.0.0.8", first.ssh_port)
