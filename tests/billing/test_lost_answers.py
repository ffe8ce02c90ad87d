"""Money when Stripe's answer is lost or its card keeps declining: a refund Stripe made but whose answer never came
is held and settled once, never made twice; a declined automatic top-up is not charged again every minute.

Against a real localstripe; a lost answer is a proxy that lets the request through and drops the connection
before the answer (tests/billing/lossy_proxy.py)."""
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from billing.models import BillingEvent, BillingProfile, Card, Refund, RefundStatus, TopUp, TopUpStatus
from billing.services import payments, reconcile
from billing.services.reconcile import refunds_reconcile
from billing.services.top_ups import auto_top_up_start
from billing.services.webhooks import payment_intent_apply
from billing.tasks import top_ups_reconcile as reconcile_task
from billing.tasks import usage_meter_tick
from tests.billing.helpers import balance, fund
from tests.billing.lossy_proxy import LossyProxy
from tests.billing.test_payments import _credited_top_up, save_card, stripe_client

pytestmark = pytest.mark.django_db
LATER = timedelta(minutes=10)  # past BILLING_TOP_UP_RECONCILE_AFTER_S


@pytest.fixture
def lossy(localstripe, settings):
    proxy = LossyProxy(localstripe.url)
    settings.STRIPE_API_BASE = proxy.url
    yield proxy
    proxy.close()


def _refund(refund_operator_api, top_up, amount):
    return refund_operator_api.post("/api/v1/billing/refunds/", {"top_up": top_up.pk, "amount": amount,
                                                          "reason": "customer asked"}, format="json")


def _stripe_refunds(localstripe, top_up):
    return stripe_client(localstripe).refunds.list(params={"payment_intent": top_up.payment_intent_id}).data


def test_a_refund_whose_answer_is_lost_stays_held_and_is_debited_once(localstripe, lossy, api, refund_operator_api):
    top_up = _credited_top_up(localstripe, api)  # $40
    lossy.lose.add(("POST", "/v1/refunds"))
    response = _refund(refund_operator_api, top_up, "15.00")
    assert response.status_code == 503, response.content
    body = response.json()
    assert "stays pending" in body["detail"] and "do not refund it again" in body["detail"]
    refund = Refund.objects.get(pk=body["refund"])
    assert refund.status == RefundStatus.PENDING and "Outcome unknown" in refund.failure_message
    assert len(_stripe_refunds(localstripe, top_up)) == 1  # Stripe made it
    assert balance(api.user) == 25_000_000  # not refunded yet, but held from the balance (cannot be spent)
    assert payments.refundable_micros(top_up=top_up) == 25_000_000
    again = _refund(refund_operator_api, top_up, "30.00")
    assert again.status_code == 409 and "$25.00" in again.json()["detail"]

    assert refunds_reconcile(now=timezone.now()) == {}  # too early: its answer may still be on its way
    assert refunds_reconcile(now=timezone.now() + LATER) == {"succeeded": 1}
    refund.refresh_from_db()
    assert refund.status == RefundStatus.SUCCEEDED and refund.stripe_refund_id == _stripe_refunds(
        localstripe, top_up)[0].id
    assert balance(api.user) == 25_000_000
    assert refunds_reconcile(now=timezone.now() + LATER) == {}  # settled: nothing more
    assert balance(api.user) == 25_000_000
    assert BillingEvent.objects.filter(user=api.user, kind="refund").count() == 1


@pytest.mark.parametrize("status", ["requires_action", "pending"])
def test_a_lost_refund_stripe_has_not_finished_is_debited_and_not_refundable_again(localstripe, api, monkeypatch,
                                                                                  status):
    """The lookup took a refund Stripe reported as requires_action (not finished) for a failed one: refundable
    again, and when Stripe finished it (refund.updated, succeeded: not acted on) the card had the money and the
    wallet kept it (found by review). Any refund Stripe has not failed or canceled is debited, as refund_create
    does; if Stripe fails it later, stripe_refund_apply gives the debit back."""
    from types import SimpleNamespace

    from tests.factories import UserFactory

    top_up = _credited_top_up(localstripe, api)  # $40
    refund = Refund.objects.create(top_up=top_up, amount_micros=15_000_000, reason="customer asked",
                                   created_by=UserFactory(is_staff=True))
    made = SimpleNamespace(id="re_unfinished", status=status,
                           to_dict=lambda: {"metadata": {"refund_id": str(refund.pk)}})
    page = SimpleNamespace(auto_paging_iter=lambda: iter([made]))
    monkeypatch.setattr(reconcile, "client", lambda: SimpleNamespace(v1=SimpleNamespace(
        refunds=SimpleNamespace(list=lambda params: page))))
    assert reconcile.refund_reconcile(refund_id=refund.pk) == "pending"
    refund.refresh_from_db()
    assert refund.status == RefundStatus.SUCCEEDED and refund.stripe_refund_id == "re_unfinished"
    assert balance(api.user) == 25_000_000 and payments.refundable_micros(top_up=top_up) == 25_000_000


def test_a_refund_that_never_reached_stripe_fails_at_the_lookup_and_is_refundable_again(
        localstripe, api, refund_operator_api, settings):
    top_up = _credited_top_up(localstripe, api)
    settings.STRIPE_API_BASE = "http://127.0.0.1:9"  # the request never arrives
    response = _refund(refund_operator_api, top_up, "15.00")
    assert response.status_code == 503 and "stays pending" in response.json()["detail"]
    assert payments.refundable_micros(top_up=top_up) == 25_000_000
    assert refunds_reconcile(now=timezone.now() + LATER) == {"stripe_unavailable": 1}  # still down: asked later
    settings.STRIPE_API_BASE = localstripe.url
    settings.BILLING_TOP_UP_RECONCILE_AFTER_S = 0
    reconcile_task()  # the beat's per-minute task settles it
    refund = Refund.objects.get(pk=response.json()["refund"])
    assert refund.status == RefundStatus.FAILED and "made no refund" in refund.failure_message
    assert payments.refundable_micros(top_up=top_up) == 40_000_000 and balance(api.user) == 40_000_000
    assert _stripe_refunds(localstripe, top_up) == []
    assert _refund(refund_operator_api, top_up, "15.00").status_code == 201  # once Stripe answers, refunds work again
    assert balance(api.user) == 25_000_000


def test_a_charge_whose_answer_is_lost_says_it_may_have_charged_and_is_credited_when_stripe_confirms(
        localstripe, lossy, api):
    card = save_card(api)
    lossy.lose.add(("POST", "/v1/payment_intents"))
    response = api.post("/api/v1/billing/top-ups/", {"amount": "20.00", "card": card["id"]}, format="json")
    assert response.status_code == 503
    detail = response.json()["detail"]
    assert "not known yet" in detail and "nothing was done" not in detail
    assert "If your card was charged, the top-up is credited within minutes" in detail
    top_up = TopUp.objects.get(pk=response.json()["top_up"])
    assert top_up.status == TopUpStatus.FAILED and top_up.outcome_unknown and balance(api.user) == 0
    [intent] = stripe_client(localstripe).payment_intents.list().data  # Stripe did charge
    assert intent.status == "succeeded" and intent.metadata["top_up_id"] == str(top_up.pk)
    with transaction.atomic():  # its webhook arrives: credited once, failed here or not
        payment_intent_apply(intent=intent.to_dict(), succeeded=True)
    assert balance(api.user) == 20_000_000


def _later(top_up):
    TopUp.objects.filter(pk=top_up.pk).update(updated_at=timezone.now() - LATER)


def test_a_charge_whose_answer_and_webhook_are_both_lost_is_found_at_stripe_and_credited_once(
        localstripe, lossy, api):
    card = save_card(api)
    other = save_card(api)  # another payment of the same customer, before: not taken for the lost one
    assert api.post("/api/v1/billing/top-ups/", {"amount": "7.00", "card": other["id"]},
                    format="json").status_code == 202  # processing: credited by its own webhook
    lossy.lose.add(("POST", "/v1/payment_intents"))
    response = api.post("/api/v1/billing/top-ups/", {"amount": "20.00", "card": card["id"]}, format="json")
    assert response.status_code == 503
    top_up = TopUp.objects.get(pk=response.json()["top_up"])
    assert top_up.outcome_unknown and top_up.payment_intent_id is None
    lossy.lose.clear()
    assert reconcile.top_ups_find_lost() == {}  # not yet: an answer may still be on its way
    _later(top_up)
    assert reconcile.top_ups_find_lost() == {"succeeded": 1}
    top_up.refresh_from_db()
    [intent] = [pi for pi in stripe_client(localstripe).payment_intents.list().data
                if pi.to_dict()["metadata"].get("top_up_id") == str(top_up.pk)]
    assert top_up.status == TopUpStatus.SUCCEEDED and not top_up.outcome_unknown
    assert top_up.payment_intent_id == intent.id and top_up.failure_message == ""
    _later(top_up)
    assert reconcile.top_ups_find_lost() == {}  # settled: never credited twice
    with transaction.atomic():  # and the webhook, when it comes at last, changes nothing
        payment_intent_apply(intent=intent.to_dict(), succeeded=True)
    assert balance(api.user) == 20_000_000


def test_a_charge_that_never_reached_stripe_says_the_card_was_not_charged(localstripe, lossy, api):
    card = save_card(api)
    lossy.drop.add(("POST", "/v1/payment_intents"))
    response = api.post("/api/v1/billing/top-ups/", {"amount": "20.00", "card": card["id"]}, format="json")
    assert response.status_code == 503
    top_up = TopUp.objects.get(pk=response.json()["top_up"])
    assert top_up.outcome_unknown
    lossy.drop.clear()
    _later(top_up)
    assert reconcile.top_ups_find_lost() == {"not_charged": 1}
    top_up.refresh_from_db()
    assert top_up.status == TopUpStatus.FAILED and not top_up.outcome_unknown
    assert "your card was not charged" in top_up.failure_message and balance(api.user) == 0
    assert stripe_client(localstripe).payment_intents.list().data == []
    assert api.get(f"/api/v1/billing/top-ups/{top_up.pk}/").json()["failure_message"] == top_up.failure_message


def test_lost_charges_wait_while_stripe_cannot_be_reached(localstripe, lossy, api, settings):
    card = save_card(api)
    lossy.lose.add(("POST", "/v1/payment_intents"))
    top_up = TopUp.objects.get(pk=api.post("/api/v1/billing/top-ups/", {"amount": "20.00", "card": card["id"]},
                                           format="json").json()["top_up"])
    _later(top_up)
    settings.STRIPE_API_BASE = "http://127.0.0.1:9"
    assert reconcile.top_ups_find_lost() == {"stripe_unavailable": 1}
    assert TopUp.objects.get(pk=top_up.pk).outcome_unknown  # still to be looked up
    settings.STRIPE_API_BASE = lossy.url
    assert reconcile.top_ups_find_lost() == {"succeeded": 1} and balance(api.user) == 20_000_000


def _auto_top_up(api, card_id, *, threshold="5", amount="20"):
    response = api.patch("/api/v1/billing/profile/", {
        "auto_top_up_enabled": True, "auto_top_up_card": card_id, "auto_top_up_amount": f"{amount}.00",
        "auto_top_up_threshold": f"{threshold}.00"}, format="json")
    assert response.status_code == 200, response.content


def _ticks(n, django_capture_on_commit_callbacks):
    for _ in range(n):
        with django_capture_on_commit_callbacks(execute=True):
            usage_meter_tick()


def _charge_queued(no_task_queue):
    """The charge tasks the ticks queued, run here (no worker in these tests)."""
    for _name, args in [q for q in no_task_queue if q[0] == "top_up_charge"]:
        payments.top_up_charge_by_id(top_up_id=args[0])
    no_task_queue.clear()


def test_a_declined_automatic_top_up_turns_them_off_and_charges_the_card_once(
        localstripe, api, no_task_queue, django_capture_on_commit_callbacks):
    card = save_card(api, "pm_card_chargeCustomerFail")  # saved; declined when charged
    _auto_top_up(api, card["id"])
    fund(api.user, "4")  # under the $5 threshold
    for _ in range(5):  # five meter ticks (a minute apart in production)
        _ticks(1, django_capture_on_commit_callbacks)
        _charge_queued(no_task_queue)
    [top_up] = TopUp.objects.filter(user=api.user)
    assert top_up.automatic and top_up.status == TopUpStatus.FAILED and "declined" in top_up.failure_message
    assert BillingProfile.objects.get(user=api.user).auto_top_up_enabled is False
    [told] = BillingEvent.objects.filter(user=api.user, kind="top_up_failed")
    assert "Automatic top-ups are now off" in told.message and told.data["auto_top_up_stopped"] is True
    assert api.get("/api/v1/billing/profile/").json()["auto_top_up_enabled"] is False

    # Turned on again with a card that works: the next tick tops up, the declined one minutes ago aside.
    good = save_card(api)
    _auto_top_up(api, good["id"])
    _ticks(1, django_capture_on_commit_callbacks)
    _charge_queued(no_task_queue)
    assert TopUp.objects.filter(user=api.user).count() == 2
    assert TopUp.objects.filter(user=api.user, card_id=good["id"], status=TopUpStatus.PROCESSING).exists()


def test_an_automatic_top_up_whose_answer_was_lost_is_tried_again_after_an_hour_not_every_minute(
        api, no_task_queue, django_capture_on_commit_callbacks, settings):
    settings.STRIPE_API_BASE = "http://127.0.0.1:9"  # Stripe does not answer: the outcome is unknown
    card = Card.objects.create(user=api.user, stripe_payment_method_id="pm_local_9")
    _auto_top_up(api, card.pk)
    fund(api.user, "4")
    for _ in range(10):
        _ticks(1, django_capture_on_commit_callbacks)
        _charge_queued(no_task_queue)
    [top_up] = TopUp.objects.filter(user=api.user)  # one try in ten ticks
    assert top_up.status == TopUpStatus.FAILED and "not known yet" in top_up.failure_message
    assert BillingProfile.objects.get(user=api.user).auto_top_up_enabled is True  # not a decline: still on
    assert not BillingEvent.objects.filter(user=api.user, kind="top_up_failed").exists()
    TopUp.objects.filter(pk=top_up.pk).update(created_at=top_up.created_at - timedelta(minutes=61))
    _ticks(1, django_capture_on_commit_callbacks)
    assert TopUp.objects.filter(user=api.user).count() == 2  # an hour later, once more


def test_auto_top_up_is_not_started_again_while_one_is_still_processing(clock, user):
    """An automatic top-up still processing after an hour (its webhook lost, or Stripe still says processing) no
    longer counted as under way, and the card was charged again every hour (found by review)."""
    fund(user, "1")
    card = Card.objects.create(user=user, stripe_payment_method_id="pm_processing_1")
    BillingProfile.objects.create(user=user, auto_top_up_enabled=True, auto_top_up_card=card,
                                  auto_top_up_threshold_micros=5_000_000, auto_top_up_amount_micros=20_000_000)
    first = auto_top_up_start(user_id=user.pk)
    assert first is not None
    # (TopUp.created_at's default is bound before the clock fixture patches timezone.now: set it.)
    TopUp.objects.filter(pk=first.pk).update(status=TopUpStatus.PROCESSING, payment_intent_id="pi_processing_1",
                                             created_at=clock.now)
    clock.advance(minutes=30)
    assert auto_top_up_start(user_id=user.pk) is None
    clock.advance(hours=5)  # still processing: charged at Stripe, not credited yet
    assert auto_top_up_start(user_id=user.pk) is None
    # Nor while one is pending (its charge task not run yet), however old.
    TopUp.objects.filter(pk=first.pk).update(status=TopUpStatus.PENDING, payment_intent_id=None)
    assert auto_top_up_start(user_id=user.pk) is None
    # Nor while its charge's answer was lost (failed, outcome unknown: it may have charged) until the follow-up
    # (top_ups_find_lost) knows.
    TopUp.objects.filter(pk=first.pk).update(status=TopUpStatus.FAILED, outcome_unknown=True)
    assert auto_top_up_start(user_id=user.pk) is None
    # Once it definitely failed, over an hour ago, another one starts.
    TopUp.objects.filter(pk=first.pk).update(outcome_unknown=False)
    assert auto_top_up_start(user_id=user.pk) is not None


def test_a_refund_that_fails_at_stripe_after_it_was_made_gives_the_debit_back_once(localstripe, api,
                                                                                   refund_operator_api):
    from billing.models import LedgerTransaction
    from tests.billing.test_payments import deliver

    top_up = _credited_top_up(localstripe, api)  # $40
    assert _refund(refund_operator_api, top_up, "15.00").status_code == 201
    refund = Refund.objects.get(top_up=top_up)
    assert refund.status == RefundStatus.SUCCEEDED and balance(api.user) == 25_000_000
    made = stripe_client(localstripe).refunds.retrieve(refund.stripe_refund_id).to_dict()
    # Days later the card's bank sends it back: Stripe's refund.failed, then its older twin for the same refund.
    failed = {**made, "status": "failed", "failure_reason": "expired_or_canceled_card"}
    for event_id, kind in [("evt_rf_1", "refund.failed"), ("evt_rf_2", "charge.refund.updated"),
                           ("evt_rf_1", "refund.failed")]:
        answer = deliver(api, {"id": event_id, "type": kind, "data": {"object": failed}})
        assert answer.status_code == 200 and answer.json()["status"] == "processed", answer.content
    refund.refresh_from_db()
    assert refund.status == RefundStatus.FAILED and "expired or canceled card" in refund.failure_message
    assert balance(api.user) == 40_000_000  # the debit given back once
    assert LedgerTransaction.objects.filter(idempotency_key=f"refund-failed:{refund.pk}").count() == 1
    assert payments.refundable_micros(top_up=top_up) == 40_000_000  # it can be refunded again
    told = BillingEvent.objects.filter(user=api.user, kind="refund").order_by("-pk").first()
    assert "failed at the payment provider" in told.message and told.data["failed"] is True
    # A stale update saying it succeeded (read by the one rule: failed stays failed), or a failure of a refund that
    # is not ours, changes nothing.
    assert deliver(api, {"id": "evt_rf_3", "type": "refund.updated",
                         "data": {"object": {**made, "status": "succeeded"}}}).json()["status"] == "processed"
    assert deliver(api, {"id": "evt_rf_4", "type": "refund.failed", "data": {"object": {
        "id": "re_not_ours", "status": "failed", "metadata": {}}}}).json()["status"] == "ignored"
    assert balance(api.user) == 40_000_000


def test_refunds_whose_lookup_stripe_refuses_do_not_hide_the_others_from_the_follow_up(localstripe, lossy, api,
                                                                                       refund_operator_api):
    """The follow-up took the oldest pending refunds first, and one whose lookup Stripe kept refusing (a definite
    error: looked up again next run) stayed first: with a full batch of them, newer lost refunds were never looked
    up. The least recently looked up go first now."""
    first, second = _credited_top_up(localstripe, api), _credited_top_up(localstripe, api)
    lossy.lose.add(("POST", "/v1/refunds"))
    for top_up in (first, second):
        assert _refund(refund_operator_api, top_up, "5.00").status_code == 503
    lossy.refuse.add(("GET", "/v1/refunds"))
    for _ in range(2):  # a batch of one: each run looks up one refund
        assert refunds_reconcile(now=timezone.now() + LATER, limit=1) == {"error": 1}
    looked_up = [next(t.pk for t in (first, second) if t.payment_intent_id in path) for path in lossy.refused]
    assert looked_up == [first.pk, second.pk]
    for refund in Refund.objects.all():  # why, for operators (the dashboard shows it)
        assert refund.failure_message.startswith("Outcome unknown; the lookup was refused: ")
        assert "permissions" in refund.failure_message
    lossy.refuse.clear()
    for _ in range(2):
        assert refunds_reconcile(now=timezone.now() + LATER, limit=1) == {"succeeded": 1}
    assert set(Refund.objects.values_list("status", flat=True)) == {RefundStatus.SUCCEEDED}
    assert balance(api.user) == 70_000_000
