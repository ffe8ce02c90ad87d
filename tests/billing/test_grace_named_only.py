"""The grace period at zero balance destroys only what a destroy warning named, at the time it named (found by
review): before, whatever was doomed at the deadline went, so an instance whose stop ended after the warning, or a
volume that came after it, was destroyed though no warning had named it; and a deadline reached with no warning
sent (no tick in time) destroyed everything unwarned. Now what is doomed after the warning gets its own warning
and its own full grace period, kept in BillingProfile.destroy_deadlines (in the database: a restart loses none)."""
from datetime import timedelta

import pytest
from django.core import mail

from billing.models import BillingEvent, BillingProfile, EventKind
from billing.tasks import usage_meter_tick
from marketplace.services import instances as svc
from marketplace.services import volumes as volume_svc
from tests.billing.helpers import fund, node, running

pytestmark = pytest.mark.django_db

DAY = 86400


@pytest.fixture
def tick(django_capture_on_commit_callbacks):
    def run_tick():
        with django_capture_on_commit_callbacks(execute=True):
            usage_meter_tick()
    return run_tick


@pytest.fixture
def grace(settings):
    settings.BILLING_GRACE_PERIOD_S = 2 * DAY
    settings.BILLING_DESTROY_WARNING_S = DAY
    settings.BILLING_REQUIRE_FUNDS = False  # booked as if the balance held its hour (the funds check's rule)


def _events(user, kind):
    return list(BillingEvent.objects.filter(user=user, kind=kind).order_by("pk"))


def _volume(user, on, size_gb=1):
    return volume_svc.volume_mark_available(
        volume_id=volume_svc.volume_create(owner=user, node_id=on.pk, size_gb=size_gb).pk)


def test_an_instance_whose_stop_ends_after_the_warning_gets_its_own_warning_and_full_grace_period(
        clock, user, tick, grace):
    fund(user, "1.00")
    on = node("1.000000")
    instance = running(user, on)
    volume = _volume(user, on)  # doomed from the start: named by the first warning
    clock.advance(3601)
    tick()  # at zero: the stop is asked for; its node answers only days later
    instance.refresh_from_db()
    assert instance.status == "stopping"
    clock.advance(DAY + 60)
    tick()  # the destroy warning: the volume only (the instance is not stopped yet, nothing to destroy)
    (first,) = _events(user, EventKind.DESTROY_WARNING)
    assert first.data["instances"] == [] and first.data["volumes"] == [volume.pk], first.message
    clock.advance(600)
    svc.instance_mark_stopped(instance_id=instance.pk)  # the stop ends after the warning
    tick()
    stopped_seen = clock()
    clock.advance(DAY - 600)
    tick()  # the deadline of the first warning: its volume is deleted, the instance no warning named is kept
    instance.refresh_from_db()
    volume.refresh_from_db()
    assert volume.state == "deleting"
    assert instance.status == "stopped", "destroyed though no warning named it"
    destroyed = _events(user, EventKind.INSTANCES_DESTROYED)
    assert [e.data for e in destroyed] == [{"instances": [], "volumes": [volume.name]}]
    assert instance.pk not in destroyed[0].data["instances"] and "stopped instances" not in destroyed[0].message
    # Its own warning, a day before its own deadline: a whole grace period after it was found stopped.
    own_deadline = stopped_seen + timedelta(days=2)
    clock.advance((own_deadline - timedelta(days=1, seconds=60) - clock()).total_seconds())
    tick()
    assert len(_events(user, EventKind.DESTROY_WARNING)) == 1
    clock.advance(60)
    tick()
    second = _events(user, EventKind.DESTROY_WARNING)[-1]
    assert second.pk != first.pk
    assert second.data == {"instances": [instance.pk], "volumes": [], "destroy_at": own_deadline.isoformat()}
    assert f"stopped instances ({instance.pk})" in second.message and f"{own_deadline:%Y-%m-%d %H:%M}" in \
        second.message
    assert BillingProfile.objects.get(user=user).destroy_deadlines[f"instance:{instance.pk}"] == {
        "at": own_deadline.isoformat(), "warned": True}  # stored: a restart of the workers changes nothing
    clock.advance(DAY - 60)
    tick()
    instance.refresh_from_db()
    assert instance.status == "stopped"
    clock.advance(60)
    tick()  # its own deadline: destroyed, and the notice names it
    instance.refresh_from_db()
    assert instance.status == "destroying"
    last = _events(user, EventKind.INSTANCES_DESTROYED)[-1]
    assert last.data == {"instances": [instance.pk], "volumes": []}
    assert f"stopped instances ({instance.pk}) were destroyed" in last.message, last.message


def test_a_volume_that_comes_after_the_warning_is_not_deleted_at_its_deadline(clock, user, tick, grace):
    fund(user, "1.00")
    on = node("1.000000")
    instance = running(user, on)
    clock.advance(3601)
    tick()  # at zero: stopped
    svc.instance_mark_stopped(instance_id=instance.pk)
    clock.advance(DAY + 60)
    tick()  # the warning names the stopped instance
    (first,) = _events(user, EventKind.DESTROY_WARNING)
    assert first.data["instances"] == [instance.pk] and first.data["volumes"] == []
    late = _volume(user, on)  # created before the zero balance, ready on its node only now
    tick()
    clock.advance(DAY)
    tick()  # the first warning's deadline
    instance.refresh_from_db()
    late.refresh_from_db()
    assert instance.status == "destroying"
    assert late.state == "available", "deleted though no warning named it"
    assert _events(user, EventKind.INSTANCES_DESTROYED)[-1].data == {"instances": [instance.pk], "volumes": []}
    clock.advance(DAY)
    tick()  # a day before its own deadline: its own warning
    second = _events(user, EventKind.DESTROY_WARNING)[-1]
    assert second.pk != first.pk and second.data["instances"] == [] and second.data["volumes"] == [late.pk]
    assert late.name in second.message
    clock.advance(DAY)
    tick()
    late.refresh_from_db()
    assert late.state == "deleting"
    assert _events(user, EventKind.INSTANCES_DESTROYED)[-1].data == {"instances": [], "volumes": [late.name]}


def test_a_deadline_reached_with_no_warning_sent_warns_first(clock, user, tick, grace):
    fund(user, "1.00")
    instance = running(user, node("1.000000"))
    clock.advance(3601)
    tick()  # at zero: stopped
    svc.instance_mark_stopped(instance_id=instance.pk)
    tick()  # found stopped: destroyed at the end of the grace period that began at zero, once warned
    clock.advance(3 * DAY)  # no tick ran in the meantime (workers down): the warning never went out
    tick()
    instance.refresh_from_db()
    assert instance.status == "stopped", "destroyed with no warning"
    (warning,) = _events(user, EventKind.DESTROY_WARNING)
    destroy_at = clock() + timedelta(days=1)  # the whole notice, from when the warning went out
    assert warning.data == {"instances": [instance.pk], "volumes": [], "destroy_at": destroy_at.isoformat()}
    clock.advance(DAY)
    tick()
    instance.refresh_from_db()
    assert instance.status == "destroying"


def test_the_warning_and_its_subject_say_what_it_covers(clock, user, tick, grace):
    fund(user, "1.00")
    on = node("1.000000")
    instance = running(user, on)
    volume = _volume(user, on)
    clock.advance(3601)
    tick()
    svc.instance_mark_stopped(instance_id=instance.pk)
    mail.outbox.clear()
    clock.advance(DAY + 60)
    tick()
    (sent,) = [m for m in mail.outbox if "destroyed soon" in m.subject]
    # Before: "Your stopped instances will be destroyed soon", for a warning that also deletes volumes.
    assert "volumes" in sent.subject and "instances" in sent.subject, sent.subject
    assert f"stopped instances ({instance.pk})" in sent.body and volume.name in sent.body
    for kind in (EventKind.DESTROY_WARNING, EventKind.INSTANCES_DESTROYED):
        assert "volumes" in kind.label and "failed" in kind.label, kind.label
    clock.advance(DAY)
    tick()
    (gone,) = [m for m in mail.outbox if "were destroyed" in m.subject]
    assert "volumes" in gone.subject
    assert f"stopped instances ({instance.pk}) were destroyed" in gone.body and volume.name in gone.body


def test_a_warned_thing_the_renter_deletes_leaves_the_record_and_the_balance(clock, user, tick, grace, api):
    fund(user, "1.00")
    on = node("1.000000")
    running(user, on)
    volume = _volume(user, on)
    clock.advance(3601)
    tick()  # at zero
    clock.advance(DAY + 60)
    tick()  # the destroy warning names the volume
    assert f"volume:{volume.pk}" in BillingProfile.objects.get(user=user).destroy_deadlines
    volume_svc.volume_delete(volume=volume, confirm=volume.name)  # the renter deletes it themselves
    clock.advance(60)
    tick()
    assert f"volume:{volume.pk}" not in BillingProfile.objects.get(user=user).destroy_deadlines
    shown = api.get("/api/v1/billing/balance/").json()["destroy_deadlines"]
    assert [d for d in shown if d["kind"] == "volume"] == [], shown
