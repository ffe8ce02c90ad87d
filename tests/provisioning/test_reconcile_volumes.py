"""The reconciler and volumes (issue 12): a volume on the node that the platform does not know (or deleted) is
deleted there and reported; a volume the platform has as available but the node lacks is reported, once; known
volumes are left alone. Against a simulated node over real SSH, its agent's own `volume` commands."""
import pytest

from billing.services.ledger import credit_grant
from marketplace.models import Volume, VolumeState
from marketplace.services import volumes as volume_svc
from provisioning.models import Job, JobKind, NodeEvent
from provisioning.services.nodes import node_session
from provisioning.services.reconcile import node_reconcile
from provisioning.services.volumes import volume_job_failed
from provisioning.sim import nodes as sim
from provisioning.ssh_errors import NodeUnreachable
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


def test_a_failed_volume_whose_delete_the_node_refuses_is_failed_again_not_available_and_unbilled(node):
    volume = volume_svc.volume_create(owner=UserFactory(), node_id=node.pk, size_gb=1)
    volume_svc.volume_mark_failed(volume_id=volume.pk, message="the node was unreachable")
    volume_svc.volume_delete(volume=Volume.objects.get(pk=volume.pk), confirm=volume.name)
    volume_svc.volume_delete_refused(volume_id=volume.pk, message="its node says: in use")
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


def _delete_gave_up(volume) -> None:
    """The renter deleted it; its job could not reach the node and gave up (the volume stays `deleting`)."""
    volume_svc.volume_delete(volume=Volume.objects.get(pk=volume.pk), confirm=volume.name)
    job = Job.objects.get(volume=volume, kind=JobKind.VOLUME_DELETE)
    volume_job_failed(job=job, error=NodeUnreachable("the node did not answer"))


def test_a_deletion_whose_job_could_not_reach_the_node_is_finished_when_the_node_answers(node):
    """Found by review: the job's giving up undid the deletion, and the volume was billed again from the node's
    last healthy moment. Now it stays `deleting` (billed up to the request) and the reconciler deletes it."""
    gone = _platform_volume(node, on_node=True)
    never_made = _platform_volume(node, on_node=False)  # deleted there already: the agent's delete is idempotent
    kept = _platform_volume(node, on_node=True)
    _delete_gave_up(gone)
    _delete_gave_up(never_made)
    assert Volume.objects.get(pk=gone.pk).state == VolumeState.DELETING
    counts = node_reconcile(node)
    assert counts["volumes_deleted"] == 2 and counts["orphan_volumes_deleted"] == 0
    assert _on_node(node) == {kept.name}
    assert dict(Volume.objects.filter(node=node).values_list("pk", "state")) == {
        gone.pk: VolumeState.DELETED, never_made.pk: VolumeState.DELETED, kept.pk: VolumeState.AVAILABLE}
    assert NodeEvent.objects.filter(node=node, kind="volume_deleted_late").count() == 2
    assert node_reconcile(node)["volumes_deleted"] == 0


def test_a_deletion_left_to_its_open_job_is_not_finished_by_the_reconciler(node):
    volume = _platform_volume(node, on_node=True)
    volume_svc.volume_delete(volume=Volume.objects.get(pk=volume.pk), confirm=volume.name)  # its job is queued
    assert node_reconcile(node)["volumes_deleted"] == 0
    assert _on_node(node) == {volume.name} and Volume.objects.get(pk=volume.pk).state == VolumeState.DELETING


def test_a_late_deletion_the_node_refuses_is_undone_as_the_jobs_would_be(node):
    renter = UserFactory()
    credit_grant(user=renter, amount_micros=100_000_000, reason="tests")
    volume = _platform_volume(node, on_node=True)
    instance = book(renter, node)  # a VM the platform knows, which mounts it there
    with node_session(node) as session:
        session.agent("vm", "create", {"runtime": "sim", "vm_id": f"inst-{instance.pk}", "gpu_indices": [0],
                                       "ssh_public_keys": [ed25519_key()],
                                       "volumes": [{"name": volume.name, "mount": "/data"}]})
    _delete_gave_up(volume)
    counts = node_reconcile(node)
    volume.refresh_from_db()
    assert counts["volumes_deleted"] == 0 and volume.state == VolumeState.AVAILABLE
    assert "Not deleted" in volume.status_message and volume.name in _on_node(node)


def test_a_node_that_answers_after_an_outage_bills_its_volumes_from_its_answer(node, settings):
    """The reconciler runs before the node's answer is recorded: it moves the storage's billing on, so that the meter
    does not catch the outage up (billing.services.storage.node_storage_outage_end)."""
    from datetime import timedelta

    from django.utils import timezone

    volume = _platform_volume(node, on_node=True)
    healthy = timezone.now() - timedelta(hours=3)
    Volume.objects.filter(pk=volume.pk).update(available_at=healthy - timedelta(minutes=10))
    node.last_seen_at, node.health_failures = healthy, settings.NODE_INTERRUPT_AFTER_FAILED_CHECKS
    node.save(update_fields=["last_seen_at", "health_failures"])
    before = timezone.now()
    node_reconcile(node)
    volume.refresh_from_db()
    assert volume.billed_seconds == 600 and volume.billed_until >= before  # ten minutes, then from its answer
