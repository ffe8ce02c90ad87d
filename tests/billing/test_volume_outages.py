"""Volumes on a node that stops answering (found by review):

- a deletion whose job cannot reach the node stays `deleting`, billed up to the request, and is finished when the
  node answers (provisioning/test_reconcile_volumes.py); before, the job's giving up undid it, and the volume was
  billed again from the node's last healthy moment: the outage and every second after the request;
- only the node's refusal (a VM there still mounts it) undoes a deletion;
- the grace period's deletion of such a volume is asked once, not at every tick;
- retiring an unreachable node ends its volumes (deleted, billed up to its last healthy moment, the renter told);
  before, the retire was refused for as long as the volume existed, and the renter could not delete it either;
- an outage (long enough to interrupt instances) is not billed to the storage on the node once it answers again;
  a shorter silence is caught up, as GPU time is.
"""
import pytest

from billing.services.storage import node_storage_outage_end, storage_cost, storage_meter
from core.errors import Conflict
from marketplace.models import NodeState, Volume, VolumeState
from marketplace.services import nodes as node_svc
from marketplace.services import volumes as volume_svc
from notifications.models import Notification
from provisioning.models import Job, JobKind, JobStatus
from provisioning.services.maintenance import jobs_reap
from provisioning.services.volumes import volume_delete_run, volume_job_failed
from provisioning.ssh_errors import AgentFailed, NodeUnreachable
from tests.billing.helpers import fund, node, running, stop

pytestmark = pytest.mark.django_db
PRICE = 300_000


def _on(clock):
    on = node()
    on.disk_price_per_gb_month_micros = PRICE
    on.last_seen_at, on.health_failures = clock.now, 0
    on.save()
    return on


def _available(user, on, size_gb=100) -> Volume:
    volume = volume_svc.volume_create(owner=user, node_id=on.pk, size_gb=size_gb)
    return volume_svc.volume_mark_available(volume_id=volume.pk)


def _silent(on, clock, failures=60):
    """The node's last healthy answer is now; then `failures` checks in a row fail."""
    on.last_seen_at = clock.now
    on.state, on.health_failures = "offline", failures
    on.save(update_fields=["last_seen_at", "state", "health_failures"])


def _answers(on, clock):
    """What the health check records once the node answers (after its reconciler ran)."""
    on.last_seen_at, on.state, on.health_failures = clock.now, "active", 0
    on.save(update_fields=["last_seen_at", "state", "health_failures"])


def _delete_job(volume) -> Job:
    return Job.objects.get(volume=volume, kind=JobKind.VOLUME_DELETE)


def test_a_deletion_asked_while_the_node_is_away_is_not_billed_after_the_request(clock, user):
    """The review's reproduction: deleted 600 s after it was created, it was billed 12,000 s."""
    fund(user, "100")
    on = _on(clock)
    volume = _available(user, on)
    clock.advance(600)
    _silent(on, clock)
    clock.advance(600)
    volume_svc.volume_delete(volume=Volume.objects.get(pk=volume.pk), confirm=volume.name)
    volume.refresh_from_db()
    assert volume.billed_seconds == 600
    volume_job_failed(job=_delete_job(volume), error=NodeUnreachable("the node did not answer"))
    volume.refresh_from_db()
    assert volume.state == VolumeState.DELETING and volume.deleted_at is not None
    assert "could not be reached" in volume.status_message and "Billing stopped" in volume.status_message
    clock.advance(3 * 3600)
    node_storage_outage_end(node_id=on.pk)  # the node answers: its reconciler first
    _answers(on, clock)
    storage_meter(now=clock.now)
    volume.refresh_from_db()
    assert (volume.state, volume.billed_seconds) == (VolumeState.DELETING, 600)
    assert volume.cost_micros == storage_cost(size_gb=100, price_per_gb_month_micros=PRICE, seconds=600)


def test_a_deletion_refused_after_an_outage_is_billed_again_from_the_answer_not_across_the_outage(clock, user):
    """Asked during a 3-hour outage, refused once the node answers (its reconciler's _finish_deletions: a VM still
    mounts it): billed again from the answer. Before, from the last healthy moment: the outage too (found by
    review: 12,060 s billed for 660)."""
    fund(user, "100")
    on = _on(clock)
    volume = _available(user, on)
    clock.advance(600)
    _silent(on, clock)
    clock.advance(600)
    volume_svc.volume_delete(volume=Volume.objects.get(pk=volume.pk), confirm=volume.name)
    volume_job_failed(job=_delete_job(volume), error=NodeUnreachable("the node did not answer"))
    clock.advance(3 * 3600)
    assert node_storage_outage_end(node_id=on.pk) == 1  # the node answers: its reconciler, first
    volume_svc.volume_delete_refused(volume_id=volume.pk, message="its node says: mounted by VM inst-7")
    _answers(on, clock)
    clock.advance(60)
    _answers(on, clock)
    storage_meter(now=clock.now)
    volume.refresh_from_db()
    assert volume.state == VolumeState.AVAILABLE
    assert volume.billed_seconds == 600 + 60
    assert volume.cost_micros == storage_cost(size_gb=100, price_per_gb_month_micros=PRICE, seconds=660)


def test_a_reaped_delete_job_leaves_the_deletion_asked_for_too(clock, user):
    fund(user, "100")
    on = _on(clock)
    volume = _available(user, on)
    volume_svc.volume_delete(volume=volume, confirm=volume.name)
    Job.objects.filter(pk=_delete_job(volume).pk).update(deadline=clock.now)
    clock.advance(60)
    jobs_reap()
    volume.refresh_from_db()
    assert volume.state == VolumeState.DELETING and _delete_job(volume).status == JobStatus.FAILED


def test_only_the_nodes_refusal_undoes_a_deletion(clock, user, monkeypatch):
    """A VM on the node still mounts it: the node says no, the volume is there and billed again from the request."""
    fund(user, "100")
    on = _on(clock)
    volume = _available(user, on)
    clock.advance(600)
    volume_svc.volume_delete(volume=volume, confirm=volume.name)

    class Refusing:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def agent(self, *args, **kwargs):
            raise AgentFailed({"code": "volume_in_use", "message": "mounted by VM inst-7"})

    monkeypatch.setattr("provisioning.services.volumes.node_session", lambda node: Refusing())
    monkeypatch.setattr("provisioning.services.volumes.job_step", lambda **kwargs: None)
    volume_delete_run(job=_delete_job(volume))
    volume.refresh_from_db()
    assert volume.state == VolumeState.AVAILABLE and "mounted by VM inst-7" in volume.status_message
    assert volume.billed_seconds == 600 and volume.deleted_at is None


def test_the_grace_periods_deletion_on_an_unreachable_node_is_asked_once(clock, user, settings):
    """At zero past the grace period, the volume is deleted; its job cannot reach the node. Undone, the next tick
    asked again, and again (a job per minute, for as long as the node was away)."""
    from billing.services.enforcement import balances_enforce
    settings.BILLING_GRACE_PERIOD_S = 3600
    settings.BILLING_DESTROY_WARNING_S = 600
    on = _on(clock)
    settings.BILLING_REQUIRE_FUNDS = False  # a renter at zero with a volume (as after its balance ran out)
    volume = _available(user, on)
    settings.BILLING_REQUIRE_FUNDS = True
    clock.advance(60)
    _silent(on, clock)
    balances_enforce(now=clock.now)
    clock.advance(3000)
    balances_enforce(now=clock.now)  # the destroy warning (nothing is deleted that no warning named)
    clock.advance(600 + 60)
    balances_enforce(now=clock.now)
    volume.refresh_from_db()
    assert volume.state == VolumeState.DELETING
    volume_job_failed(job=_delete_job(volume), error=NodeUnreachable("the node did not answer"))
    for _ in range(3):
        clock.advance(60)
        balances_enforce(now=clock.now)
    volume.refresh_from_db()
    assert volume.state == VolumeState.DELETING
    assert Job.objects.filter(volume=volume, kind=JobKind.VOLUME_DELETE).count() == 1


def test_retiring_an_unreachable_node_ends_its_volumes_and_tells_their_renters(clock, user):
    fund(user, "100")
    on = _on(clock)
    kept = _available(user, on, size_gb=10)
    deleting = _available(user, on, size_gb=20)
    creating = volume_svc.volume_create(owner=user, node_id=on.pk, size_gb=30)
    clock.advance(600)
    _silent(on, clock)
    clock.advance(600)
    volume_svc.volume_delete(volume=Volume.objects.get(pk=deleting.pk), confirm=deleting.name)
    volume_job_failed(job=_delete_job(deleting), error=NodeUnreachable("the node did not answer"))
    clock.advance(3 * 86400)
    node_svc.node_retire(node=on)
    on.refresh_from_db()
    assert on.state == NodeState.RETIRED
    states = dict(Volume.objects.filter(node=on).values_list("pk", "state"))
    assert states == {kept.pk: VolumeState.DELETED, deleting.pk: VolumeState.DELETED,
                      creating.pk: VolumeState.FAILED}
    kept.refresh_from_db()
    assert kept.billed_seconds == 600 and "retired" in kept.status_message  # up to its last healthy moment
    told = Notification.objects.get(user=user, kind="volume_lost")
    assert kept.name in told.payload["message"] and "cannot be recovered" in told.payload["message"]
    assert not Notification.objects.filter(user=user, kind="volume_lost", payload__volume=deleting.pk).exists()
    event = on.events.get(kind="retired_unreachable")
    assert f"volume(s) {kept.pk}, {deleting.pk}, {creating.pk} ended" in event.message


def test_a_reachable_nodes_volumes_still_refuse_the_retire(clock, user):
    fund(user, "100")
    on = _on(clock)
    volume = _available(user, on)
    with pytest.raises(Conflict, match="1 volume keeps a renter's data"):
        node_svc.node_retire(node=on)
    volume_svc.volume_delete(volume=volume, confirm=volume.name)
    with pytest.raises(Conflict, match="still deleting 1 volume"):
        node_svc.node_retire(node=on)
    volume_svc.volume_mark_deleted(volume_id=volume.pk)
    node_svc.node_retire(node=on)


def test_an_outage_is_not_billed_to_the_storage_on_the_node(clock, user):
    """Available through a 3-hour outage: billed up to the last healthy moment, then again from the node's answer.
    Before, the meter caught the outage up when the node answered. A stopped instance's disk, the same."""
    fund(user, "100")
    on = _on(clock)
    volume = _available(user, on)
    disk = stop(running(user, on))
    clock.advance(600)
    _silent(on, clock)
    clock.advance(3 * 3600)
    storage_meter(now=clock.now)
    assert node_storage_outage_end(node_id=on.pk) == 2  # the node answers: its reconciler, first
    assert node_storage_outage_end(node_id=on.pk) == 0  # again: nothing moves
    _answers(on, clock)
    clock.advance(300)
    _answers(on, clock)
    storage_meter(now=clock.now)
    volume.refresh_from_db()
    disk.refresh_from_db()
    assert volume.billed_seconds == 600 + 300 and disk.disk_billed_seconds == 600 + 300


def test_a_short_silence_is_caught_up_as_gpu_time_is(clock, user, settings):
    settings.NODE_INTERRUPT_AFTER_FAILED_CHECKS = 2
    fund(user, "100")
    on = _on(clock)
    volume = _available(user, on)
    clock.advance(600)
    _silent(on, clock, failures=1)  # one failed check: no instance is interrupted either
    clock.advance(60)
    storage_meter(now=clock.now)
    assert node_storage_outage_end(node_id=on.pk) == 0
    _answers(on, clock)
    storage_meter(now=clock.now)
    volume.refresh_from_db()
    assert volume.billed_seconds == 660
