"""Stripe webhooks: verified, stored once under the event's unique Stripe id, and acted on.

The wallet is credited by `payment_intent.succeeded`, once: the event is stored under its unique Stripe id,
and the credit's ledger key is `top-up:<id>`, so a replayed or duplicated event, or two events for one
payment, credit nothing more. A `payment_intent.payment_failed` arriving after the success (out of order)
changes nothing. Card money taken back by the bank (`charge.dispute.*`) is debited by billing.services.disputes;
every refund, the platform's or one made in Stripe's dashboard (`refund.*`, `charge.refund.updated`,
`charge.refunded`), is debited and given back by billing.services.refunds' one rule. What such an event does not say
and Stripe must be asked (the PaymentIntent of a charge named alone, the refunds of a charge) is asked before the
event's transaction (billing.services.charges.stripe_lookups). Such an event about a top-up not credited yet fails
(Stripe delivers it again); the credit, once committed, processes again the events that failed waiting for it, or
are failing still (`charge_events_retry`), so a chargeback or a dashboard refund that came first is debited then, once.

Every field a handler reads from a Stripe object is read by its type: an amount only as whole cents
(charges.whole_cents), ids, customers and currencies only as text. An object that cannot be read so is ignored with
the reason (EventUnusable, ChargeEventUnusable), never credited from, and never a 500 on every delivery; the
follow-up (billing.services.reconcile) leaves its top-up as it is and logs why.
"""
import json
import logging
import math
import time
from functools import partial
from typing import Any

import stripe
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F, Q
from django.utils import timezone

from billing.models import BillingProfile, StripeEvent, StripeEventStatus, TopUp, TopUpStatus
from billing.services.charges import (
    CHARGE_REFUNDED,
    REFUND_EVENTS,
    ChargeEventUnusable,
    StripeLookups,
    charge_remember,
    intent_charge,
    stripe_lookups,
    whole_cents,
)
from billing.services.disputes import DISPUTE_EVENTS, dispute_apply
from billing.services.refunds import charge_refunded_apply, stripe_refund_apply
from billing.services.stripe_gateway import MICROS_PER_CENT
from billing.services.top_ups import top_up_credit, top_up_fail
from core import metrics
from core.untrusted_json import TOO_DEEP, Refused, check_json

log = logging.getLogger(__name__)


class WebhookInvalid(Exception):
    """Not a genuine Stripe event (bad or missing signature, or not an event): HTTP 400."""


class EventUnusable(ValueError):
    """A genuine event whose object cannot be matched or read safely (no id, a field of the wrong type, an amount
    that is not whole cents): ignored, the reason recorded on it (Stripe's next delivery would carry the same object,
    so failing it would only bring it back: a 500 on every delivery, for good)."""


STRIPE_ID_MAX = 100  # the columns that keep Stripe's ids (TopUp.payment_intent_id, .charge_id)


def _object_id(obj: dict[str, Any]) -> str:
    """The id of the object an event acts on; raises EventUnusable without one. (A missing id made the top-up
    lookup `payment_intent_id IS NULL`: any user's newest top-up not yet given a PaymentIntent; one past the column
    failed its save, a 500 on every delivery.)"""
    object_id = obj.get("id")
    what = str(obj.get("object") or "object")[:40]
    if not isinstance(object_id, str) or not object_id:
        raise EventUnusable(f"The event's {what} has no id: it cannot be matched to a payment here, so nothing was "
                            "done.")
    if len(object_id) > STRIPE_ID_MAX:
        raise EventUnusable(f"The event's {what} has an id longer than {STRIPE_ID_MAX} characters, which no payment "
                            "here has: nothing was done.")
    return object_id


# Stripe's own tolerance (stripe.Webhook.DEFAULT_TOLERANCE): a signature made more than this long ago, or this
# far in the future, is refused. Stripe's library bounds only the past; a timestamp in the future would make a
# captured delivery replayable for as long as it lies ahead.
SIGNATURE_TOLERANCE_S = 300


def _signed_at(signature: str) -> int:
    """The `t=` timestamp of a Stripe-Signature header that verified, read as Stripe's library reads it."""
    items = [item.split("=", 2) for item in signature.split(",")]
    return int([item[1] for item in items if item[0] == "t"][0])


def _has_nul(value: object) -> bool:
    """PostgreSQL stores no NUL in text or jsonb: a body with one anywhere (key or value) cannot be kept."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


REDACTED = "[redacted]"


def _is_secret_key(key: object) -> bool:
    # A PaymentIntent's or SetupIntent's client_secret confirms the payment from a browser; nothing here needs it.
    return isinstance(key, str) and (key == "secret" or key.endswith("_secret"))


def redact_secrets(value: Any) -> Any:
    """A copy of a Stripe payload with every secret's value replaced (client_secret, ...): stored events and the
    operators' page keep only what processing and support read. Iterative: a deep body costs no recursion."""
    out: list[Any] = [None]
    stack: list[tuple[Any, Any, Any]] = [(value, out, 0)]
    while stack:
        item, parent, slot = stack.pop()
        if isinstance(item, dict):
            copy: dict[Any, Any] = {}
            parent[slot] = copy
            for key, child in item.items():
                copy[key] = None  # keeps the keys' order
                if _is_secret_key(key) and child not in (None, ""):
                    copy[key] = REDACTED
                else:
                    stack.append((child, copy, key))
        elif isinstance(item, list):
            parent[slot] = items = [None] * len(item)
            stack.extend((child, items, index) for index, child in enumerate(item))
        else:
            parent[slot] = item
    return out[0]


class _Unstorable(ValueError):
    """JSON that parses but that PostgreSQL's jsonb cannot store."""


def _no_constant(name: str) -> Any:
    raise _Unstorable(f"the body holds {name}, which is not JSON (PostgreSQL cannot store it).")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Unstorable(f"the number {text[:40]} is too large to store (past the float range).")
    return value


def parse_event_body(payload: bytes) -> Any:
    """The body as JSON that can be stored (jsonb), or WebhookInvalid saying why not: not JSON; NaN or Infinity
    (Python's json reads them, PostgreSQL refuses them), a number past the float range (1e999 reads as infinity);
    a lone UTF-16 surrogate (an escape such as \\ud800 alone, not Unicode), nesting deeper than
    core.untrusted_json's MAX_DEPTH (or than Python's recursion limit). Before, such a signed body passed the event
    checks and the insert raised DataError: a 500, delivered again and again (found by review; the NUL is
    _event_problem's)."""
    try:
        return check_json(json.loads(payload, parse_constant=_no_constant, parse_float=_finite))
    except _Unstorable as exc:
        raise WebhookInvalid(f"Not a Stripe event: {exc}") from None
    except RecursionError:
        raise WebhookInvalid(f"Not a Stripe event: {TOO_DEEP}") from None
    except Refused as exc:  # too deep, not Unicode
        raise WebhookInvalid(f"Not a Stripe event: {exc}") from None
    except ValueError:  # not JSON (a JSONDecodeError, bytes that are not UTF-8, an integer of too many digits)
        raise WebhookInvalid("The body is not JSON.") from None


STRIPE_EVENT_FIELD_MAX = 100  # StripeEvent.event_id and .type (Stripe's own are under 60)


def _event_problem(data: object) -> str | None:
    """Why a parsed body is not a Stripe event (an object with an `id`, a `type` and `data.object`), or None."""
    if not isinstance(data, dict):
        return "Not a Stripe event: the body must be a JSON object."
    for name in ("id", "type"):
        if not isinstance(data.get(name), str) or not data[name]:
            return f"Not a Stripe event: `{name}` must be a non-empty string."
        # Stored whole, never cut: two ids alike in their first 100 characters would have been one event.
        if len(data[name]) > STRIPE_EVENT_FIELD_MAX:
            return f"Not a Stripe event: `{name}` has at most {STRIPE_EVENT_FIELD_MAX} characters."
    if not isinstance(data.get("data"), dict) or not isinstance(data["data"].get("object"), dict):
        return "Not a Stripe event: `data.object` must be an object."
    if _has_nul(data):
        return "Not a Stripe event: the body contains a NUL character."
    return None


def webhook_receive(*, payload: bytes, signature: str | None) -> StripeEvent:
    """Verify, store once, and process a Stripe webhook delivery. Raises WebhookInvalid (400).

    Nothing is stored for a delivery whose signature does not verify (wrong secret, or signed more than
    SIGNATURE_TOLERANCE_S before or after now), or whose body is not an event or cannot be stored
    (parse_event_body, _event_problem). A second delivery of an event
    (same id) is counted and changes nothing else, unless the first one failed to process.
    """
    if not signature:
        raise WebhookInvalid("Missing Stripe-Signature header.")
    try:
        # The signature alone (no tolerance): both bounds of the timestamp are checked below, with one clock.
        stripe.WebhookSignature.verify_header(payload, signature, settings.STRIPE_WEBHOOK_SECRET, tolerance=None)
        signed_at = _signed_at(signature)
    except stripe.SignatureVerificationError:
        raise WebhookInvalid("The signature does not verify.") from None
    except UnicodeDecodeError:
        raise WebhookInvalid("The body is not JSON.") from None
    if abs(time.time() - signed_at) > SIGNATURE_TOLERANCE_S:
        raise WebhookInvalid(f"The signature's timestamp is more than {SIGNATURE_TOLERANCE_S} s from now.")
    data = parse_event_body(payload)
    problem = _event_problem(data)
    if problem:
        raise WebhookInvalid(problem)
    try:
        with transaction.atomic():
            event = StripeEvent.objects.create(event_id=data["id"], type=data["type"],
                                               payload=redact_secrets(data))
    except IntegrityError:
        event = StripeEvent.objects.get(event_id=data["id"])
        StripeEvent.objects.filter(pk=event.pk).update(deliveries=F("deliveries") + 1)
    return stripe_event_process(event_id=event.pk)


def stripe_event_process(*, event_id: int) -> StripeEvent:
    """Process a stored event unless it was already: processed and ignored events stay as they are."""
    stored = StripeEvent.objects.get(pk=event_id)
    if stored.status in StripeEvent.transitions.final:
        return stored
    looked: StripeLookups | Exception
    try:  # Stripe is asked outside the transaction (stripe_gateway's rule); not answering fails the event below
        looked = stripe_lookups(kind=stored.type, payload=stored.payload)
    except Exception as exc:  # noqa: BLE001 (recorded on the event, as a failure of its processing)
        looked = exc
    with transaction.atomic():
        event = StripeEvent.objects.select_for_update().get(pk=event_id)
        if event.status in StripeEvent.transitions.final:  # processed or ignored: stays as it is
            return event
        try:
            if isinstance(looked, Exception):
                raise looked
            with transaction.atomic():
                handled = _handle(event.type, event.payload, looked)
            event.transition_to(StripeEventStatus.PROCESSED if handled else StripeEventStatus.IGNORED)
            event.error = ""
        except (EventUnusable, ChargeEventUnusable) as exc:
            log.warning("Stripe event %s (%s) ignored: %s", event.event_id, event.type, exc)
            event.transition_to(StripeEventStatus.IGNORED)
            event.error = str(exc)[:2000]
        except Exception as exc:  # noqa: BLE001 (recorded on the event for operators; Stripe will retry)
            log.exception("Stripe event %s (%s) failed", event.event_id, event.type)
            metrics.WEBHOOK_FAILURES.labels(type=event.type).inc()
            event.transition_to(StripeEventStatus.FAILED)
            event.error = f"{type(exc).__name__}: {exc}"[:2000]
        event.processed_at = timezone.now()
        event.save(update_fields=["status", "error", "processed_at"])
    return event


def _metadata(intent: dict[str, Any]) -> dict[str, Any]:
    metadata = intent.get("metadata")
    return metadata if isinstance(metadata, dict) else {}


def _top_up_of(intent: dict[str, Any]) -> TopUp | None:
    """The top-up an intent pays: the one that recorded its id, else the one its metadata names, unless that one
    recorded another PaymentIntent (ValueError: for operators). Raises EventUnusable for an intent without an id."""
    intent_id = _object_id(intent)
    top_up = TopUp.objects.filter(payment_intent_id=intent_id).select_related("user").first()
    top_up_id = _metadata(intent).get("top_up_id")
    if top_up is None and isinstance(top_up_id, str) and top_up_id.isascii() and top_up_id.isdigit():
        top_up = TopUp.objects.filter(pk=int(top_up_id)).select_related("user").first()
        if top_up is not None and top_up.payment_intent_id not in (None, intent_id):
            raise ValueError(f"payment intent {intent_id} names top-up {top_up.pk}, which is paid by "
                             f"{top_up.payment_intent_id}")
    return top_up


def _customer_named(intent: dict[str, Any], intent_id: str) -> str | None:
    """The customer an intent names (an id, or an expanded object's id); None when it names none. Raises
    EventUnusable for one that cannot be read (before, an expanded customer never equalled the id it was compared
    with: the event failed for good)."""
    customer = intent.get("customer")
    if isinstance(customer, dict):
        customer = customer.get("id")
    if customer is None or customer == "":
        return None
    if not isinstance(customer, str) or len(customer) > STRIPE_ID_MAX:
        raise EventUnusable(f"PaymentIntent {intent_id}: `customer` is not a customer id ({str(customer)[:40]!r}), so "
                            "nothing was done.")
    return customer


def _of_its_customer(intent: dict[str, Any], top_up: TopUp) -> bool:
    """Whether an intent may be the top-up's. The top-up row says whose it is: the PaymentIntent it recorded, or
    one whose metadata (written with the charge) names its user, is; otherwise the intent's customer must be the
    user's current one. (A customer Stripe lost is replaced when a card is saved (customers.customer_for): a top-up
    charged on the old one that succeeded afterwards failed this check for good, the card charged, nothing
    credited.)"""
    if top_up.payment_intent_id == intent.get("id") or _metadata(intent).get("user_id") == str(top_up.user_id):
        return True
    customer = _customer_named(intent, _object_id(intent))
    current = BillingProfile.objects.filter(user_id=top_up.user_id).values_list("stripe_customer_id",
                                                                                  flat=True).first()
    return not customer or not current or customer == current


def _handle(kind: str, payload: dict[str, Any], looked: StripeLookups) -> bool:
    """Act on one event; False when it is not one this platform acts on."""
    obj = (payload.get("data") or {}).get("object") or {}
    if kind in REFUND_EVENTS:  # any status: debited, or given back (billing.services.refunds)
        # stripe_refund_apply reads the refund's id first: one without is refused, not matched by its metadata alone
        return stripe_refund_apply(stripe_refund=obj, looked=looked)
    if kind in DISPUTE_EVENTS:
        return dispute_apply(kind=kind, dispute=obj, looked=looked)
    if kind == CHARGE_REFUNDED:
        return charge_refunded_apply(charge=obj, looked=looked)
    if kind not in ("payment_intent.succeeded", "payment_intent.payment_failed"):
        return False
    return payment_intent_apply(intent=obj, succeeded=kind == "payment_intent.succeeded")


def payment_failure_reason(intent: dict[str, Any]) -> str:
    """What a failed or canceled PaymentIntent says of why: its `last_payment_error`'s message when it has one that
    is text (before, a `last_payment_error` that was not an object failed the event for good, a 500 on every
    delivery), else a plain sentence."""
    error = intent.get("last_payment_error")
    message = error.get("message") if isinstance(error, dict) else None
    if isinstance(message, str) and message.strip():
        return message
    return "The payment was canceled." if intent.get("status") == "canceled" else "The payment failed."


def _intent_amount_micros(intent: dict[str, Any], intent_id: str) -> int:
    """A succeeded intent's amount in micro-dollars, read as every amount from Stripe is (charges.whole_cents): an
    integer number of cents, or EventUnusable. (It was `int(amount)`: a string "1000" was credited, a float 1000.9
    truncated and credited, a missing one failed for good.)"""
    currency = intent.get("currency")
    if not isinstance(currency, str):
        raise EventUnusable(f"PaymentIntent {intent_id}: `currency` is not a currency ({str(currency)[:40]!r}), so "
                            "nothing was done.")
    if currency != "usd":
        raise ValueError(f"payment intent {intent_id} is in {currency[:10]}, not usd")
    try:
        return whole_cents(intent, "amount", "PaymentIntent", intent_id) * MICROS_PER_CENT
    except ChargeEventUnusable as exc:
        raise EventUnusable(str(exc)) from None


def payment_intent_apply(*, intent: dict[str, Any], succeeded: bool) -> bool:
    """Apply what Stripe says of a top-up's PaymentIntent: credit the top-up (succeeded) or mark it failed.

    The one path for the webhook and for the follow-up of top-ups whose webhook never came
    (billing.services.reconcile): whichever comes first credits, the other changes nothing (top_up_credit
    locks the top-up and posts under the ledger key `top-up:<id>`). Call inside a transaction. False when the
    intent is no top-up's; raises EventUnusable (a ValueError) for an intent that cannot be read (no id, a customer
    or currency of the wrong type, an amount that is not whole cents), and ValueError when it does not match its
    top-up (another PaymentIntent recorded, customer, currency, amount: top_up_credit).
    """
    top_up = _top_up_of(intent)
    if top_up is None:
        return False
    intent_id = _object_id(intent)
    if not _of_its_customer(intent, top_up):
        raise ValueError(f"payment intent {intent_id} is not of top-up {top_up.pk}'s customer")
    if succeeded:
        amount_micros = _intent_amount_micros(intent, intent_id)
        credited = top_up_credit(top_up_id=top_up.pk, payment_intent_id=intent_id, amount_micros=amount_micros)
        charge_remember(top_up=top_up, charge_id=intent_charge(intent))  # a dispute may name only the charge
        if credited:  # a chargeback or refund that came before the credit and failed waiting for it: applied now
            transaction.on_commit(partial(charge_events_retry, top_up_id=top_up.pk))
        return True
    top_up_fail(top_up=top_up, message=payment_failure_reason(intent), payment_intent_id=intent_id, notify=True)
    return True


CHARGE_EVENTS = (*DISPUTE_EVENTS, *REFUND_EVENTS, CHARGE_REFUNDED)


def charge_events_retry(*, top_up_id: int) -> int:
    """Process again the events about a credited top-up's payment that are not processed or ignored yet: a
    chargeback or a refund made in Stripe's dashboard that arrived before the credit (its charge's answer and webhook
    lost: billing.services.charges) failed waiting for it. Run when the credit is committed, rather than leave the
    money in the wallet until Stripe's next delivery (hours later, at times); a delivery that comes later still finds
    the event processed. An event still being processed is taken too: one whose handler found the top-up not
    credited and is failing it, its FAILED status not committed yet (the top-up's lock, taken in the handler's
    savepoint, is released before that commit, so the credit can commit in between: found by review; only FAILED
    events were taken, and that one waited for Stripe's next delivery). stripe_event_process waits for the event's
    row, then reads its status under that lock: one its handler processed meanwhile is left as it is, one that failed
    is processed now, never both. Call outside any transaction (each event asks Stripe what it needs first). Returns
    how many were processed; never raises (each event's outcome is recorded on it, an event that fails again is
    delivered again by Stripe)."""
    try:
        top_up = TopUp.objects.filter(pk=top_up_id, status=TopUpStatus.SUCCEEDED).values(
            "payment_intent_id", "charge_id").first()
        if top_up is None:
            return 0
        intent_id, charge_id = top_up["payment_intent_id"], top_up["charge_id"]
        names = Q(pk__in=[])
        if intent_id:
            names |= Q(payload__data__object__payment_intent=intent_id)
            names |= Q(payload__data__object__charge__payment_intent=intent_id)
        if charge_id:
            names |= Q(payload__data__object__charge=charge_id) | Q(payload__data__object__charge__id=charge_id)
            names |= Q(type=CHARGE_REFUNDED, payload__data__object__id=charge_id)
        waiting = list(StripeEvent.objects.filter(names, type__in=CHARGE_EVENTS)
                       .exclude(status__in=StripeEvent.transitions.final)
                       .order_by("received_at", "pk").values_list("pk", flat=True))
    except Exception:  # noqa: BLE001 (the credit is committed; Stripe's next delivery tries the events again)
        log.exception("top-up %s: looking for the events that waited for its credit failed", top_up_id)
        return 0
    done = 0
    for pk in waiting:
        try:
            event = stripe_event_process(event_id=pk)
        except Exception:  # noqa: BLE001 (the credit is committed; Stripe's next delivery tries the event again)
            log.exception("Stripe event %s about top-up %s: processing it again after the credit failed", pk,
                          top_up_id)
            continue
        done += event.status == StripeEventStatus.PROCESSED
        log.info("Stripe event %s (%s) waited for top-up %s's credit: %s", event.event_id, event.type, top_up_id,
                 event.status)
    return done
