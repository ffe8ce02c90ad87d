"""Which top-up a Stripe charge, dispute or refund is about.

An object names its PaymentIntent (a top-up's `payment_intent_id`), or only its charge: a dispute or refund of a
charge made without a PaymentIntent, or sent by an API version older than the field. A charge is matched by the
charge id recorded with its top-up when it was credited (`TopUp.charge_id`), else asked of Stripe: which
PaymentIntent made it (and then remembered). A charge Stripe does not know, or that no PaymentIntent made, paid no
top-up here.

A PaymentIntent no top-up has recorded may still be a top-up's: one whose charge answer was lost (pending, or failed
with its outcome unknown, no PaymentIntent recorded) until its webhook or the follow-up (billing.services.reconcile)
credits it. While any top-up is in that state, Stripe is asked which top-up the PaymentIntent was made for (the
`top_up_id` of its metadata, written with the charge); an event about a top-up here not credited yet fails
(ValueError: Stripe delivers it again, and the credit processes it again, webhooks.charge_events_retry), so a
chargeback or a dashboard refund that came first is debited once the credit exists. (Found by review: it was ignored
for good as "paid no top-up here", and the credit that followed stayed in the wallet.)

Stripe is asked before the event's transaction (`stripe_lookups`: never a network call under a lock); the handlers
read the answers from what it returns.
"""
import logging
from dataclasses import dataclass, field
from typing import Any

import stripe
from django.db import IntegrityError, transaction
from django.db.models import Q, QuerySet

from billing.models import Refund, RefundOrigin, TopUp, TopUpStatus
from billing.services.stripe_gateway import client, translate
from core.errors import Unavailable

log = logging.getLogger(__name__)

DISPUTE_PREFIX = "charge.dispute."
CHARGE_REFUNDED = "charge.refunded"
# A refund's own events: `refund.*` (Stripe's API since 2024), `charge.refund.updated` (before). The object is the
# Refund.
REFUND_EVENTS = ("refund.created", "refund.updated", "refund.failed", "charge.refund.updated")


class ChargeEventUnusable(ValueError):
    """A genuine event about a charge that is not applied here: not a top-up's, or its object cannot be read safely.
    Ignored, the reason recorded on the event (Stripe's next delivery would carry the same object)."""


@dataclass
class StripeLookups:
    """What Stripe said, asked before the event's transaction."""

    intents: dict[str, str | None] = field(default_factory=dict)  # charge → the PaymentIntent that made it, or None
    refunds: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # charge → all its refunds
    # PaymentIntent no top-up recorded → the top-up here it was made for (its metadata), or None
    top_ups: dict[str, int | None] = field(default_factory=dict)


def object_id(obj: dict[str, Any], what: str) -> str:
    value = obj.get("id")
    if not isinstance(value, str) or not value or len(value) > 100:
        raise ChargeEventUnusable(f"The event's {what} has no usable id: nothing was done.")
    return value


def whole_cents(obj: dict[str, Any], name: str, what: str, object_id: str) -> int:
    value = obj.get(name)
    if type(value) is not int or value < 0:
        raise ChargeEventUnusable(f"{what} {object_id}: `{name}` is not a whole number of cents ({str(value)[:40]!r}), "
                                  "so nothing was done.")
    return value


def _id_of(value: object) -> str | None:
    """An id, or an expanded object's id; None when absent or not one."""
    if isinstance(value, dict):
        value = value.get("id")
    return value if isinstance(value, str) and value and len(value) <= 100 else None


def payment_intent_named(obj: dict[str, Any]) -> str | None:
    """The PaymentIntent a charge, dispute or refund names (an id, an expanded object, or its expanded charge's)."""
    intent = obj.get("payment_intent")
    if intent is None and isinstance(obj.get("charge"), dict):  # a dispute or refund with its charge expanded
        intent = obj["charge"].get("payment_intent")
    return _id_of(intent)


def charge_named(obj: dict[str, Any]) -> str | None:
    """The charge an object is about: a charge's own id, a dispute's or refund's `charge`."""
    return _id_of(obj.get("id")) if obj.get("object") == "charge" else _id_of(obj.get("charge"))


def stripe_lookups(*, kind: str, payload: dict[str, Any]) -> StripeLookups:
    """Ask Stripe what an event's handler will need and the event does not say: the PaymentIntent of a charge that
    is named alone and matches no recorded charge; the refunds of a charge.refunded that does not list them all
    (API versions since 2022-11-15 leave them out). Call outside any transaction. Raises Unavailable (the event
    fails, and Stripe delivers it again) when Stripe does not answer."""
    looked = StripeLookups()
    obj = (payload.get("data") or {}).get("object")
    if not isinstance(obj, dict):
        return looked
    if not (kind.startswith(DISPUTE_PREFIX) or kind in REFUND_EVENTS or kind == CHARGE_REFUNDED):
        return looked
    if kind in REFUND_EVENTS and _refund_known(obj):
        return looked
    charge_id = charge_named(obj)
    recorded = charge_id is not None and TopUp.objects.filter(charge_id=charge_id).exists()
    if charge_id and _names_only_its_charge(obj) and not recorded:
        looked.intents[charge_id] = _charge_intent(charge_id)
    intent_id = payment_intent_named(obj) or (looked.intents.get(charge_id) if charge_id else None)
    if (intent_id and not recorded and not TopUp.objects.filter(payment_intent_id=intent_id).exists()
            and top_ups_in_doubt().exists()):
        looked.top_ups[intent_id] = _intent_top_up(intent_id)
    if (charge_id and kind == CHARGE_REFUNDED and not refunds_listed(obj)
            and _is_ours(obj, charge_id, looked, recorded=recorded)):
        looked.refunds[charge_id] = _charge_refunds(charge_id)
    return looked


def top_ups_in_doubt() -> QuerySet[TopUp]:
    """The top-ups a PaymentIntent may have paid though they recorded none: pending (charged, or being charged, its
    answer not recorded yet) or failed with the outcome unknown (the answer lost). Their rows are committed before
    their charge is asked for, so any top-up a charge paid exists before anything about that charge can arrive."""
    return TopUp.objects.filter(Q(status=TopUpStatus.PENDING) | Q(status=TopUpStatus.FAILED, outcome_unknown=True),
                                payment_intent_id__isnull=True)


def _intent_top_up(intent_id: str) -> int | None:
    """The top-up here not credited yet that a PaymentIntent was made for, by its metadata (`top_up_id`, and
    `user_id` its user), asked of Stripe; None when Stripe does not know the intent, or it names no such top-up."""
    try:
        intent = client().v1.payment_intents.retrieve(intent_id).to_dict()
    except stripe.InvalidRequestError as exc:
        if exc.http_status == 404:
            log.warning("Stripe has no payment %s (named by a webhook event)", intent_id)
            return None
        raise _stripe_failed(exc, f"looking up payment {intent_id}") from None
    except stripe.StripeError as exc:
        raise _stripe_failed(exc, f"looking up payment {intent_id}") from None
    metadata = intent.get("metadata")
    metadata = metadata if isinstance(metadata, dict) else {}
    top_up_id, user_id = str(metadata.get("top_up_id") or ""), str(metadata.get("user_id") or "")
    if not (top_up_id.isascii() and top_up_id.isdigit() and len(top_up_id) < 19):
        return None
    return _awaiting_credit(int(top_up_id), intent_id, user_id=user_id)


def _awaiting_credit(top_up_id: int, intent_id: str, *, user_id: str) -> int | None:
    """`top_up_id` when that top-up may still be credited by `intent_id`: not credited, no other PaymentIntent
    recorded, and (when the metadata says) of that user."""
    top_up = (TopUp.objects.filter(pk=top_up_id).exclude(status=TopUpStatus.SUCCEEDED)
              .filter(Q(payment_intent_id__isnull=True) | Q(payment_intent_id=intent_id)).first())
    if top_up is None or (user_id and user_id != str(top_up.user_id)):
        return None
    return top_up.pk


def _awaited_locked(top_up_id: int, intent_id: str, what: str, object_id: str) -> TopUp | None:
    """The top-up a PaymentIntent no top-up had recorded was made for (`looked.top_ups`), locked and read again: its
    credit (which locks the top-up first, top_ups.top_up_credit) may have committed since it was looked for by the
    PaymentIntent. Credited by `intent_id` now: that top-up. Still awaiting its credit: ValueError (the event fails).
    Else (credited by another PaymentIntent, gone): None. (Found by review: the second read did not lock, so a credit
    committed between the two reads had the event ignored for good, and the bank's chargeback left in the wallet.)"""
    top_up = TopUp.objects.select_for_update(of=("self",)).select_related("user").filter(pk=top_up_id).first()
    if top_up is None:
        return None
    if top_up.status == TopUpStatus.SUCCEEDED:
        return top_up if top_up.payment_intent_id == intent_id else None
    if top_up.payment_intent_id in (None, intent_id):
        raise ValueError(f"{what} {object_id} is of payment {intent_id}, made for top-up {top_up_id}, which is not "
                         "credited yet (its charge's answer was lost): the event is processed again when Stripe "
                         "delivers it again, or when the top-up is credited")
    return None


def _names_only_its_charge(obj: dict[str, Any]) -> bool:
    """No PaymentIntent named (one named but unreadable is refused by top_up_for, not looked up)."""
    return obj.get("payment_intent") is None and payment_intent_named(obj) is None


def _refund_known(obj: dict[str, Any]) -> bool:
    return refund_matched(obj, lock=False) is not None


def refund_matched(stripe_refund: dict[str, Any], *, lock: bool = True) -> Refund | None:
    """The platform's record of a Stripe refund: by its Stripe id, else (the platform's own, its create's answer not
    recorded yet) by the `refund_id` of its metadata, unless that refund is recorded with another Stripe refund.
    Locked (after its top-up: the order every refund path takes) unless `lock` is False."""
    query = Refund.objects.select_related("top_up__user")
    refund_id = _id_of(stripe_refund.get("id"))
    refund = query.filter(stripe_refund_id=refund_id).first() if refund_id else None
    metadata = stripe_refund.get("metadata")
    ours = str((metadata if isinstance(metadata, dict) else {}).get("refund_id") or "")
    if refund is None and ours.isascii() and ours.isdigit() and len(ours) < 19:
        refund = query.filter(pk=int(ours), origin=RefundOrigin.PLATFORM, stripe_refund_id__isnull=True).first()
    if refund is None or not lock:
        return refund
    list(TopUp.objects.select_for_update().filter(pk=refund.top_up_id).values_list("pk", flat=True))
    return query.select_for_update(of=("self",)).get(pk=refund.pk)


def refunds_listed(charge: dict[str, Any]) -> bool:
    """Whether the charge lists all its refunds itself (API versions before 2022-11-15)."""
    refunds = charge.get("refunds")
    return isinstance(refunds, dict) and isinstance(refunds.get("data"), list) and refunds.get("has_more") is False


def _is_ours(charge: dict[str, Any], charge_id: str, looked: StripeLookups, *, recorded: bool) -> bool:
    """Whether a charge paid a top-up here: its id `recorded` with one, or the PaymentIntent that made it."""
    intent = payment_intent_named(charge) or looked.intents.get(charge_id)
    return recorded or (intent is not None and TopUp.objects.filter(payment_intent_id=intent).exists())


def _stripe_failed(exc: stripe.StripeError, doing: str) -> Unavailable:
    return Unavailable(f"{translate(exc, doing).message} The event is processed again when Stripe sends it again.")


def _charge_intent(charge_id: str) -> str | None:
    """The PaymentIntent that made a charge, asked of Stripe; None when Stripe has no such charge or none made it."""
    try:
        charge = client().v1.charges.retrieve(charge_id)
    except stripe.InvalidRequestError as exc:
        if exc.http_status == 404:
            log.warning("Stripe has no charge %s (named by a webhook event)", charge_id)
            return None
        raise _stripe_failed(exc, f"looking up charge {charge_id}") from None
    except stripe.StripeError as exc:
        raise _stripe_failed(exc, f"looking up charge {charge_id}") from None
    return _id_of(charge.to_dict().get("payment_intent"))


def _charge_refunds(charge_id: str) -> list[dict[str, Any]]:
    try:
        page = client().v1.refunds.list(params={"charge": charge_id, "limit": 100})
        return [refund.to_dict() for refund in page.auto_paging_iter()]
    except stripe.StripeError as exc:
        raise _stripe_failed(exc, f"listing the refunds of charge {charge_id}") from None


def top_up_for(obj: dict[str, Any], what: str, object_id: str, looked: StripeLookups | None) -> TopUp:
    """The credited top-up a charge, dispute or refund is about, locked (events about one charge apply one at a
    time). Raises ChargeEventUnusable when it is no top-up's, or not in usd; ValueError when the top-up is not
    credited yet, its PaymentIntent recorded or (`looked.top_ups`) not (the event fails, and Stripe delivers it
    again: by then the credit is there)."""
    intent_id = payment_intent_named(obj)
    charge_id = charge_named(obj)
    locked = TopUp.objects.select_for_update(of=("self",)).select_related("user")
    top_up = None
    if intent_id is None:
        if not _names_only_its_charge(obj):
            raise ChargeEventUnusable(f"{what} {object_id} names no PaymentIntent that can be read: it cannot be "
                                      "matched to a top-up here, so nothing was done.")
        if charge_id is None:
            raise ChargeEventUnusable(f"{what} {object_id} names neither a PaymentIntent nor a charge: it cannot be "
                                      "matched to a top-up here, so nothing was done.")
        top_up = locked.filter(charge_id=charge_id).first()
        if top_up is None:
            if looked is None or charge_id not in looked.intents:  # matched when looked at, gone since: try again
                raise ValueError(f"{what} {object_id}: charge {charge_id} was not looked up at Stripe")
            intent_id = looked.intents[charge_id]
            if intent_id is None:
                raise ChargeEventUnusable(f"{what} {object_id} is of charge {charge_id}, which Stripe does not know or "
                                          "no PaymentIntent made: it paid no top-up here, so nothing was done.")
    if top_up is None:
        top_up = locked.filter(payment_intent_id=intent_id).first()
        awaited = looked.top_ups.get(str(intent_id)) if top_up is None and looked is not None else None
        if awaited is not None:
            top_up = _awaited_locked(awaited, str(intent_id), what, object_id)
        if top_up is None:
            raise ChargeEventUnusable(f"{what} {object_id} is of payment {str(intent_id)[:100]}, which paid no top-up "
                                      "here: not a charge of this platform's wallet, so nothing was done.")
        if charge_id and top_up.charge_id is None:
            charge_remember(top_up=top_up, charge_id=charge_id)
    currency = obj.get("currency")
    if not isinstance(currency, str) or currency.lower() != "usd":
        raise ChargeEventUnusable(f"{what} {object_id} is in {str(currency)[:10]!r}, not in usd as top-up {top_up.pk} "
                                  "was: nothing was done.")
    if top_up.status != TopUpStatus.SUCCEEDED:
        raise ValueError(f"{what} {object_id} is of top-up {top_up.pk}, which is {top_up.status}, not credited yet")
    return top_up


def charge_remember(*, top_up: TopUp, charge_id: str | None) -> None:
    """Record the charge that paid a top-up, once; a charge id another top-up holds is left alone (logged)."""
    if not charge_id or top_up.charge_id:
        return
    try:
        with transaction.atomic():
            TopUp.objects.filter(pk=top_up.pk, charge_id__isnull=True).update(charge_id=charge_id)
        top_up.charge_id = charge_id
    except IntegrityError:
        log.error("charge %s is recorded with another top-up than %s; not recorded again", charge_id, top_up.pk)


def intent_charge(intent: dict[str, Any]) -> str | None:
    """The charge a succeeded PaymentIntent made: `latest_charge` (API versions since 2022-11-15), or the first of its
    `charges` (before)."""
    latest = _id_of(intent.get("latest_charge"))
    if latest:
        return latest
    charges = intent.get("charges")
    data = charges.get("data") if isinstance(charges, dict) else None
    return _id_of(data[0]) if isinstance(data, list) and data else None
