"""A provider changes a node's address, SSH port or SSH user (review r54 onboard #3).

Before, PATCH /api/v1/nodes/{id}/ answered "This field cannot be changed here" for all three, the admin was
read-only and no service could change them: a server whose IP changed stayed offline for good, and retiring it
ended its renters' stopped instances and deleted their volumes as lost.

Now the new endpoint is checked as at registration, then proven for a node the platform reached: the server there
must present the node's PINNED host key and accept the node's own key. The servers here are real sshd processes
(provisioning.sim): the node's "old" address is one nothing answers at (127.0.0.2: the sshd listens on 127.0.0.1
only), as for a renumbered server."""
import pytest
from django.utils import timezone

from marketplace.models import Instance, Node, NodeState
from notifications.models import Notification
from provisioning import sim
from provisioning.models import NodeEvent
from provisioning.node_event_kinds import PROVIDER_KINDS
from provisioning.services import fleet
from provisioning.ssh_pool import SshPool
from tests.factories import UserFactory, make_listed_node, make_node
from tests.marketplace.renting_helpers import book, run

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

URL = "/api/v1/nodes/"
OLD = "127.0.0.2"  # nothing listens there: the server "moved" to 127.0.0.1


@pytest.fixture(scope="module")
def simbase(tmp_path_factory):
    base = tmp_path_factory.mktemp("endpoint-change")
    yield base
    sim.nodes_down(base)


@pytest.fixture(scope="module")
def server(simbase):
    """The node's own server, now at 127.0.0.1."""
    return sim.node_up("rtx-a4000-x2", simbase)


@pytest.fixture(scope="module")
def stranger(simbase):
    """Another server (another host key)."""
    return sim.node_up("rtx-a4000-x2", simbase)


def moved_node(provider, info, simbase, *, authorize=True, state=NodeState.OFFLINE):
    """A node the platform reached (its host key pinned: `info`'s), recorded at OLD:its port."""
    node = make_listed_node(provider, gpu_model="rtx-a4000", gpu_count=2, address=OLD, ssh_port=info["ssh_port"],
                            ssh_user=info["ssh_user"], host_key_fingerprint=info["host_key_fingerprint"])
    Node.objects.filter(pk=node.pk).update(state=state, control_proven_at=timezone.now())
    if authorize:
        sim.node_authorize(info["ssh_port"], node.ssh_public_key, simbase)
    node.refresh_from_db()
    return node


def endpoint(node):
    node.refresh_from_db()
    return node.address, node.ssh_port, node.ssh_user


def test_a_moved_server_is_proven_stored_and_its_renters_follow(api, server, simbase, broker):
    node = moved_node(api.user, server, simbase, state=NodeState.ACTIVE)
    renter = UserFactory()
    instance = run(book(renter, node), host=OLD, port=40001)
    Instance.objects.filter(pk=instance.pk).update(ports={"8888/tcp": {"host": OLD, "port": 40002}})
    Node.objects.filter(pk=node.pk).update(state=NodeState.OFFLINE)  # unreachable at OLD: went offline

    r = api.patch(f"{URL}{node.pk}/", {"address": "127.0.0.1"}, format="json")

    assert r.status_code == 200, r.json()
    assert r.json()["address"] == "127.0.0.1"
    assert endpoint(node) == ("127.0.0.1", server["ssh_port"], server["ssh_user"])
    node.refresh_from_db()
    assert node.host_key_fingerprint == server["host_key_fingerprint"] and node.state == NodeState.OFFLINE
    instance.refresh_from_db()
    assert (instance.ssh_host, instance.ssh_port) == ("127.0.0.1", 40001)
    assert instance.ports == {"8888/tcp": {"host": "127.0.0.1", "port": 40002}}
    notice = Notification.objects.get(user=renter, dedupe_key__contains=f"instance-{instance.pk}-endpoint-")
    assert notice.title == "Instance's SSH address changed" and "127.0.0.1" in notice.body
    event = NodeEvent.objects.get(node=node, kind="endpoint_changed")
    assert OLD in event.message and "127.0.0.1" in event.message and server["host_key_fingerprint"] in event.message
    assert "endpoint_changed" in PROVIDER_KINDS
    events = api.get(f"{URL}{node.pk}/events/").json()["results"]
    assert events[0]["title"] == "SSH address changed" and "127.0.0.1" in events[0]["message"]

    # The normal health path takes the offline node back, at its new address.
    pool = SshPool()
    try:
        assert fleet.nodes_health_batch([node.pk], pool=pool)["failed"] == 0
    finally:
        pool.close_all()
    node.refresh_from_db()
    assert node.state == NodeState.ACTIVE, node.last_error


def test_another_servers_host_key_is_refused_without_quarantine(api, server, stranger, simbase):
    node = moved_node(api.user, server, simbase)
    sim.node_authorize(stranger["ssh_port"], node.ssh_public_key, simbase)  # it would even take the node's key
    before = endpoint(node)

    r = api.patch(f"{URL}{node.pk}/", {"address": "127.0.0.1", "ssh_port": stranger["ssh_port"]}, format="json")

    assert r.status_code == 400
    message = r.json()["address"][0]
    assert f"presented the SSH host key {stranger['host_key_fingerprint']}" in message
    assert "not this node's pinned key" in message and "Nothing was changed" in message
    assert endpoint(node) == before
    node.refresh_from_db()
    assert node.state == NodeState.OFFLINE and node.seen_host_key_fingerprint == ""
    assert not NodeEvent.objects.filter(node=node).exclude(kind="host_key_pinned").exists()


def test_the_node_key_refused_at_the_new_address_is_said(api, stranger, simbase):
    node = moved_node(api.user, stranger, simbase, authorize=False)
    before = endpoint(node)

    r = api.patch(f"{URL}{node.pk}/", {"address": "127.0.0.1"}, format="json")

    assert r.status_code == 400
    assert "refused the platform's key" in r.json()["ssh_user"][0]
    assert endpoint(node) == before


def test_nothing_answering_is_said_without_the_transports_words(api, server, simbase):
    node = moved_node(api.user, server, simbase)
    before = endpoint(node)

    r = api.patch(f"{URL}{node.pk}/", {"ssh_port": 1}, format="json")  # a closed port

    assert r.status_code == 400
    message = r.json()["address"][0]
    assert message.startswith("Could not open an SSH session at 127.0.0.2:1 within")
    assert "Errno" not in message and "refused" not in message.lower()
    assert endpoint(node) == before


def test_the_address_rules_of_registration_hold(api, server, simbase, settings):
    node = moved_node(api.user, server, simbase)
    before = endpoint(node)
    assert api.patch(f"{URL}{node.pk}/", {"address": "169.254.169.254"}, format="json").status_code == 400
    settings.NODE_ADDRESS_ALLOWED_NETWORKS = []  # production: loopback refused
    r = api.patch(f"{URL}{node.pk}/", {"address": "127.0.0.1"}, format="json")
    assert r.status_code == 400 and r.json()["address"][0].startswith("Not a public address")
    assert endpoint(node) == before


def test_another_own_node_at_the_endpoint_is_a_409_before_any_connection(api, server, simbase):
    node = moved_node(api.user, server, simbase)
    other = make_node(api.user, address="10.0.0.9", ssh_port=2200)
    r = api.patch(f"{URL}{node.pk}/", {"address": "10.0.0.9", "ssh_port": 2200}, format="json")
    assert r.status_code == 409 and "already registered at 10.0.0.9:2200" in r.json()["detail"]
    assert endpoint(node)[0] == OLD and endpoint(other)[0] == "10.0.0.9"


def test_a_pending_node_never_contacted_simply_changes(api):
    node = make_node(api.user, address="10.0.0.7", ssh_port=22, ssh_user="gpu")  # nothing answers at 10.0.0.x
    r = api.patch(f"{URL}{node.pk}/", {"address": "10.0.0.8", "ssh_port": 2222, "ssh_user": "ubuntu"},
                  format="json")
    assert r.status_code == 200, r.json()
    assert endpoint(node) == ("10.0.0.8", 2222, "ubuntu")
    assert "no proof" in NodeEvent.objects.get(node=node, kind="endpoint_changed").message


def test_not_while_its_check_runs(api):
    node = make_node(api.user, address="10.0.0.7", state=NodeState.VERIFYING)
    r = api.patch(f"{URL}{node.pk}/", {"ssh_port": 2222, "name": "renamed"}, format="json")
    assert r.status_code == 409 and "check runs" in r.json()["detail"]
    node.refresh_from_db()
    assert node.ssh_port != 2222 and node.name == "node"  # nothing of the request stored


def test_with_other_fields_a_refused_proof_stores_nothing_a_proven_one_both(api, server, simbase):
    node = moved_node(api.user, server, simbase)
    r = api.patch(f"{URL}{node.pk}/", {"ssh_port": 1, "name": "renamed"}, format="json")
    assert r.status_code == 400 and "Could not open an SSH session" in r.json()["address"][0]
    node.refresh_from_db()
    assert node.ssh_port == server["ssh_port"] and node.address == OLD and node.name == "node"
    r = api.patch(f"{URL}{node.pk}/", {"address": "127.0.0.1", "name": "renamed"}, format="json")
    assert r.status_code == 200, r.json()
    node.refresh_from_db()
    assert node.address == "127.0.0.1" and node.name == "renamed"


def test_the_settings_page_changes_it_with_the_same_proof(client, server, stranger, simbase):
    provider = UserFactory()
    client.force_login(provider)
    node = moved_node(provider, server, simbase)
    url = f"/nodes/{node.pk}/settings/"
    page = client.get(f"/nodes/{node.pk}/")
    assert page.status_code == 200 and 'name="address"' in page.content.decode()
    form = {"price_per_gpu_hour": "1.500000", "address": "127.0.0.1", "ssh_port": str(stranger["ssh_port"]),
            "ssh_user": server["ssh_user"]}
    r = client.post(url, form)
    assert r.status_code == 400 and "not this node&#x27;s pinned key" in r.content.decode()
    assert endpoint(node)[0] == OLD
    r = client.post(url, {**form, "ssh_port": str(server["ssh_port"])})
    assert r.status_code == 302
    assert endpoint(node) == ("127.0.0.1", server["ssh_port"], server["ssh_user"])
