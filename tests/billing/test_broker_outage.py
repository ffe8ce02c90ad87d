"""The broker down while billing queues work: an automatic top-up is committed pending even if its charge cannot
be queued (the meter tick goes on), and the top-ups follow-up charges it later."""
from datetime import timedelta

from kombu.exceptions import OperationalError

from billing import tasks
from billing.models import BillingProfile, Card, TopUp, TopUpStatus
from billing.services import reconcile
from tests.billing.helpers import fund, node, running


def _auto_top_up_profile(user) -> Card:
    card = Card.objects.create(user=user, stripe_payment_method_id="pm_local_9")
    BillingProfile.objects.create(user=user, auto_top_up_enabled=True, auto_top_up_card=card,
                                  auto_top_up_threshold_micros=5_000_000, auto_top_up_amount_micros=20_000_000)
    return card


def test_an_auto_top_up_whose_charge_cannot_be_queued_stays_pending_and_the_tick_ends_well(
        clock, api, monkeypatch, django_capture_on_commit_callbacks):
    def broker_down(name, *args, task_id=None):
        raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr("core.dispatch.send", broker_down)
    _auto_top_up_profile(api.user)
    fund(api.user, "6")
    running(api.user, node("3.600000"))
    clock.advance(1800)
    with django_capture_on_commit_callbacks(execute=True):
        tasks.usage_meter_tick()  # raises nothing
    [top_up] = TopUp.objects.filter(user=api.user)
    assert top_up.automatic and top_up.status == TopUpStatus.PENDING


def test_the_follow_up_charges_automatic_top_ups_left_pending(clock, api, monkeypatch, settings):
    settings.BILLING_TOP_UP_RECONCILE_AFTER_S = 300
    charged = []
    monkeypatch.setattr(reconcile, "top_up_charge_by_id", lambda *, top_up_id: charged.append(top_up_id))
    card = _auto_top_up_profile(api.user)
    stuck = TopUp.objects.create(user=api.user, amount_micros=20_000_000, card=card, automatic=True,
                                 created_at=clock.now)
    by_hand = TopUp.objects.create(user=api.user, amount_micros=20_000_000, card=card, created_at=clock.now)
    assert reconcile.top_ups_charge_pending() == 0  # its charge may still be on its way
    clock.advance(301)
    fresh = TopUp.objects.create(user=api.user, amount_micros=20_000_000, card=card, automatic=True,
                                 created_at=clock.now)
    monkeypatch.setattr(reconcile, "top_ups_reconcile", lambda: {})
    tasks.top_ups_reconcile()  # the periodic task runs the follow-up too
    assert charged == [stuck.pk]
    assert by_hand.pk not in charged and fresh.pk not in charged
    assert clock.now - stuck.created_at > timedelta(seconds=300)
