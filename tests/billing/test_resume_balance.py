"""An interrupted instance that runs again (or is started again) is billed again with no funds check of the renter's:
the same rule as a price raise (tests/billing/test_price_raise_balance.py). Found by review: a renter whose balance
went to zero while their instance was interrupted was never warned (nothing of theirs burned), and the first meter
tick after the resume stopped the instance at once. Now the resume re-reads the balance against what they pay with
it running; when it is low, they are warned then and their instances run until BILLING_LOW_BALANCE_WARNING_S after
it. The deadline is shown where the renter and the operators look: the balance's API and page, the admin."""
from datetime import datetime, timedelta
from decimal import Decimal

import pytest
from django.core import mail
from django.test import Client

from billing.models import BillingEvent, BillingProfile, EventKind
from billing.services.ledger import credit_grant, ledger_reverse
from billing.tasks import usage_meter_tick
from marketplace.models import Instance
from marketplace.money import usd_to_micros
from marketplace.services import instances as svc
from notifications.models import Notification
from provisioning.services.fleet_record import node_record_health
from tests.billing.helpers import balance, node, run, running
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

NOTICE_S = 3600


@pytest.fixture(autouse=True)
def notice(settings):
    settings.BILLING_LOW_BALANCE_WARNING_S = NOTICE_S


@pytest.fixture
def tick(django_capture_on_commit_callbacks):
    """One meter tick (its e-mails sent on commit); a health check that finds the node well first, when given."""
    def run_tick(host=None):
        if host is not None:
            node_record_health(node_id=host.pk, ok=True)
        with django_capture_on_commit_callbacks(execute=True):
            usage_meter_tick()
    return run_tick


@pytest.fixture
def on_commit(django_capture_on_commit_callbacks):
    """Run `call` and what it queued on commit (e-mails), as the worker would."""
    def call(fn, **kwargs):
        with django_capture_on_commit_callbacks(execute=True):
            return fn(**kwargs)
    return call


def _credit(user, usd: str):
    txn, _ = credit_grant(user=user, amount_micros=usd_to_micros(Decimal(usd)), reason="test funds")
    return txn


def _interrupted_then_drained(clock, tick, *, keep: str | None, plenty: bool = False):
    """A renter's $3/h instance runs 30 minutes ($1.50 of a $10 credit: no warning), then its node stops answering;
    while it is interrupted an operator reverses the credit (unless `plenty`), leaving `keep` (or less than
    nothing: credited for the time lost, it still owes most of the $1.50). Nothing burns, so nothing warns."""
    renter = UserFactory()
    booked_with = _credit(renter, "10.00")
    host = node(price="1.500000", gpu_count=4)
    node_record_health(node_id=host.pk, ok=True)
    instance = running(renter, host, num_gpus=2)
    for _ in range(6):
        clock.advance(300)
        tick(host)
    clock.advance(60)
    for _ in range(2):
        node_record_health(node_id=host.pk, ok=False, error="[Errno 113] No route to host")
    assert _status(instance) == "interrupted"
    if not plenty:
        if keep is not None:
            _credit(renter, keep)
        ledger_reverse(txn=booked_with, reason="credited by mistake")
    for _ in range(2):
        clock.advance(120)
        tick()  # nothing of theirs is billed: no warning, no stop
    assert "low_balance" not in _kinds(renter)
    node_record_health(node_id=host.pk, ok=True)  # it answers again, with the VM running (the reconciler resumes)
    return renter, host, instance


def _kinds(user) -> list[str]:
    return list(BillingEvent.objects.filter(user=user).order_by("pk").values_list("kind", flat=True))


def _status(instance) -> str:
    return Instance.objects.get(pk=instance.pk).status


def _when(text: str | None) -> datetime | None:
    return None if text is None else datetime.fromisoformat(text)


@pytest.mark.parametrize("keep", [None, "2.00"], ids=["balance-below-zero", "fifteen-minutes-left"])
def test_a_resume_warns_a_low_balance_and_stops_only_after_the_warnings_notice(clock, tick, on_commit, keep):
    renter, host, instance = _interrupted_then_drained(clock, tick, keep=keep)
    mail.outbox.clear()
    resumed_at = clock.now
    assert on_commit(svc.instance_resume, instance_id=instance.pk) is not None
    stop_at = resumed_at + timedelta(seconds=NOTICE_S)
    # Warned at the resume, by the ordinary warning (the resumed instance counted) and in the resume's message.
    [warning] = BillingEvent.objects.filter(user=renter, kind=EventKind.LOW_BALANCE)
    assert warning.data["per_hour"] == "3.000000" and _when(warning.data["stop_not_before"]) == stop_at
    assert (warning.data["seconds_left"] == 0) == (keep is None) and warning.data["seconds_left"] < NOTICE_S
    assert f"Instance {instance.pk} runs again after an interruption" in warning.message
    resumed = BillingEvent.objects.get(user=renter, kind=EventKind.INSTANCE_RESUMED)
    assert f"{stop_at:%Y-%m-%d %H:%M}" in resumed.message and "top up" in resumed.message.lower()
    assert _when(resumed.data["stop_not_before"]) == stop_at
    assert BillingProfile.objects.get(user=renter).stop_not_before == stop_at
    assert any("running low" in m.subject for m in mail.outbox)
    told = Notification.objects.filter(user=renter, kind="instance_running").order_by("pk").last()
    assert told is not None and told.body == resumed.message
    # It keeps running through the notice, although the balance is (or goes) below zero: owed.
    for _ in range(11):
        clock.advance(5 * 60)
        tick(host)
        assert _status(instance) == "running"
    assert balance(renter) < 0
    assert _kinds(renter).count("low_balance") == 1 and "balance_depleted" not in _kinds(renter)
    # Stopped at the first tick after it, as at zero in the ordinary way (a stop job; the disk is kept).
    clock.advance(5 * 60)
    tick(host)
    assert _status(instance) == "stopping" and "balance_depleted" in _kinds(renter)
    assert clock.now >= stop_at


def test_a_resume_with_plenty_of_balance_warns_nobody_and_shows_no_deadline(clock, tick, on_commit, client_for):
    renter, host, instance = _interrupted_then_drained(clock, tick, keep=None, plenty=True)
    assert on_commit(svc.instance_resume, instance_id=instance.pk) is not None
    resumed = BillingEvent.objects.get(user=renter, kind=EventKind.INSTANCE_RESUMED)
    assert "balance" not in resumed.message and "stop_not_before" not in resumed.data
    assert BillingProfile.objects.get(user=renter).stop_not_before is None
    shown = client_for(renter).get("/api/v1/billing/balance/").json()
    assert "stop_not_before" in shown and shown["stop_not_before"] is None
    tick(host)
    assert _status(instance) == "running" and "low_balance" not in _kinds(renter)


def test_an_interrupted_instance_started_again_by_the_platform_gets_the_notice_too(clock, tick, on_commit):
    """Its node came back with the VM stopped: the platform starts it (no funds check), and it is billed once it
    runs. The check counts its price then, as a raise does for an instance not running yet."""
    renter, host, instance = _interrupted_then_drained(clock, tick, keep=None)
    assert on_commit(svc.instance_restart_interrupted, instance_id=instance.pk) is not None
    assert _status(instance) == "starting"
    [warning] = BillingEvent.objects.filter(user=renter, kind=EventKind.LOW_BALANCE)
    assert warning.data["per_hour"] == "3.000000" and "is being started again" in warning.message
    stop_at = BillingProfile.objects.get(user=renter).stop_not_before
    assert stop_at == clock.now + timedelta(seconds=NOTICE_S)
    clock.advance(60)
    run(instance)
    clock.advance(30 * 60)
    tick(host)
    assert _status(instance) == "running"
    clock.advance(30 * 60)
    tick(host)
    assert _status(instance) == "stopping"


def test_the_balance_api_page_and_admin_show_the_deadline_while_it_holds(clock, tick, on_commit, client_for):
    renter, host, instance = _interrupted_then_drained(clock, tick, keep=None)
    on_commit(svc.instance_resume, instance_id=instance.pk)
    stop_at = clock.now + timedelta(seconds=NOTICE_S)
    api = client_for(renter)
    assert _when(api.get("/api/v1/billing/balance/").json()["stop_not_before"]) == stop_at
    web = Client()
    web.force_login(renter)
    page = web.get("/account/balance/").content.decode()
    assert 'id="stop-not-before"' in page and f"{stop_at:%Y-%m-%d %H:%M} UTC" in page
    assert "Your balance ran out" not in page
    operator = Client()
    operator.force_login(UserFactory(is_staff=True, is_superuser=True))
    profile = BillingProfile.objects.get(user=renter)
    admin_page = operator.get(f"/admin/billing/billingprofile/{profile.pk}/change/").content.decode()
    assert "Stop not before" in admin_page and 'name="stop_not_before"' not in admin_page  # shown, read-only
    listed = operator.get("/admin/billing/billingprofile/").content.decode()
    assert "column-stop_not_before" in listed
    # Once it has passed, it is no longer shown to the renter (the operators keep the record).
    clock.advance(NOTICE_S)
    assert api.get("/api/v1/billing/balance/").json()["stop_not_before"] is None
    assert 'id="stop-not-before"' not in web.get("/account/balance/").content.decode()


def test_one_notice_per_low_balance_an_interruption_spanning_its_deadline_does_not_renew_it(clock, tick, on_commit):
    """Found by review: interrupted before its notice ended and resumed after it, the instance got a fresh hour, and
    again, hour after hour at zero (a provider cutting the node's network for a few minutes each hour could do it).
    Now the second resume gets no notice; the renter is told the balance is at zero and the next tick stops it."""
    renter, host, instance = _interrupted_then_drained(clock, tick, keep=None)
    on_commit(svc.instance_resume, instance_id=instance.pk)
    first = BillingProfile.objects.get(user=renter).stop_not_before
    clock.advance(NOTICE_S - 600)
    tick(host)
    for _ in range(2):  # interrupted again before the deadline
        node_record_health(node_id=host.pk, ok=False, error="[Errno 113] No route to host")
    assert _status(instance) == "interrupted"
    clock.advance(1200)
    tick()  # after the deadline: nothing of theirs runs, nothing to stop
    node_record_health(node_id=host.pk, ok=True)
    on_commit(svc.instance_resume, instance_id=instance.pk)
    assert BillingProfile.objects.get(user=renter).stop_not_before == first  # not renewed
    resumed = BillingEvent.objects.filter(user=renter, kind=EventKind.INSTANCE_RESUMED).order_by("pk").last()
    assert "had its notice already" in resumed.message and resumed.data["stop_not_before"] is None
    assert _kinds(renter).count("low_balance") == 1
    tick(host)
    assert _status(instance) == "stopping" and "balance_depleted" in _kinds(renter)


def test_a_renter_stopped_at_zero_gets_no_notice_when_another_instance_resumes(clock, tick, on_commit):
    """Found by review: stopped at zero (told so), then an interrupted instance of theirs on another node resumed
    and ran an hour more at zero under a fresh notice."""
    renter, host, instance = _interrupted_then_drained(clock, tick, keep=None)
    lent = _credit(renter, "5.00")
    other = running(renter, node(price="1.000000", gpu_count=2))
    ledger_reverse(txn=lent, reason="credited by mistake")
    tick()  # at zero with a paid instance running: stopped, `depleted_at` set
    assert _status(other) == "stopping" and "balance_depleted" in _kinds(renter)
    on_commit(svc.instance_resume, instance_id=instance.pk)
    assert BillingProfile.objects.get(user=renter).stop_not_before is None
    tick(host)
    assert _status(instance) == "stopping"


def test_a_recovered_balance_gives_the_next_low_balance_its_own_notice(clock, tick, on_commit):
    renter, host, instance = _interrupted_then_drained(clock, tick, keep=None)
    on_commit(svc.instance_resume, instance_id=instance.pk)
    assert BillingProfile.objects.get(user=renter).stop_not_before is not None
    _credit(renter, "50.00")
    tick(host)  # recovered: the episode is over
    assert BillingProfile.objects.get(user=renter).stop_not_before is None


def test_a_renter_whose_notice_ran_out_with_nothing_running_is_given_one_again_once_topped_up(clock, tick, on_commit):
    renter, host, instance = _interrupted_then_drained(clock, tick, keep=None)
    on_commit(svc.instance_resume, instance_id=instance.pk)
    svc.instance_destroy(instance=Instance.objects.get(pk=instance.pk))
    clock.advance(NOTICE_S + 60)
    tick()  # nothing runs, at zero: the notice stays spent
    assert BillingProfile.objects.get(user=renter).stop_not_before is not None
    _credit(renter, "50.00")
    tick()  # recovered, although nothing of theirs runs (found only among the flagged renters)
    assert BillingProfile.objects.get(user=renter).stop_not_before is None
