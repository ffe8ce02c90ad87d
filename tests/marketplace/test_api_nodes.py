"""Providers' nodes: register, read, change, retire; who may see what; bad input; secrets."""
import json

import pytest
from cryptography.hazmat.primitives import serialization
from django.utils import timezone

from marketplace.encryption import decrypt_secret
from marketplace.models import Gpu, Node, NodeState, Verdict
from provisioning.models import Job
from provisioning.services.nodes import DuplicateHardware, _pin_host_key
from tests.factories import UserFactory, make_listed_node, make_node

from .renting_helpers import add_key, book, run

pytestmark = pytest.mark.django_db

URL = "/api/v1/nodes/"
OFFERS = "/api/v1/offers/"


def node_url(node_or_id):
    return f"{URL}{getattr(node_or_id, 'pk', node_or_id)}/"


def valid_payload(**overrides):
    payload = {
        "name": "box 1",
        "address": "LocalHost",  # a name that resolves, to an address the tests' settings allow (loopback)
        "ssh_port": 2222,
        "ssh_user": "ubuntu",
        "country": "DE",
        "city": "Frankfurt",
        "datacenter": "FRA1",
        "gpu_model": "rtx-a6000",
        "gpu_count": 2,
        "price_per_gpu_hour": "0.79",
        "runtime": "docker",
    }
    payload.update(overrides)
    return payload


def counts():
    return Node.objects.count(), Gpu.objects.count()


def private_key_of(node: Node):
    return serialization.load_ssh_private_key(decrypt_secret(node.ssh_private_key_encrypted), password=None)


def assert_no_secret(response, node: Node):
    """Neither the private key (in any form) nor its ciphertext appears in a response."""
    text = response.content.decode()
    plaintext = decrypt_secret(node.ssh_private_key_encrypted).decode()
    secret_body = "".join(plaintext.splitlines()[1:-1])  # the base64 between the PEM armour lines
    assert "PRIVATE KEY" not in text
    assert secret_body[:40] not in text.replace("\\n", "")
    assert bytes(node.ssh_private_key_encrypted).decode() not in text
    assert "private" not in json.dumps(response.json()).lower()


# --- register ---------------------------------------------------------------------------------------------------

def test_register_a_node(api, user):
    r = api.post(URL, valid_payload(host_key_fingerprint="SHA256:" + "A" * 43))
    assert r.status_code == 201, r.content
    body = r.json()
    node = Node.objects.get(pk=body["id"])
    assert node.provider == user
    assert body["state"] == "pending" and node.state == NodeState.PENDING
    assert body["verdict"] == "unverified"
    assert body["address"] == "localhost"  # hostnames are case-insensitive; stored lower-case
    assert body["price_per_gpu_hour"] == "0.790000" and node.price_per_gpu_hour_micros == 790_000
    assert body["gpu_model"] == "rtx-a6000" and body["country"] == "DE"
    assert body["host_key_fingerprint"] == "SHA256:" + "A" * 43
    assert [g["index"] for g in body["gpus"]] == [0, 1]
    assert all(g["status"] == "free" and g["gpu_model"] == "rtx-a6000" for g in body["gpus"])
    assert node.gpus.count() == 2


def test_a_sim_node_is_refused_unless_the_platform_takes_them(api, settings):
    """Simulated GPUs are checked with CPU-sized work (a 16x16 challenge, a tiny memory fill): a GPU-less box
    running the sim agent with an honest H100 profile passed every check and was listed (found by review). Only
    tests and demos (SIM_NODES_ALLOWED) take them."""
    settings.SIM_NODES_ALLOWED = False
    r = api.post(URL, valid_payload(runtime="sim"))
    assert r.status_code == 400 and "runtime" in r.json() and "real GPU servers only" in str(r.json())
    assert not Node.objects.exists()
    assert api.post(URL, valid_payload(runtime="docker")).status_code == 201
    settings.SIM_NODES_ALLOWED = True
    assert api.post(URL, valid_payload(runtime="sim", ssh_port=2223)).status_code == 201


def test_a_sim_node_registered_before_is_not_offered_booked_or_verified_where_they_are_no_longer_taken(
        api, settings, monkeypatch):
    """Turning SIM_NODES_ALLOWED off must not leave the sim nodes registered before listed: offers, booking and
    volumes leave them out at once, and their next verification rejects them (found by review)."""
    from core.errors import Conflict
    from marketplace.selectors import offers_search
    from marketplace.services.volumes import volume_create
    from provisioning.models import VerificationRun
    from provisioning.services.runner import job_begin
    from provisioning.services.verification import node_verify_request, node_verify_run

    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: None)
    sim, real = make_listed_node(runtime="sim"), make_listed_node(runtime="docker")
    assert set(offers_search().values_list("pk", flat=True)) == {sim.pk, real.pk}
    settings.SIM_NODES_ALLOWED = False
    assert set(offers_search().values_list("pk", flat=True)) == {real.pk}
    assert api.get("/api/v1/offers/").json()["count"] == 1
    settings.SIM_NODES_ALLOWED = True  # the offers' SQL learned with it off is not reused with it on
    assert api.get("/api/v1/offers/").json()["count"] == 2
    settings.SIM_NODES_ALLOWED = False
    key = add_key(api.user)
    r = api.post("/api/v1/instances/", {"offer": sim.pk, "num_gpus": 1, "image": "cuda-12-4", "ssh_keys": [key.pk]},
                 format="json")
    assert r.status_code == 409 and "simulated" in str(r.json()), r.json()
    with pytest.raises(Conflict):
        volume_create(owner=api.user, node_id=sim.pk, size_gb=10)
    node_verify_run(job=job_begin(job_id=node_verify_request(node=sim).pk))
    sim.refresh_from_db()
    assert (sim.state, sim.verdict) == (NodeState.REJECTED, Verdict.REJECTED)
    assert VerificationRun.objects.get(node=sim).findings[0]["code"] == "sim_not_accepted"


def test_register_answers_the_public_key_and_an_install_command_holding_it(api):
    body = api.post(URL, valid_payload()).json()
    assert body["public_key"].startswith("ssh-ed25519 ")
    assert body["public_key"] in body["install_command"]
    assert "authorized_keys" in body["install_command"]
    assert "localhost" not in body["install_command"]  # nothing the provider typed is spliced in


def test_the_private_key_is_stored_encrypted_and_matches_the_public_key(api):
    body = api.post(URL, valid_payload()).json()
    node = Node.objects.get(pk=body["id"])
    token = bytes(node.ssh_private_key_encrypted)
    assert b"PRIVATE KEY" not in token
    plaintext = decrypt_secret(token)
    assert plaintext.startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----")
    public = private_key_of(node).public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    ).decode()
    assert body["public_key"].split()[:2] == public.split()
    assert node.ssh_public_key == body["public_key"]


def test_each_node_gets_its_own_key_pair(api):
    first = api.post(URL, valid_payload(ssh_port=1)).json()["public_key"]
    second = api.post(URL, valid_payload(ssh_port=2)).json()["public_key"]
    assert first.split()[1] != second.split()[1]


def test_no_response_ever_carries_the_private_key(api):
    created = api.post(URL, valid_payload())
    node = Node.objects.get(pk=created.json()["id"])
    for response in (
        created,
        api.get(URL),
        api.get(node_url(node)),
        api.patch(node_url(node), {"price_per_gpu_hour": "1.5"}),
    ):
        assert response.status_code in (200, 201)
        assert_no_secret(response, node)


def test_registering_a_live_address_and_port_twice_is_409_for_the_same_provider_only(api, other_api, client_for):
    """Its own provider is told at once (it tells them about their own nodes only). Another account's node there
    is not looked at when registering, proven or not: a node reserves its server only once it proved it controls
    it (the platform logged in with its key at first contact), and a server another proven live node holds is
    refused at the later node's first contact (tests/marketplace/test_node_server_squatting.py). Before, this 409
    answered every account, for a pending node that never proved anything too: anyone could squat another
    provider's address, and learn whether an address was on the platform (found by review)."""
    first = api.post(URL, valid_payload()).json()["id"]
    for proven, other in ((False, other_api), (True, client_for(UserFactory()))):
        if proven:
            Node.objects.filter(pk=first).update(control_proven_at=timezone.now())
        before = counts()
        r = api.post(URL, valid_payload(address="localhost", name="again"))
        assert r.status_code == 409
        assert "localhost:2222" in r.json()["detail"]
        assert counts() == before
        r = other.post(URL, valid_payload(address="localhost", name="another account's"))
        assert r.status_code == 201, r.content
        assert counts() == (before[0] + 1, before[1] + 2)
    second = Node.objects.get(pk=r.json()["id"])
    with pytest.raises(DuplicateHardware) as raised:  # at its first contact, once it proved control
        _pin_host_key(second, "SHA256:" + "Q" * 43)
    assert raised.value.code == "duplicate_address"


def test_a_retired_nodes_address_can_be_registered_again(api):
    node_id = api.post(URL, valid_payload()).json()["id"]
    assert api.delete(node_url(node_id)).status_code == 204
    assert api.post(URL, valid_payload()).status_code == 201


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"gpu_model": "nope"}, "gpu_model"),
        ({"gpu_model": ""}, "gpu_model"),
        ({"price_per_gpu_hour": "-1"}, "price_per_gpu_hour"),
        ({"price_per_gpu_hour": "0"}, "price_per_gpu_hour"),
        ({"price_per_gpu_hour": "1000000"}, "price_per_gpu_hour"),
        ({"price_per_gpu_hour": "100.000001"}, "price_per_gpu_hour"),
        ({"price_per_gpu_hour": "0.0000001"}, "price_per_gpu_hour"),  # more than 6 decimals
        ({"price_per_gpu_hour": "1.1234567"}, "price_per_gpu_hour"),
        ({"price_per_gpu_hour": "abc"}, "price_per_gpu_hour"),
        ({"price_per_gpu_hour": "NaN"}, "price_per_gpu_hour"),
        ({"price_per_gpu_hour": "Infinity"}, "price_per_gpu_hour"),
        ({"price_per_gpu_hour": 0.79}, "price_per_gpu_hour"),  # money travels as a decimal string
        ({"ssh_port": 0}, "ssh_port"),
        ({"ssh_port": 65536}, "ssh_port"),
        ({"ssh_port": -22}, "ssh_port"),
        ({"ssh_port": "abc"}, "ssh_port"),
        ({"ssh_port": "22"}, "ssh_port"),
        ({"ssh_port": 22.5}, "ssh_port"),
        ({"ssh_port": True}, "ssh_port"),
        ({"address": "bad host"}, "address"),
        ({"address": "-a.com"}, "address"),
        ({"address": "a-.com"}, "address"),
        ({"address": "1.2.3.999"}, "address"),
        ({"address": "a..b"}, "address"),
        ({"address": "x; rm -rf /"}, "address"),
        ({"address": "$(reboot)"}, "address"),
        ({"address": "host_name.com"}, "address"),
        ({"address": "gpu1\n.example.com"}, "address"),  # "$" matched before a newline
        ({"address": ""}, "address"),
        ({"address": "a" * 64 + ".com"}, "address"),
        ({"address": ("a" * 60 + ".") * 5}, "address"),
        ({"country": "XX"}, "country"),
        ({"country": "Germany"}, "country"),
        ({"country": "de "}, "country"),
        ({"host_key_fingerprint": "SHA256:short"}, "host_key_fingerprint"),
        ({"host_key_fingerprint": "MD5:" + "ab:" * 15 + "ab"}, "host_key_fingerprint"),
        ({"host_key_fingerprint": "sha256:" + "A" * 43}, "host_key_fingerprint"),
        ({"host_key_fingerprint": "SHA256:" + "A" * 42 + "="}, "host_key_fingerprint"),
        ({"ssh_user": "Root!"}, "ssh_user"),
        ({"ssh_user": "a b"}, "ssh_user"),
        ({"ssh_user": "1user"}, "ssh_user"),
        ({"ssh_user": "u" * 33}, "ssh_user"),
        ({"ssh_user": ""}, "ssh_user"),
        ({"name": "bad\x00name"}, "name"),
        ({"name": "bell\x07"}, "name"),
        ({"name": "two\nlines"}, "name"),
        ({"name": ""}, "name"),
        ({"name": "n" * 101}, "name"),
        ({"city": "Frank\x1bfurt"}, "city"),
        ({"datacenter": "d" * 101}, "datacenter"),
        ({"gpu_count": 0}, "gpu_count"),
        ({"gpu_count": 17}, "gpu_count"),
        ({"runtime": "vmware"}, "runtime"),
        ({"prize": "0.5"}, "prize"),
        ({"state": "active"}, "state"),
        ({"verdict": "verified"}, "verdict"),
        ({"nvlink_declared": "maybe"}, "nvlink_declared"),
        ({"nvlink_declared": True, "gpu_count": 1}, "nvlink_declared"),
    ],
    ids=lambda v: repr(v)[:40] if not isinstance(v, str) else v,
)
def test_register_rejects_bad_input_naming_the_field_and_writes_nothing(api, overrides, field):
    before = counts()
    r = api.post(URL, valid_payload(**overrides))
    assert r.status_code == 400, r.content
    body = r.json()
    assert field in body, body
    assert isinstance(body[field], list) and body[field] and all(isinstance(m, str) for m in body[field])
    assert counts() == before


def test_register_names_every_missing_required_field(api):
    r = api.post(URL, {})
    assert r.status_code == 400
    assert set(r.json()) == {"name", "address", "ssh_user", "country", "gpu_model", "gpu_count",
                             "price_per_gpu_hour", "runtime"}


@pytest.mark.parametrize("address", ["10.0.0.7", "9.9.9.9", "2606:4700:4700::1111", "localhost"])
def test_register_accepts_hostnames_and_ip_addresses(api, address):
    """Where the platform may connect (tests/marketplace/test_node_addresses.py: public, or an allowed network;
    a name must resolve): the tests' settings allow 10.0.0.0/8 and loopback. The forms a name may take are
    tests/web/test_same_rules.py's."""
    assert api.post(URL, valid_payload(address=address)).status_code == 201


# --- read -------------------------------------------------------------------------------------------------------

def test_list_shows_only_your_live_nodes(api, user):
    mine = make_node(user)
    make_node(user, state=NodeState.RETIRED)
    make_node()  # someone else's
    r = api.get(URL)
    assert r.status_code == 200
    assert [n["id"] for n in r.json()["results"]] == [mine.pk]
    assert r.json()["count"] == 1


def test_list_filters_by_state(api, user):
    pending = make_node(user)
    active = make_listed_node(user)
    assert [n["id"] for n in api.get(URL, {"state": "active"}).json()["results"]] == [active.pk]
    assert [n["id"] for n in api.get(URL, {"state": "pending"}).json()["results"]] == [pending.pk]
    r = api.get(URL, {"state": "sleeping"})
    assert r.status_code == 400 and "state" in r.json()


def test_an_operator_sees_every_node(operator_api):
    nodes = {make_node().pk, make_node().pk}
    assert {n["id"] for n in operator_api.get(URL).json()["results"]} >= nodes
    for node_id in nodes:
        assert operator_api.get(node_url(node_id)).status_code == 200


def test_a_staff_account_without_the_node_permissions_sees_and_rechecks_its_own_nodes_only(client_for):
    """The admin refuses such an account every node's page; the API showed it every provider's address, SSH user
    and checks, and queued re-checks on them (found by review). Viewing alone does not allow a re-check."""
    from django.contrib.auth.models import Permission

    node = make_node()
    staff = UserFactory(is_staff=True)
    own = make_node(staff)
    helpdesk = client_for(staff)
    assert [n["id"] for n in helpdesk.get(URL).json()["results"]] == [own.pk]
    for response in (helpdesk.get(node_url(node)), helpdesk.get(f"{node_url(node)}benchmarks/"),
                     helpdesk.post(f"{node_url(node)}verify/")):
        assert response.status_code == 404, response.content
    staff.user_permissions.add(Permission.objects.get(content_type__app_label="marketplace", codename="view_node"))
    staff = type(staff).objects.get(pk=staff.pk)  # a fresh user: permissions are cached on the instance
    viewer = client_for(staff)
    assert viewer.get(node_url(node)).status_code == 200
    assert viewer.post(f"{node_url(node)}verify/").status_code == 403
    assert not Job.objects.filter(node=node).exists()


def test_node_permissions_follow_the_admins_rule(client_for):
    """The admin shows every node to a holder of change_node alone (view or change), and a node's verification
    runs only to a holder of provisioning's run permission: the API the same (found by the second review round:
    change_node alone saw nothing here; view_node alone read every node's runs)."""
    from django.contrib.auth.models import Group, Permission

    from provisioning.models import VerificationRun

    node = make_node()
    VerificationRun.objects.create(node=node, verdict="rejected", findings=[], figures={"x": 1}, score=0)
    staff = UserFactory(is_staff=True)
    group = Group.objects.create(name="node-ops")
    group.permissions.add(Permission.objects.get(content_type__app_label="marketplace", codename="change_node"))
    staff.groups.add(group)
    operator = client_for(type(staff).objects.get(pk=staff.pk))
    assert operator.get(node_url(node)).status_code == 200
    assert operator.post(f"{node_url(node)}verify/").status_code == 202
    assert operator.get(f"{node_url(node)}benchmarks/").status_code == 404
    group.permissions.add(Permission.objects.get(content_type__app_label="provisioning",
                                                 codename="view_verificationrun"))
    operator = client_for(type(staff).objects.get(pk=staff.pk))
    assert operator.get(f"{node_url(node)}benchmarks/").json()["count"] == 1


def test_get_one_of_your_nodes(api, user):
    node = make_node(user, gpu_count=3)
    r = api.get(node_url(node))
    assert r.status_code == 200
    body = r.json()
    assert body["id"] == node.pk and body["gpu_count"] == 3 and len(body["gpus"]) == 3
    assert body["maintenance"] is False


def test_another_providers_node_is_404_for_every_verb(api):
    node = make_node()
    missing = api.get(node_url(999_999_999))
    for response in (
        api.get(node_url(node)),
        api.patch(node_url(node), {"price_per_gpu_hour": "9"}),
        api.delete(node_url(node)),
    ):
        assert response.status_code == 404
        assert response.json() == missing.json()  # indistinguishable from a node that does not exist
    node.refresh_from_db()
    assert node.price_per_gpu_hour_micros == 1_500_000 and node.state == NodeState.PENDING


@pytest.mark.parametrize("node_id", ["abc", "1.5", "-1", "0"])
def test_a_malformed_id_is_a_json_404(api, node_id):
    r = api.get(node_url(node_id))
    assert r.status_code == 404
    assert "detail" in r.json()


@pytest.mark.parametrize(
    ("method", "path"),
    [("get", URL), ("post", URL), ("get", f"{URL}1/"), ("patch", f"{URL}1/"), ("delete", f"{URL}1/")],
)
def test_nodes_need_authentication(anon, method, path):
    before = counts()
    r = getattr(anon, method)(path, valid_payload() if method == "post" else None)
    assert r.status_code == 401
    assert counts() == before


def test_put_is_not_offered(api, user):
    node = make_node(user)
    assert api.put(node_url(node), valid_payload()).status_code == 405


# --- change -----------------------------------------------------------------------------------------------------

def test_change_the_price(api, user):
    node = make_listed_node(user)
    r = api.patch(node_url(node), {"price_per_gpu_hour": "2.25"})
    assert r.status_code == 200
    assert r.json()["price_per_gpu_hour"] == "2.250000"
    node.refresh_from_db()
    assert node.price_per_gpu_hour_micros == 2_250_000
    offer = api.get(f"{OFFERS}{node.pk}/").json()
    assert offer["price_per_gpu_hour"] == "2.250000"


def test_change_name_city_and_datacenter(api, user):
    node = make_node(user)
    r = api.patch(node_url(node), {"name": "renamed", "city": "", "datacenter": "FRA2"})
    assert r.status_code == 200
    assert (r.json()["name"], r.json()["city"], r.json()["datacenter"]) == ("renamed", "", "FRA2")


def test_unlist_and_list_again(api, anon, user):
    node = make_listed_node(user)
    assert api.patch(node_url(node), {"listed": False}).json()["listed"] is False
    assert anon.get(f"{OFFERS}{node.pk}/").status_code == 404
    assert api.patch(node_url(node), {"listed": True}).json()["listed"] is True
    assert anon.get(f"{OFFERS}{node.pk}/").status_code == 200


@pytest.mark.parametrize(("verdict", "back_to"), [(Verdict.VERIFIED, "active"), (Verdict.UNVERIFIED, "pending")])
def test_maintenance_on_and_off(api, anon, user, verdict, back_to):
    node = make_node(user, state=NodeState.ACTIVE, verdict=verdict, score=1.0)
    r = api.patch(node_url(node), {"maintenance": True})
    assert r.status_code == 200
    assert r.json()["state"] == "maintenance" and r.json()["maintenance"] is True
    assert anon.get(f"{OFFERS}{node.pk}/").status_code == 404
    r = api.patch(node_url(node), {"maintenance": False})
    assert r.status_code == 200
    assert r.json()["state"] == back_to and r.json()["maintenance"] is False


def test_maintenance_while_verifying_is_409_and_changes_nothing(api, user):
    node = make_node(user, state=NodeState.VERIFYING)
    r = api.patch(node_url(node), {"maintenance": True, "price_per_gpu_hour": "9.99", "name": "changed"})
    assert r.status_code == 409
    assert "verifying" in r.json()["detail"]
    node.refresh_from_db()
    assert node.state == NodeState.VERIFYING
    assert node.price_per_gpu_hour_micros == 1_500_000 and node.name == "node"  # no partial write


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        # The endpoint can be changed (tests/provisioning/test_round54_endpoint_change.py), by registration's rules.
        ({"address": "169.254.169.254"}, "address"),
        ({"ssh_port": 0}, "ssh_port"),
        ({"ssh_user": "Root"}, "ssh_user"),
        ({"gpu_model": "h100-sxm"}, "gpu_model"),
        ({"state": "active"}, "state"),
        ({"score": 99}, "score"),
        ({"public_key": "ssh-ed25519 AAAA mine"}, "public_key"),
        ({"colour": "red"}, "colour"),
        ({"price_per_gpu_hour": "-1"}, "price_per_gpu_hour"),
        ({"price_per_gpu_hour": "0"}, "price_per_gpu_hour"),
        ({"price_per_gpu_hour": "101"}, "price_per_gpu_hour"),
        ({"price_per_gpu_hour": "1.0000001"}, "price_per_gpu_hour"),
        ({"listed": "yes"}, "listed"),
        ({"maintenance": 1}, "maintenance"),
        ({"name": ""}, "name"),
        ({"name": "tab\tname"}, "name"),
        ({"city": None}, "city"),
    ],
    ids=lambda v: repr(v)[:40] if not isinstance(v, str) else v,
)
def test_patch_rejects_bad_input_naming_the_field_and_changes_nothing(api, user, payload, field):
    node = make_node(user)
    before = Node.objects.filter(pk=node.pk).values().get()
    r = api.patch(node_url(node), payload)
    assert r.status_code == 400, r.content
    assert field in r.json()
    assert Node.objects.filter(pk=node.pk).values().get() == before


def test_patch_of_a_read_only_field_says_it_cannot_be_changed(api, user):
    node = make_node(user)
    r = api.patch(node_url(node), {"runtime": "docker", "price_per_gpu_hour": "3"})
    assert r.status_code == 400
    assert r.json() == {"runtime": ["This field cannot be changed here."]}
    node.refresh_from_db()
    assert node.runtime == "sim" and node.price_per_gpu_hour_micros == 1_500_000


# --- retire -----------------------------------------------------------------------------------------------------

def test_retire_a_node(api, anon, user):
    node = make_listed_node(user)
    assert api.delete(node_url(node)).status_code == 204
    node.refresh_from_db()
    assert node.state == NodeState.RETIRED and node.listed is False
    assert node.pk not in [n["id"] for n in api.get(URL).json()["results"]]
    assert api.get(node_url(node)).status_code == 404
    assert anon.get(f"{OFFERS}{node.pk}/").status_code == 404
    assert api.delete(node_url(node)).status_code == 404
    assert api.patch(node_url(node), {"name": "zombie"}).status_code == 404


def test_retire_with_a_rented_gpu_is_409(api, user):
    node = make_listed_node(user)
    run(book(UserFactory(), node, 1))
    r = api.delete(node_url(node))
    assert r.status_code == 409
    assert "renters' instances are live on it (1 running)" in r.json()["detail"]
    node.refresh_from_db()
    assert node.state == NodeState.ACTIVE and node.listed is True


def test_an_operator_may_not_change_or_retire_another_providers_node(operator_api, api):
    node_id = api.post(URL, valid_payload()).json()["id"]
    for response in (operator_api.patch(node_url(node_id), {"price_per_gpu_hour": "9.99"}, format="json"),
                     operator_api.delete(node_url(node_id))):
        assert response.status_code == 403
        assert response.json() == {"detail": "Only the node's provider may change or retire it; "
                                             "operators use the admin panel."}
    node = api.get(node_url(node_id)).json()
    assert node["state"] != "retired" and node["price_per_gpu_hour"] != "9.990000"
