"""The grace period at zero balance and the volumes it ends (found by review r51).

- A volume held by a failed instance that ran (its VM kept on the node, mounting it) was never deleted: the failed
  instance was never destroyed, the volume's deletion was refused at every tick, and the volume was billed to a
  negative balance for ever past the deadline the warning gave.
- A volume mounted by a stopped instance was left out of the destroy warning ("volumes ... (none)"), yet deleted the
  tick after the deadline destroyed that instance: the warning must name every volume the deadline deletes."""
import pytest

from billing.models import BillingEvent
from billing.tasks import usage_meter_tick
from marketplace.models import Image
from marketplace.services import instances as svc
from marketplace.services import volumes as volume_svc
from tests.billing.helpers import ED25519, balance, fund, node, run, worker_done

pytestmark = pytest.mark.django_db


@pytest.fixture
def tick(django_capture_on_commit_callbacks):
    def run_tick():
        with django_capture_on_commit_callbacks(execute=True):
            usage_meter_tick()
    return run_tick


def _mounted(user, on, volume):
    instance, _ = svc.instance_create(renter=user, node_id=on.pk, num_gpus=1, image=Image.objects.get(
        slug="pytorch-2-5"), ssh_public_keys=[ED25519], volumes=[{"volume": volume.pk, "mount": "/data"}])
    return run(instance)


def _destroy_done(instance):
    """What the destroy's worker does once the node removed the VM."""
    instance.refresh_from_db()
    if instance.status == "destroying":
        svc.instance_mark_destroyed(instance_id=instance.pk)
        worker_done(instance)


def test_a_volume_held_by_a_failed_instance_is_not_billed_past_the_grace_period(clock, user, tick, settings):
    settings.BILLING_GRACE_PERIOD_S = 86400
    settings.BILLING_DESTROY_WARNING_S = 3600
    on = node("1.000000")
    on.disk_price_per_gb_month_micros = 1_000_000  # $1 per GB-month
    on.save(update_fields=["disk_price_per_gb_month_micros"])
    fund(user, "0.10")
    settings.BILLING_REQUIRE_FUNDS = False
    volume = volume_svc.volume_mark_available(
        volume_id=volume_svc.volume_create(owner=user, node_id=on.pk, size_gb=100).pk)  # ~$0.139/h
    instance = _mounted(user, on, volume)
    settings.BILLING_REQUIRE_FUNDS = True
    svc.instance_mark_failed(instance_id=instance.pk, message="Failed: its VM exited")  # it ran: its VM is kept
    for _ in range(9):
        clock.advance(600)
        tick()
    assert balance(user) <= 0
    clock.advance(86400 - 3600 + 60)
    tick()  # the destroy warning
    clock.advance(3600)
    tick()  # the grace period is over: the failed instance is destroyed (its VM removed)
    _destroy_done(instance)
    tick()  # the same moment, its volume held no more: deleted
    at_deadline = balance(user)
    for _ in range(30):  # a month later, still at zero
        clock.advance(86400)
        tick()
    volume.refresh_from_db()
    instance.refresh_from_db()
    # Past the grace period nothing of the renter's is billed further (the rule for every other volume and disk).
    assert balance(user) == at_deadline, (instance.status, volume.state, at_deadline, balance(user))
    assert (instance.status, volume.state) == ("destroyed", "deleting")
    # The destroy warning named the failed instance and the volume it held.
    warning = BillingEvent.objects.get(user=user, kind="destroy_warning")
    assert f"failed instances whose VM still mounts a volume ({instance.pk})" in warning.message, warning.message
    assert f"{volume.name} (mounted by instance {instance.pk})" in warning.message, warning.message
    assert warning.data["instances"] == [instance.pk] and warning.data["volumes"] == [volume.pk]


def test_the_destroy_warning_names_a_volume_a_stopped_instance_mounts_that_the_deadline_deletes(
        clock, user, tick, settings):
    settings.BILLING_GRACE_PERIOD_S = 2 * 86400
    settings.BILLING_DESTROY_WARNING_S = 86400
    fund(user, "1.000013")
    settings.BILLING_REQUIRE_FUNDS = False  # booked when the balance held its hour (the funds check's rule)
    on = node("1.000000")
    on.disk_price_per_gb_month_micros = 1000
    on.save(update_fields=["disk_price_per_gb_month_micros"])
    volume = volume_svc.volume_mark_available(
        volume_id=volume_svc.volume_create(owner=user, node_id=on.pk, size_gb=10).pk)
    kept = volume_svc.volume_mark_available(  # mounted by nothing, deleted too
        volume_id=volume_svc.volume_create(owner=user, node_id=on.pk, size_gb=1).pk)
    instance = _mounted(user, on, volume)
    settings.BILLING_REQUIRE_FUNDS = True
    clock.advance(3601)
    tick()  # at zero: stopped
    svc.instance_mark_stopped(instance_id=instance.pk)
    worker_done(instance)
    clock.advance(86400 + 60)
    tick()  # the destroy warning
    warning = BillingEvent.objects.get(user=user, kind="destroy_warning")
    assert f"stopped instances ({instance.pk})" in warning.message, warning.message
    assert f"{volume.name} (mounted by instance {instance.pk})" in warning.message, warning.message
    assert kept.name in warning.message and sorted(warning.data["volumes"]) == sorted([volume.pk, kept.pk])
    clock.advance(86400)
    tick()  # the deadline: the stopped instance is destroyed, the volume nothing mounts deleted
    kept.refresh_from_db()
    assert kept.state == "deleting"
    _destroy_done(instance)
    clock.advance(60)
    tick()  # next tick, still at zero: the volume the warning named is deleted
    volume.refresh_from_db()
    assert volume.state == "deleting"
