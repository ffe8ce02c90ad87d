"""Card money taken back at Stripe is debited from the wallet: a dispute (chargeback) once per dispute, given back if
the dispute is won; a refund made in Stripe's dashboard once (tests/billing/test_refunds_at_stripe.py: its failure
given back, one rule for all refunds). Before,
`charge.dispute.*` and `charge.refunded` were ignored: a renter could top up, spend the money on GPU time (providers
paid from it), then dispute the charge and keep the credit (found by review). Events are posted signed, as Stripe
sends them (localstripe emits no charge events)."""
import time

import pytest
import stripe as stripe_sdk
from django.core import mail
from django.db import transaction

from billing.models import BillingEvent, Dispute, LedgerTransaction, Refund, StripeEvent, TopUp, TopUpStatus
from billing.services.enforcement import balances_enforce
from billing.services.ledger import LedgerError, ledger_reverse
from billing.services.metering import usage_meter
from billing.services.refunds import refund_confirm
from billing.services.top_ups import top_up_credit
from tests.billing.helpers import balance, node, running
from tests.billing.test_payments import deliver, intent_event
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

USD_100 = 100_000_000


def credited_top_up(user, amount_micros: int = USD_100, intent: str = "pi_disputed") -> TopUp:
    top_up = TopUp.objects.create(user=user, amount_micros=amount_micros, status=TopUpStatus.PROCESSING,
                                  payment_intent_id=intent)
    with transaction.atomic():
        top_up_credit(top_up_id=top_up.pk, payment_intent_id=intent, amount_micros=amount_micros)
    top_up.refresh_from_db()
    return top_up


def dispute_event(event_id: str, kind: str = "charge.dispute.created", dispute_id: str = "dp_1",
                  amount: object = 10_000, status: str = "needs_response", intent: object = "pi_disputed",
                  **fields) -> dict:
    dispute = {"id": dispute_id, "object": "dispute", "amount": amount, "currency": "usd", "charge": "ch_1",
               "payment_intent": intent, "status": status, "reason": "fraudulent", **fields}
    return {"id": event_id, "object": "event", "type": kind, "created": int(time.time()), "data": {"object": dispute}}


def refund_obj(refund_id: str = "re_dash", amount: object = 2_500, status: str = "succeeded",
               intent: object = "pi_disputed", **fields) -> dict:
    return {"id": refund_id, "object": "refund", "amount": amount, "currency": "usd", "charge": "ch_1",
            "payment_intent": intent, "status": status, "metadata": {}, "reason": None, **fields}


def refunded_event(event_id: str, refunds: list[dict], intent: object = "pi_disputed", **fields) -> dict:
    """`charge.refunded` as API versions before 2022-11-15 send it: the charge with its refunds listed."""
    refunded = sum(r["amount"] for r in refunds if isinstance(r, dict) and type(r["amount"]) is int
                   and r["status"] not in ("failed", "canceled"))
    charge = {"id": "ch_1", "object": "charge", "amount": 10_000, "amount_refunded": refunded, "currency": "usd",
              "payment_intent": intent, "refunded": refunded == 10_000,
              "refunds": {"object": "list", "data": refunds, "has_more": False, "total_count": len(refunds)},
              **fields}
    return {"id": event_id, "object": "event", "type": "charge.refunded", "created": int(time.time()),
            "data": {"object": charge}}


def answer(anon, event) -> dict:
    response = deliver(anon, event)
    return {"code": response.status_code, **response.json()}


PROCESSED = {"code": 200, "received": True, "status": "processed"}
IGNORED = {"code": 200, "received": True, "status": "ignored"}


def chargebacks() -> list[LedgerTransaction]:
    return list(LedgerTransaction.objects.filter(kind="chargeback"))


# --- disputes -----------------------------------------------------------------------------------------------------


def test_a_dispute_debits_the_disputed_amount_once_names_the_dispute_and_top_up_and_tells_the_renter(
        anon, user, django_capture_on_commit_callbacks):
    top_up = credited_top_up(user)
    with django_capture_on_commit_callbacks(execute=True):
        assert answer(anon, dispute_event("evt_d1")) == PROCESSED
    assert answer(anon, dispute_event("evt_d1")) == PROCESSED  # the same event again
    assert answer(anon, dispute_event("evt_d2", kind="charge.dispute.funds_withdrawn")) == PROCESSED
    assert balance(user) == 0
    [txn] = chargebacks()
    assert txn.idempotency_key == "dispute:dp_1"
    assert "dp_1" in txn.memo and f"top-up {top_up.pk}" in txn.memo and "fraudulent" in txn.reason
    [event] = BillingEvent.objects.filter(user=user, kind="chargeback")
    assert event.emailed and event.data["dispute"] == "dp_1" and event.data["top_up"] == top_up.pk
    assert "$100.00" in event.message
    assert [m.to for m in mail.outbox if "disputed" in m.subject] == [[user.email]]
    with pytest.raises(LedgerError):  # an operator cannot give it back by hand: the bank has the money
        ledger_reverse(txn=txn, reason="oops")


def test_a_disputed_top_up_already_spent_takes_the_wallet_below_zero_and_enforcement_stops_the_instances(
        clock, api, sent_jobs):
    top_up = credited_top_up(api.user, amount_micros=10_000_000)  # $10
    instance = running(api.user, node("1.000000"))
    clock.advance(3600)  # $1 of GPU time spent
    usage_meter()
    spent = 10_000_000 - balance(api.user)
    assert spent > 0
    assert answer(api, dispute_event("evt_neg", amount=1_000, intent=top_up.payment_intent_id)) == PROCESSED
    assert balance(api.user) == -spent
    assert balances_enforce().stopped == 1
    instance.refresh_from_db()
    assert instance.status == "stopping"
    assert "balance_depleted" in BillingEvent.objects.filter(user=api.user).values_list("kind", flat=True)


def test_a_dispute_won_gives_the_debit_back_once_and_one_lost_takes_nothing_more(anon, user):
    credited_top_up(user)
    assert answer(anon, dispute_event("evt_w1")) == PROCESSED
    assert answer(anon, dispute_event("evt_w2", kind="charge.dispute.funds_reinstated", status="won")) == PROCESSED
    assert answer(anon, dispute_event("evt_w3", kind="charge.dispute.closed", status="won")) == PROCESSED
    assert balance(user) == USD_100
    [debit] = chargebacks()
    assert LedgerTransaction.objects.get(reverses=debit).idempotency_key == "dispute-won:dp_1"
    assert BillingEvent.objects.filter(user=user, kind="chargeback_reversed").count() == 1

    other = UserFactory()
    credited_top_up(other, intent="pi_lost")
    assert answer(anon, dispute_event("evt_l1", dispute_id="dp_2", intent="pi_lost")) == PROCESSED
    assert answer(anon, dispute_event("evt_l2", kind="charge.dispute.closed", dispute_id="dp_2", intent="pi_lost",
                                      status="lost")) == PROCESSED
    assert balance(other) == 0 and len(chargebacks()) == 2


def test_a_dispute_closed_before_it_was_seen_created_debits_once_and_a_won_one_changes_nothing_in_the_end(
        anon, user):
    credited_top_up(user)
    assert answer(anon, dispute_event("evt_c1", kind="charge.dispute.closed", status="lost")) == PROCESSED
    assert answer(anon, dispute_event("evt_c2")) == PROCESSED  # created, delivered late
    assert balance(user) == 0 and len(chargebacks()) == 1

    other = UserFactory()
    credited_top_up(other, intent="pi_won_early")
    won = dispute_event("evt_c3", kind="charge.dispute.closed", dispute_id="dp_9", intent="pi_won_early", status="won")
    assert answer(anon, won) == PROCESSED
    late = dispute_event("evt_c4", dispute_id="dp_9", intent="pi_won_early")
    assert answer(anon, late) == PROCESSED
    assert balance(other) == USD_100


def test_an_inquiry_debits_nothing_until_the_bank_withdraws_the_funds(anon, user):
    credited_top_up(user)
    assert answer(anon, dispute_event("evt_i1", status="warning_needs_response")) == IGNORED
    assert "inquiry" in StripeEvent.objects.get(event_id="evt_i1").error
    assert balance(user) == USD_100
    assert answer(anon, dispute_event("evt_i2", kind="charge.dispute.closed", status="warning_closed")) == IGNORED
    assert balance(user) == USD_100
    assert answer(anon, dispute_event("evt_i3", kind="charge.dispute.funds_withdrawn",
                                      status="needs_response")) == PROCESSED
    assert balance(user) == 0


def test_a_dispute_of_a_top_up_not_credited_yet_fails_and_applies_when_stripe_delivers_it_again(anon, user):
    top_up = TopUp.objects.create(user=user, amount_micros=USD_100, status=TopUpStatus.PROCESSING,
                                  payment_intent_id="pi_disputed")
    event = dispute_event("evt_early")
    assert answer(anon, event)["code"] == 500
    assert StripeEvent.objects.get(event_id="evt_early").status == "failed" and balance(user) == 0
    with transaction.atomic():
        top_up_credit(top_up_id=top_up.pk, payment_intent_id="pi_disputed", amount_micros=USD_100)
    assert answer(anon, event) == PROCESSED
    assert balance(user) == 0 and len(chargebacks()) == 1


# --- a dispute naming only its charge -----------------------------------------------------------------------------
# Stripe sends disputes without a payment_intent for charges made without one, and in API versions before the field;
# before, such a dispute was ignored ("names no PaymentIntent") and the chargeback never debited (found by review).


def stripe_paid_top_up(localstripe, user, cents: int = 10_000) -> tuple[TopUp, str]:
    """A top-up paid by a real PaymentIntent at localstripe and credited without its charge recorded (as one credited
    before charges were recorded, or by a webhook whose intent did not carry it); and that charge's id."""
    stripe = stripe_sdk.StripeClient("sk_test_x", base_addresses={"api": localstripe.url}, max_network_retries=0).v1
    customer = stripe.customers.create()
    method = stripe.payment_methods.attach("pm_card_visa", params={"customer": customer.id})
    intent = stripe.payment_intents.create(params={
        "amount": cents, "currency": "usd", "customer": customer.id, "payment_method": method.id,
        "off_session": True, "confirm": True, "payment_method_types": ["card"]})
    charge = intent.latest_charge if isinstance(intent.latest_charge, str) else intent.latest_charge.id
    return credited_top_up(user, amount_micros=cents * 10_000, intent=intent.id), charge


@pytest.mark.parametrize("charged", [{"latest_charge": "ch_paid"},
                                     {"charges": {"object": "list", "data": [{"id": "ch_paid"}]}}],
                         ids=["latest_charge", "charges-before-2022"])
def test_a_dispute_naming_only_its_charge_is_matched_by_the_charge_recorded_when_its_top_up_was_credited(
        anon, user, charged):
    top_up = TopUp.objects.create(user=user, amount_micros=USD_100, status=TopUpStatus.PROCESSING,
                                  payment_intent_id="pi_charged")
    paid = intent_event("evt_paid", "payment_intent.succeeded", top_up, id="pi_charged", **charged)
    assert answer(anon, paid) == PROCESSED and balance(user) == USD_100
    assert answer(anon, dispute_event("evt_d", intent=None, charge="ch_paid")) == PROCESSED
    assert balance(user) == 0
    assert Dispute.objects.get(stripe_dispute_id="dp_1").top_up == top_up


def test_a_dispute_naming_only_a_charge_not_recorded_here_is_looked_up_at_stripe(localstripe, anon, user):
    top_up, charge = stripe_paid_top_up(localstripe, user)
    assert answer(anon, dispute_event("evt_d", intent=None, charge=charge)) == PROCESSED
    assert balance(user) == 0
    top_up.refresh_from_db()
    assert top_up.charge_id == charge  # remembered: the next event about it asks Stripe nothing
    assert answer(anon, dispute_event("evt_w", kind="charge.dispute.closed", status="won", intent=None,
                                      charge=charge)) == PROCESSED
    assert balance(user) == USD_100


def test_a_dispute_of_a_charge_stripe_does_not_know_or_no_payment_intent_made_is_logged_and_ignored(
        localstripe, anon, user, caplog):
    credited_top_up(user)
    stripe = stripe_sdk.StripeClient("sk_test_x", base_addresses={"api": localstripe.url}, max_network_retries=0).v1
    customer = stripe.customers.create()
    method = stripe.payment_methods.attach("pm_card_visa", params={"customer": customer.id})
    direct = stripe.charges.create(params={"amount": 10_000, "currency": "usd", "customer": customer.id,
                                           "source": method.id})  # a charge made without a PaymentIntent
    for event_id, charge in (("evt_unknown", "ch_nobody"), ("evt_direct", direct.id)):
        assert answer(anon, dispute_event(event_id, intent=None, charge=charge)) == IGNORED
        error = StripeEvent.objects.get(event_id=event_id).error
        assert charge in error and "paid no top-up here" in error
        assert charge in caplog.text
    assert balance(user) == USD_100 and not Dispute.objects.exists()


def test_a_dispute_naming_only_its_charge_while_stripe_is_away_fails_and_applies_when_delivered_again(
        localstripe, anon, user, settings):
    _, charge = stripe_paid_top_up(localstripe, user)
    event = dispute_event("evt_away", intent=None, charge=charge)
    settings.STRIPE_API_BASE = "http://127.0.0.1:9"
    assert answer(anon, event)["code"] == 500
    stored = StripeEvent.objects.get(event_id="evt_away")
    assert stored.status == "failed" and charge in stored.error and balance(user) == USD_100
    settings.STRIPE_API_BASE = localstripe.url
    assert answer(anon, event) == PROCESSED
    assert balance(user) == 0


# --- refunds made in Stripe's dashboard ------------------------------------------------------------------------------


def test_a_refund_made_in_stripes_dashboard_is_debited_once(anon, user, django_capture_on_commit_callbacks):
    top_up = credited_top_up(user)
    first = refund_obj("re_1", 2_500)
    with django_capture_on_commit_callbacks(execute=True):
        assert answer(anon, refunded_event("evt_r1", [first])) == PROCESSED
    assert answer(anon, refunded_event("evt_r1", [first])) == PROCESSED
    assert answer(anon, refunded_event("evt_r2", [first])) == PROCESSED  # another event, the same refund
    assert balance(user) == USD_100 - 25_000_000
    second = refund_obj("re_2", 1_500)
    assert answer(anon, refunded_event("evt_r3", [second, first])) == PROCESSED  # a second one: $15 more
    assert answer(anon, refunded_event("evt_r0", [first])) == PROCESSED  # an older list, delivered late
    assert balance(user) == USD_100 - 40_000_000
    refunds = LedgerTransaction.objects.filter(kind="refund").order_by("pk")
    assert [t.idempotency_key for t in refunds] == ["refund:re_1", "refund:re_2"]
    made = Refund.objects.get(stripe_refund_id="re_1")
    assert (made.top_up, made.origin, made.created_by, made.status) == (top_up, "stripe", None, "succeeded")
    event = BillingEvent.objects.filter(user=user, kind="refund").order_by("pk").first()
    assert event.emailed and event.data["outside_platform"] and "$25.00" in event.message
    assert any(user.email in m.to for m in mail.outbox)


def test_the_platforms_own_refunds_are_not_debited_again_by_their_charge_refunded_event(anon, user):
    top_up = credited_top_up(user)
    operator = UserFactory(is_staff=True)
    made = Refund.objects.create(top_up=top_up, amount_micros=15_000_000, reason="asked", created_by=operator)
    refund_confirm(refund_id=made.pk, stripe_refund_id="re_ours")
    ours = refund_obj("re_ours", 1_500, metadata={"refund_id": str(made.pk)})
    assert answer(anon, refunded_event("evt_o1", [ours])) == PROCESSED
    assert balance(user) == USD_100 - 15_000_000
    # One still pending here (Stripe's answer on its way) is the platform's too: found by its metadata, debited once.
    pending = Refund.objects.create(top_up=top_up, amount_micros=5_000_000, reason="asked", created_by=operator)
    also_ours = refund_obj("re_ours_2", 500, metadata={"refund_id": str(pending.pk)})
    assert answer(anon, refunded_event("evt_o2", [also_ours, ours])) == PROCESSED
    refund_confirm(refund_id=pending.pk, stripe_refund_id="re_ours_2")
    assert balance(user) == USD_100 - 20_000_000
    # Then one made in the dashboard: only its $10.
    outside = refund_obj("re_dash", 1_000)
    assert answer(anon, refunded_event("evt_o3", [outside, also_ours, ours])) == PROCESSED
    assert balance(user) == USD_100 - 30_000_000
    assert Refund.objects.filter(origin="platform").count() == 2 and Refund.objects.filter(origin="stripe").count() == 1


# --- what is not ours, or cannot be read -----------------------------------------------------------------------------


@pytest.mark.parametrize("event", [
    dispute_event("evt_x", intent="pi_not_ours"),
    dispute_event("evt_x", kind="charge.dispute.closed", status="won", intent="pi_not_ours"),
    refunded_event("evt_x", [refund_obj(intent="pi_not_ours")], intent="pi_not_ours"),
], ids=["dispute", "dispute-closed", "charge-refunded"])
def test_a_charge_that_paid_no_top_up_here_is_ignored_with_the_reason(anon, user, event):
    credited_top_up(user)
    assert answer(anon, event) == IGNORED
    assert "paid no top-up here" in StripeEvent.objects.get(event_id="evt_x").error
    assert balance(user) == USD_100


@pytest.mark.parametrize(("event", "reason"), [
    (dispute_event("evt_m", dispute_id=None), "no usable id"),
    (dispute_event("evt_m", dispute_id=7), "no usable id"),
    (dispute_event("evt_m", intent=None, charge=None), "names neither a PaymentIntent nor a charge"),
    (dispute_event("evt_m", intent=["pi_disputed"]), "names no PaymentIntent that can be read"),
    (dispute_event("evt_m", amount="10000"), "not a whole number of cents"),
    (dispute_event("evt_m", amount=100.5), "not a whole number of cents"),
    (dispute_event("evt_m", amount=True), "not a whole number of cents"),
    (dispute_event("evt_m", amount=0), "not an amount of top-up"),
    (dispute_event("evt_m", amount=10_001), "not an amount of top-up"),
    (dispute_event("evt_m", currency="eur"), "not in usd"),
    (refunded_event("evt_m", [refund_obj(amount="2500")]), "not a whole number of cents"),
    (refunded_event("evt_m", [refund_obj(amount=-5)]), "not a whole number of cents"),
    (refunded_event("evt_m", [refund_obj(amount=10_001)]), "not an amount of top-up"),
    (refunded_event("evt_m", [refund_obj(currency="eur")]), "not in usd"),
    (refunded_event("evt_m", [refund_obj()], currency="eur"), "not in usd"),
    (refunded_event("evt_m", [refund_obj()], id=None), "no usable id"),
    (refunded_event("evt_m", ["re_1"]), "not an object"),
], ids=lambda value: value if isinstance(value, str) else None)
def test_a_malformed_dispute_or_charge_is_ignored_with_the_reason_and_debits_nothing(anon, user, event, reason):
    credited_top_up(user)
    assert answer(anon, event) == IGNORED
    assert reason in StripeEvent.objects.get(event_id="evt_m").error
    assert balance(user) == USD_100 and not Refund.objects.exists()
