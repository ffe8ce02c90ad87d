"""An orphan volume a VM still mounts (`orphan_volume_in_use`) is reported when the condition starts, and again
when it changes (other VMs mount it), not at every reconcile pass while it lasts: written at every pass, one such
volume added an event every RECONCILE_INTERVAL_S (and at every health check that reconciled the node), burying the
node's other events. Against a simulated node over real SSH, its agent's own `vm` and `volume` commands."""
import pytest

from billing.services.ledger import credit_grant
from provisioning.models import NodeEvent
from provisioning.services.nodes import node_session
from provisioning.services.reconcile import node_reconcile
from provisioning.sim import nodes as sim
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book, ed25519_key

pytestmark = pytest.mark.django_db

ORPHAN = "vol-fedcba9876543210"


@pytest.fixture(scope="module")
def simbase(tmp_path_factory):
    base = tmp_path_factory.mktemp("round44-orphan-volume")
    yield base
    sim.nodes_down(base)


@pytest.fixture
def node(simbase):
    info = sim.node_up("rtx-a4000-x2", simbase)
    node = make_listed_node(UserFactory(), gpu_model="rtx-a4000", gpu_count=2, address=info["address"],
                            ssh_port=info["ssh_port"], ssh_user=info["ssh_user"],
                            host_key_fingerprint=info["host_key_fingerprint"])
    sim.node_authorize(info["ssh_port"], node.ssh_public_key, simbase)
    yield node
    sim.node_down(info["ssh_port"], simbase)


def _vm_mounting(node, instance, gpu_index: int) -> None:
    with node_session(node) as session:
        session.agent("vm", "create", {"runtime": "sim", "vm_id": f"inst-{instance.pk}", "gpu_indices": [gpu_index],
                                       "ssh_public_keys": [ed25519_key()],
                                       "volumes": [{"name": ORPHAN, "mount": "/data"}]})


def test_an_orphan_volume_in_use_is_reported_when_it_starts_and_when_it_changes_not_at_every_pass(node):
    renter = UserFactory()
    credit_grant(user=renter, amount_micros=100_000_000, reason="tests")
    first = book(renter, node)  # known to the platform: its VM stays
    with node_session(node) as session:
        session.agent("volume", "create", {"name": ORPHAN, "size_gb": 1})
    _vm_mounting(node, first, 0)
    events = NodeEvent.objects.filter(node=node, kind="orphan_volume_in_use")

    for _ in range(3):  # three passes while nothing changes
        assert node_reconcile(node)["orphan_volumes_deleted"] == 0
    assert events.count() == 1, "the same condition was written again at every reconcile pass"
    assert f"inst-{first.pk}" in events.get().message

    second = book(renter, node)
    _vm_mounting(node, second, 1)  # the condition changes: another VM mounts it too
    node_reconcile(node)
    node_reconcile(node)
    assert events.count() == 2
    latest = events.order_by("-id").first()
    assert f"inst-{first.pk}" in latest.message and f"inst-{second.pk}" in latest.message
