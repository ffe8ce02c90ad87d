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


def test_a_failed_volume_whose_disk_the_node_made_is_deleted_there_and_stays_failed(node):
    # Its create job gave up (or was reaped) after the node had made it: the renter was told it could not be
    # created and it is never billed, so nothing of theirs is on it; the provider's disk is given back.
    volume = volume_svc.volume_create(owner=UserFactory(), node_id=node.pk, size_gb=1)
    _create_on_node(node, volume.name)
    volume_svc.volume_mark_failed(volume_id=volume.pk, message="its job was reaped")
    counts = node_reconcile(node)
    assert counts["orphan_volumes_deleted"] == 1 and _on_node(node) == set()
    event = NodeEvent.objects.get(node=node, kind="orphan_volume_deleted")
    assert volume.name in event.message and "creation failed" in event.message
    assert Volume.objects.get(pk=volume.pk).state == VolumeState.FAILED


def test_a_failed_volume_whose_delete_gives_up_is_failed_again_not_available_and_unbilled(node):
    volume = volume_svc.volume_create(owner=UserFactory(), node_id=node.pk, size_gb=1)
    volume_svc.volume_mark_failed(volume_id=volume.pk, message="the node was unreachable")
    volume_svc.volume_delete(volume=Volume.objects.get(pk=volume.pk), confirm=volume.name)
    volume_svc.volume_delete_refused(volume_id=volume.pk, message="the node stayed unreachable")
    volume.refresh_from_db()
    # Before: available with no available_at, so never billed, and mountable though it may not exist.
    assert volume.state == VolumeState.FAILED and volume.available_at is None
    assert "Not deleted" in volume.status_message


class _Between:
    """The node's session, with `then` run right after the node answered `list` (a VM's or volume's list): what
    another worker commits while the reconciler holds the node's answer and has not read the database yet."""

    def __init__(self, session, what: str, then):
        self._session, self._what, self._then = session, what, then

    def agent(self, *args, **kwargs):
        answer = self._session.agent(*args, **kwargs)
        if args[:2] == (self._what, "list") and self._then is not None:
            self._then()
            self._then = None
        return answer

    def __getattr__(self, name):
        return getattr(self._session, name)


@pytest.fixture
def between(monkeypatch):
    """between(what, then): the reconciler's next session runs `then` after the node answers `<what> list`."""
    import contextlib

    from provisioning.services import reconcile

    def arm(what, then):
        real = reconcile.node_session

        @contextlib.contextmanager
        def wrapped(node, **kwargs):
            with real(node, **kwargs) as session:
                yield _Between(session, what, then)

        monkeypatch.setattr(reconcile, "node_session", wrapped)
    return arm


def test_an_instance_that_becomes_running_while_the_node_lists_its_vms_is_not_failed(node, between):
    from tests.marketplace.renting_helpers import run

    renter = UserFactory()
    credit_grant(user=renter, amount_micros=100_000_000, reason="tests")
    instance = book(renter, node)  # being provisioned: its VM is made just after the node's list
    between("vm", lambda: run(instance))
    counts = node_reconcile(node)
    instance.refresh_from_db()
    assert counts["instances_failed"] == 0 and instance.status == "running"
    assert not NodeEvent.objects.filter(node=node, kind="vm_vanished").exists()


def test_a_volume_made_or_deleted_while_the_node_lists_its_volumes_is_judged_next_time(node, between):
    made = volume_svc.volume_create(owner=UserFactory(), node_id=node.pk, size_gb=1)
    gone = _platform_volume(node, on_node=True)
    volume_svc.volume_delete(volume=gone, confirm=gone.name)

    def meanwhile():  # `made` reaches the node and the database after the list; `gone` is deleted on both
        _create_on_node(node, made.name)
        volume_svc.volume_mark_available(volume_id=made.pk)
        with node_session(node) as session:
            session.agent("volume", "delete", {"name": gone.name})
        volume_svc.volume_mark_deleted(volume_id=gone.pk)
    between("volume", meanwhile)
    counts = node_reconcile(node)
    assert counts["volumes_missing"] == 0 and counts["orphan_volumes_deleted"] == 0
    assert not NodeEvent.objects.filter(node=node, kind__in=["volume_missing", "orphan_volume_deleted"]).exists()
    assert node_reconcile(node) == {**counts}  # and the next run, with both settled, finds nothing either
