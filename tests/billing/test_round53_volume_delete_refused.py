"""A volume deletion its node refuses (a VM there still mounts it), found by review r53:

- the grace period's deletion, refused, was asked again at every tick (60 s), each time e-mailing "your volumes ...
  were deleted", billing a minute and sending the node a new delete job, for as long as the node refused; now the
  refusal gives it a new warning and its own grace period, and the e-mail says it is being deleted, not deleted;
- a refused deletion (the renter's own, or the grace period's) started billing again silently, after the page had
  said billing stopped; now its renter is told, once per refused request."""
import pytest

from billing.models import BillingEvent, BillingProfile, EventKind
from billing.tasks import usage_meter_tick
from marketplace.models import Volume
from marketplace.services import volumes as volume_svc
from provisioning.models import Job
from provisioning.services.runner import job_finish
from tests.billing.helpers import fund, node

pytestmark = pytest.mark.django_db
REFUSAL = "its node says: volume vol-x is mounted by VM 99"


@pytest.fixture
def tick(django_capture_on_commit_callbacks):
    def run_tick():
        with django_capture_on_commit_callbacks(execute=True):
            usage_meter_tick()
    return run_tick


def _refused(volume):
    """What the delete job does when the node refuses."""
    volume_svc.volume_delete_refused(volume_id=volume.pk, message=REFUSAL)
    job_finish(job=Job.objects.filter(volume=volume, kind="volume_delete", finished_at=None).get(),
               error="in use", fault="platform")


def test_a_grace_deleted_volume_the_node_refuses_is_not_asked_again_every_tick(clock, user, tick, settings):
    settings.BILLING_GRACE_PERIOD_S = 86400
    settings.BILLING_DESTROY_WARNING_S = 3600
    on = node("1.000000")
    on.disk_price_per_gb_month_micros = 1_000_000
    on.save(update_fields=["disk_price_per_gb_month_micros"])
    fund(user, "0.10")
    settings.BILLING_REQUIRE_FUNDS = False
    volume = volume_svc.volume_mark_available(
        volume_id=volume_svc.volume_create(owner=user, node_id=on.pk, size_gb=100).pk)
    settings.BILLING_REQUIRE_FUNDS = True
    for _ in range(9):
        clock.advance(600)
        tick()
    clock.advance(86400 - 3600 + 60)
    tick()  # the warning
    clock.advance(3600)
    tick()  # its time: asked to go
    destroyed = BillingEvent.objects.get(user=user, kind=EventKind.INSTANCES_DESTROYED)
    assert "being deleted" in destroyed.message and "were deleted" not in destroyed.message
    assert Volume.objects.get(pk=volume.pk).state == "deleting"
    before = BillingEvent.objects.filter(user=user).count()
    _refused(volume)
    for _ in range(3):  # the node keeps refusing: nothing is asked of it again, no e-mail says it was deleted
        clock.advance(60)
        tick()
        assert Volume.objects.get(pk=volume.pk).state == "available"
    kinds = list(BillingEvent.objects.filter(user=user).order_by("pk").values_list("kind", flat=True))[before:]
    assert kinds == [EventKind.VOLUME_NOT_DELETED], kinds
    assert Job.objects.filter(volume=volume, kind="volume_delete").count() == 1
    notice = BillingEvent.objects.get(user=user, kind=EventKind.VOLUME_NOT_DELETED)
    assert notice.emailed and volume.name in notice.message and "billed again from now" in notice.message
    # Its own grace period and a new warning: asked again only after them.
    entry = BillingProfile.objects.get(user=user).destroy_deadlines[f"volume:{volume.pk}"]
    assert entry["warned"] is False and "asked" not in entry
    clock.advance(86400 - 3600)
    tick()
    assert BillingEvent.objects.filter(user=user, kind=EventKind.DESTROY_WARNING).count() == 2
    clock.advance(3600)
    tick()
    assert Volume.objects.get(pk=volume.pk).state == "deleting"
    assert Job.objects.filter(volume=volume, kind="volume_delete").count() == 2


def test_a_renters_own_deletion_the_node_refuses_tells_them_billing_starts_again(user):
    on = node("1.000000")
    fund(user, "1.00")
    volume = volume_svc.volume_mark_available(
        volume_id=volume_svc.volume_create(owner=user, node_id=on.pk, size_gb=10).pk)
    volume_svc.volume_delete(volume=volume, confirm=volume.name)
    _refused(volume)
    _refused_again = volume_svc.volume_delete_refused(volume_id=volume.pk, message=REFUSAL)  # a job delivered twice
    assert _refused_again is not None and _refused_again.state == "available"
    events = list(BillingEvent.objects.filter(user=user, kind=EventKind.VOLUME_NOT_DELETED))
    assert len(events) == 1
    assert events[0].message.startswith(f"Volume {volume.name} was not deleted: {REFUSAL}. It exists, so it is "
                                        "billed again from now")


def test_a_failed_volumes_deletion_the_node_refuses_sends_no_billing_notice(user):
    """A volume never created (failed, never billed) whose deletion the node refuses goes back to failed, not billed:
    nothing about its billing changed, so no billing notice (its subject said "it is billed again"); its status line
    says why it was not deleted."""
    on = node("1.000000")
    fund(user, "1.00")
    volume = volume_svc.volume_create(owner=user, node_id=on.pk, size_gb=10)
    Job.objects.filter(volume=volume).update(status="failed", finished_at=volume.created_at)
    volume = volume_svc.volume_mark_failed(volume_id=volume.pk, message="could not be created")
    volume_svc.volume_delete(volume=volume, confirm=volume.name)
    _refused(volume)
    refused = Volume.objects.get(pk=volume.pk)
    assert refused.state == "failed" and refused.status_message.startswith("Not deleted: ")
    assert not BillingEvent.objects.filter(user=user, kind=EventKind.VOLUME_NOT_DELETED).exists()
