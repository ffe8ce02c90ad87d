"""Review r55 (endpoint_events): changing a node's endpoint, and a retired node's events.

- MEDIUM-1: a request that changed the endpoint with another field could be refused (400/403/409) with the new
  endpoint already stored, its renters told and its event written. Now every field is checked first, the endpoint
  proven outside any transaction, then all stored in one transaction: any refusal stores nothing.
- MEDIUM-2: a provision, start or restart under way when the node moved stored the node's old address.
- MEDIUM-3: endpoint changes (SSH probes to any host and port) had no throttle.
- LOW-4: a retired node's events were a 404 to its provider.
- LOW-5: an active node's endpoint could change while its verification or spot check ran at the old address.

The nodes here are never-contacted (no proof needed) or have their proof replaced (endpoint_prove): the proof
itself, against real sshds, is tests/provisioning/test_round54_endpoint_change.py's."""
from unittest import mock

import pytest
from django.utils import timezone
from rest_framework import throttling as drf_throttling

from marketplace.models import Instance, Node, NodeState
from marketplace.services import nodes as node_svc
from marketplace.services.instances import worker
from marketplace.templatetags.marketplace_web import usd_decimal
from notifications.models import Notification
from provisioning.models import Job, JobKind, NodeEvent
from provisioning.services import endpoint_change, vms
from provisioning.services.spot_checks import node_spot_check_request
from provisioning.services.verification import node_verify_request
from tests.factories import UserFactory, make_listed_node, make_node
from tests.marketplace.renting_helpers import book, run

URL = "/api/v1/nodes/"
FP = "SHA256:" + "A" * 43
OTHER_FP = "SHA256:" + "B" * 43


def proven_node(provider, **kwargs):
    """An active node the platform reached, its host key pinned (a change of its endpoint needs proof)."""
    kwargs.setdefault("host_key_fingerprint", FP)
    node = make_listed_node(provider, gpu_model="rtx-a4000", gpu_count=2, **kwargs)
    Node.objects.filter(pk=node.pk).update(control_proven_at=timezone.now())
    node.refresh_from_db()
    return node


def address_of(node):
    node.refresh_from_db()
    return node.address


@pytest.fixture
def proof():
    """The SSH proof taken as passed (the sshd tests prove it for real): counts its calls."""
    with mock.patch.object(endpoint_change, "endpoint_prove") as prove:
        yield prove


@pytest.fixture
def rate(monkeypatch):
    def set_rate(value):
        rates = {**drf_throttling.ScopedRateThrottle.THROTTLE_RATES, "node_endpoint": value}
        monkeypatch.setattr(drf_throttling.ScopedRateThrottle, "THROTTLE_RATES", rates)
    return set_rate


# ------------------------------------------------------------------------------------------ MEDIUM-1


def test_a_refused_other_field_leaves_the_endpoint_as_it_was(api):
    make_node(api.user, address="10.0.0.5", host_key_fingerprint=FP)
    node = make_node(api.user, address="10.0.0.7")  # pending, never contacted: no proof needed
    r = api.patch(f"{URL}{node.pk}/", {"address": "10.0.0.8", "host_key_fingerprint": FP}, format="json")
    assert r.status_code == 400, r.json()
    assert "host_key_fingerprint" in r.json()
    assert address_of(node) == "10.0.0.7", "the request was refused, yet its address was stored"
    assert not NodeEvent.objects.filter(node=node, kind=node_svc.ENDPOINT_CHANGED).exists()


def test_a_proven_node_listed_by_an_unverified_account_is_refused_before_any_connection(client_for, proof):
    provider = UserFactory()
    node = proven_node(provider, address="10.0.0.7")
    Node.objects.filter(pk=node.pk).update(listed=False)
    type(provider).objects.filter(pk=provider.pk).update(email_verified_at=None)  # e.g. changed since
    r = client_for(provider).patch(f"{URL}{node.pk}/", {"address": "10.0.0.8", "listed": True}, format="json")
    assert r.status_code == 403, r.json()
    assert address_of(node) == "10.0.0.7"
    assert not proof.called, "a request refused for another field still connected to the new address"
    assert not NodeEvent.objects.filter(node=node, kind=node_svc.ENDPOINT_CHANGED).exists()


def test_a_refusal_when_storing_rolls_the_endpoint_back_and_tells_no_renter(api, proof,
                                                                           django_capture_on_commit_callbacks):
    node = proven_node(api.user, address="10.0.0.7")
    instance = run(book(UserFactory(), node), host="10.0.0.7")
    # Refused only when stored (as a node changed between the check and the store): the pinned key.
    with mock.patch.object(endpoint_change, "node_update_check", create=True), \
            django_capture_on_commit_callbacks(execute=True) as callbacks:
        r = api.patch(f"{URL}{node.pk}/", {"address": "10.0.0.8", "host_key_fingerprint": OTHER_FP}, format="json")
    assert r.status_code == 409, r.json()
    assert proof.called
    assert address_of(node) == "10.0.0.7"
    instance.refresh_from_db()
    assert instance.ssh_host == "10.0.0.7"
    assert not NodeEvent.objects.filter(node=node, kind=node_svc.ENDPOINT_CHANGED).exists()
    assert not Notification.objects.filter(title="Instance's SSH address changed").exists()
    assert not callbacks


def test_a_proven_change_with_other_fields_stores_both_and_tells_the_renter(api, proof,
                                                                            django_capture_on_commit_callbacks):
    node = proven_node(api.user, address="10.0.0.7")
    renter = UserFactory()
    instance = run(book(renter, node), host="10.0.0.7")
    with django_capture_on_commit_callbacks(execute=True):
        r = api.patch(f"{URL}{node.pk}/", {"address": "10.0.0.8", "name": "moved"}, format="json")
    assert r.status_code == 200, r.json()
    node.refresh_from_db()
    assert (node.address, node.name) == ("10.0.0.8", "moved")
    instance.refresh_from_db()
    assert instance.ssh_host == "10.0.0.8"
    assert Notification.objects.filter(user=renter, title="Instance's SSH address changed").exists()


def test_the_settings_page_refused_for_another_field_stores_no_endpoint(db, client):
    provider = UserFactory()
    client.force_login(provider)
    make_node(provider, address="10.0.0.5", host_key_fingerprint=FP)
    node = make_node(provider, address="10.0.0.7")
    r = client.post(f"/nodes/{node.pk}/settings/", {
        "price_per_gpu_hour": str(usd_decimal(node.price_per_gpu_hour_micros)), "listed": "on" if node.listed else "",
        "address": "10.0.0.8", "ssh_port": str(node.ssh_port), "ssh_user": node.ssh_user,
        "host_key_fingerprint": FP})
    assert r.status_code == 400
    assert address_of(node) == "10.0.0.7"
    assert "10.0.0.7" in r.content.decode()  # the page shows the stored endpoint


# ------------------------------------------------------------------------------------------ MEDIUM-2


def test_a_provision_under_way_records_the_nodes_new_address(db):
    node = proven_node(UserFactory(), address="10.0.0.7")
    instance = book(UserFactory(), node)
    worker.instance_mark_provisioning(instance_id=instance.pk)
    job = Job.objects.filter(instance=instance).latest("pk")
    stale = Instance.objects.select_related("node").get(pk=instance.pk)  # vm_provision's read at its start
    node_svc.node_endpoint_set(node=node, address="10.0.0.8", ssh_port=node.ssh_port, ssh_user=node.ssh_user,
                               proven_with=FP)  # the provider's proven change, during the image pull
    answer = {"ssh_host": None, "ssh_port": 40001, "ssh_user": "root",
              "ports": {"8888/tcp": {"host": None, "port": 40002}, "9000/tcp": {"host": "10.0.0.9", "port": 40003}}}
    with mock.patch.object(vms, "wait_for_ssh"):
        vms._running(job, stale, answer, "Running")
    instance.refresh_from_db()
    assert instance.status == "running"
    assert instance.ssh_host == "10.0.0.8", f"the renter is sent to the node's old address {instance.ssh_host}"
    assert instance.ports["8888/tcp"]["host"] == "10.0.0.8"
    assert instance.ports["9000/tcp"]["host"] == "10.0.0.9"  # a host of its own is kept


# ------------------------------------------------------------------------------------------ MEDIUM-3


def test_endpoint_changes_are_throttled_and_say_when_to_try_again(api, settings):
    node = make_node(api.user, address="10.0.0.7")  # never contacted: each change is stored at once
    limit = 10  # NODE_ENDPOINT_THROTTLE_RATE's default (checked below)
    codes = [api.patch(f"{URL}{node.pk}/", {"address": f"10.0.1.{i}"}, format="json").status_code
             for i in range(1, limit + 3)]
    assert codes == [200] * limit + [429] * 2, codes
    r = api.patch(f"{URL}{node.pk}/", {"address": "10.0.2.1", "name": "renamed"}, format="json")
    assert r.status_code == 429
    assert int(r["Retry-After"]) >= 1
    assert "Too many changes of a server's address" in r.json()["detail"]
    node.refresh_from_db()
    assert (node.address, node.name) == (f"10.0.1.{limit}", node.name)
    assert node.name != "renamed"
    # Not counted: the other fields, and the endpoint as it is.
    assert api.patch(f"{URL}{node.pk}/", {"name": "renamed"}, format="json").status_code == 200
    assert api.patch(f"{URL}{node.pk}/", {"address": f"10.0.1.{limit}"}, format="json").status_code == 200
    assert settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]["node_endpoint"] == "10/min"


def test_the_settings_page_and_the_api_share_one_budget(api, client, rate):
    rate("1/min")
    node = make_node(api.user, address="10.0.0.7")
    assert api.patch(f"{URL}{node.pk}/", {"address": "10.0.1.1"}, format="json").status_code == 200
    client.force_login(api.user)
    r = client.post(f"/nodes/{node.pk}/settings/", {
        "price_per_gpu_hour": str(usd_decimal(node.price_per_gpu_hour_micros)), "listed": "on" if node.listed else "",
        "address": "10.0.1.2", "ssh_port": str(node.ssh_port), "ssh_user": node.ssh_user})
    assert r.status_code == 429
    assert int(r["Retry-After"]) >= 1
    assert "Too many changes of a server&#x27;s address" in r.content.decode()
    assert address_of(node) == "10.0.1.1"


# ------------------------------------------------------------------------------------------ LOW-4


def test_a_retired_nodes_events_stay_its_providers(api, other_api):
    node = make_listed_node(api.user)
    node_svc.node_change_by_operator(node=node, action="retire", by=UserFactory(is_staff=True, is_superuser=True),
                                     reason="abuse")
    assert NodeEvent.objects.filter(node=node, kind="retired_by_operator").exists()
    r = api.get(f"{URL}{node.pk}/events/")
    assert r.status_code == 200, r.content
    assert "retired_by_operator" in [e["kind"] for e in r.json()["results"]]
    assert other_api.get(f"{URL}{node.pk}/events/").status_code == 404
    assert api.get(f"{URL}{node.pk}/").status_code == 404  # the node itself stays off the live nodes


# ------------------------------------------------------------------------------------------ LOW-5


@pytest.mark.parametrize("kind", [JobKind.NODE_VERIFY, JobKind.NODE_SPOT_CHECK], ids=["verify", "spot-check"])
def test_no_endpoint_change_while_a_check_of_the_active_node_runs(api, proof, kind):
    node = proven_node(api.user, address="10.0.0.7")
    if kind == JobKind.NODE_VERIFY:
        node_verify_request(node=node)  # an active node stays active while it is re-verified
    else:
        assert node_spot_check_request(node=node) is not None
    assert Node.objects.get(pk=node.pk).state == NodeState.ACTIVE
    r = api.patch(f"{URL}{node.pk}/", {"address": "10.0.0.8"}, format="json")
    assert r.status_code == 409, r.json()
    what = "verification" if kind == JobKind.NODE_VERIFY else "spot check"
    assert f"node's {what} runs" in r.json()["detail"]
    assert address_of(node) == "10.0.0.7"
    assert not proof.called
