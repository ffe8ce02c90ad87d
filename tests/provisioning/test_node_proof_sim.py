"""Over real SSH against a simulated server: a node squatting another provider's server (its address and port, its
host key as `ssh-keyscan` reads it) never proves control of it, and its owner registers and verifies theirs; a
second node of a server a proven node holds is rejected at its first contact, with its reason recorded on the node
(found by review: before, the squatter's pending node kept the owner out for good)."""
import pytest
from django.utils import timezone

from marketplace.models import Node, NodeState, Verdict
from marketplace.models.nodes import OFFERABLE
from provisioning import sim
from provisioning.models import VerificationRun
from provisioning.services.nodes import node_health_probe
from tests.factories import UserFactory, make_node
from tests.provisioning.test_duplicate_nodes import assert_names_no_other_account, register, uuids, verify

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def simbase(tmp_path_factory):
    base = tmp_path_factory.mktemp("proof-simnodes")
    yield base
    sim.nodes_down(base)


@pytest.fixture(scope="module")
def server(simbase):
    return sim.node_up("rtx-a4000-x2", simbase)


def test_a_squatters_node_never_proves_control_and_the_owner_verifies_their_server(server, simbase):
    # The squatter registers the owner's server first, its address, port and host key, but cannot install the
    # node's key on it: the platform's login is refused, and the node proves nothing.
    squatter = make_node(UserFactory(), gpu_model="rtx-a4000", gpu_count=2, name="squatter-zz9",
                         address=server["address"], ssh_port=server["ssh_port"], ssh_user=server["ssh_user"],
                         host_key_fingerprint=server["host_key_fingerprint"])
    result = node_health_probe(squatter)
    assert not result.ok and "Could not log in to" in result.error, result.error  # the first-contact message
    squatter.refresh_from_db()
    assert squatter.control_proven_at is None
    # Its owner registers the same server (same address, port and host key), installs the key and verifies it.
    owner = register(server, simbase, name="owners-own")
    owner, _ = verify(owner)
    assert (owner.state, owner.verdict) == (NodeState.ACTIVE, Verdict.VERIFIED), owner.last_error
    assert owner.control_proven_at is not None
    assert list(Node.objects.filter(OFFERABLE).values_list("pk", flat=True)) == [owner.pk]
    assert_names_no_other_account(owner.last_error, squatter)


def test_the_second_node_of_a_proven_server_is_rejected_at_first_contact_with_its_reason(server, simbase):
    first, _ = verify(register(server, simbase, pin=False, name="first-of-two-zz9"))
    assert first.verdict == Verdict.VERIFIED and first.control_proven_at is not None, first.last_error
    # Another account, the same address and port and host key: registered (registering tells nothing) ...
    second = register(server, simbase, name="second")
    assert second.control_proven_at is None
    # ... and rejected at its first contact, once it proved control, its reason on the node.
    second, job = verify(second)
    assert (second.state, second.verdict) == (NodeState.REJECTED, Verdict.REJECTED)
    assert job.status == "succeeded"
    run = VerificationRun.objects.get(node=second)
    assert [f["code"] for f in run.findings] in (["duplicate_host_key"], ["duplicate_address"])
    assert second.last_error.startswith("Rejected: ") and "another live node" in second.last_error.lower()
    assert_names_no_other_account(second.last_error, first)
    assert second.control_proven_at is None and uuids(second) == ["", ""]
    first.refresh_from_db()
    assert (first.state, first.verdict) == (NodeState.ACTIVE, Verdict.VERIFIED)
    assert timezone.now() >= first.control_proven_at
