"""The reconciler and volumes (issue 12): a volume on the node that the platform does not know (or deleted) is
deleted there and reported; a volume the platform has as available but the node lacks is reported, once; known
volumes are left alone. Against a simulated node over real SSH, its agent's own `volume` commands."""
import pytest

from billing.services.ledger import credit_grant
from marketplace.models import Volume, VolumeState
from marketplace.services import volumes as volume_svc
from provisioning.models import NodeEvent
from provisioning.services.nodes import node_session
from provisioning.services.reconcile import node_reconcile
from provisioning.sim import nodes as sim
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book, ed25519_key

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def simbase(tmp_path_factory):
    base = tmp_path_factory.mktemp("reconcile-volumes")
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


def _on_node(node) -> set[str]:
    with node_session(node) as session:
        return {v["name"] for v in session.agent("volume", "list", {})["volumes"]}


def _create_on_node(node, name: str, size_gb: int = 1) -> None:
    with node_session(node) as session:
        session.agent("volume", "create", {"name": name, "size_gb": size_gb})


def _platform_volume(node, *, on_node: bool) -> Volume:
    volume = volume_svc.volume_create(owner=UserFactory(), node_id=node.pk, size_gb=1)
    if on_node:
        _create_on_node(node, volume.name)
    return volume_svc.volume_mark_available(volume_id=volume.pk)


def test_orphan_and_deleted_volumes_go_known_ones_stay_missing_ones_are_reported_once(node):
    kept = _platform_volume(node, on_node=True)
    missing = _platform_volume(node, on_node=False)
    deleted = _platform_volume(node, on_node=True)
    volume_svc.volume_delete(volume=deleted, confirm=deleted.name)
    volume_svc.volume_mark_deleted(volume_id=deleted.pk)  # as if the node had confirmed, yet it still has it
    creating = volume_svc.volume_create(owner=UserFactory(), node_id=node.pk, size_gb=1)
    _create_on_node(node, creating.name)  # its job is between the node's create and the database's
    _create_on_node(node, "vol-0123456789abcdef")  # a crash left it: no row at all
    assert _on_node(node) == {kept.name, deleted.name, creating.name, "vol-0123456789abcdef"}

    counts = node_reconcile(node)
    assert counts["orphan_volumes_deleted"] == 2 and counts["volumes_missing"] == 1
    assert _on_node(node) == {kept.name, creating.name}
    events = NodeEvent.objects.filter(node=node)
    deleted_events = events.filter(kind="orphan_volume_deleted")
    assert {e.message.split()[2] for e in deleted_events} == {deleted.name, "vol-0123456789abcdef"}
    assert events.get(kind="volume_missing").message.startswith(f"Volume {missing.name} (volume {missing.pk})")
    assert Volume.objects.get(pk=kept.pk).state == VolumeState.AVAILABLE
    assert Volume.objects.get(pk=creating.pk).state == VolumeState.CREATING

    again = node_reconcile(node)  # nothing new: the missing volume is not reported twice
    assert again["orphan_volumes_deleted"] == 0 and again["volumes_missing"] == 0
    assert events.filter(kind="volume_missing").count() == 1


def test_an_unknown_volume_a_vm_still_mounts_is_reported_not_deleted(node):
    renter = UserFactory()
    credit_grant(user=renter, amount_micros=100_000_000, reason="tests")
    instance = book(renter, node)  # known to the platform: its VM stays
    _create_on_node(node, "vol-fedcba9876543210")
    with node_session(node) as session:
        session.agent("vm", "create", {"runtime": "sim", "vm_id": f"inst-{instance.pk}", "gpu_indices": [0],
                                       "ssh_public_keys": [ed25519_key()],
                                       "volumes": [{"name": "vol-fedcba9876543210", "mount": "/data"}]})
    counts = node_reconcile(node)
    assert counts["orphan_volumes_deleted"] == 0 and counts["orphans_destroyed"] == 0
    assert _on_node(node) == {"vol-fedcba9876543210"}
    event = NodeEvent.objects.get(node=node, kind="orphan_volume_in_use")
    assert f"inst-{instance.pk}" in event.message and event.level == NodeEvent.Level.WARNING
