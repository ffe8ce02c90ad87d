"""Top-ups: money coming in from a saved card, by hand or automatically.

A top-up is recorded first (status `pending`, committed), then charged with a PaymentIntent outside any
database transaction, then marked `processing` (Stripe took the money) or `failed` (declined, or Stripe
unreachable). The wallet is credited only by the `payment_intent.succeeded` webhook
(billing.services.webhooks calls top_up_credit), once: the credit's ledger key is `top-up:<id>`.
An automatic top-up starts when the balance falls below the user's threshold (auto_top_up_start).
"""
import logging
import uuid
from datetime import timedelta
from decimal import Decimal

import stripe
from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from billing.models import AccountKind, BillingProfile, Card, EventKind, TopUp, TopUpStatus, TransactionKind
from billing.services.customers import customer_for
from billing.services.ledger import ledger_post, platform_account, user_account, wallet_balance
from billing.services.notify import event_create
from billing.services.stripe_gateway import (
    MICROS_PER_CENT,
    PaymentDeclined,
    cents,
    client,
    is_definite,
    translate,
)
from core import dispatch
from core.errors import ApplicationError, IdempotencyKeyReused, ValidationFailed
from core.idempotency import create_once
from marketplace.models import User
from marketplace.money import micros_to_usd, usd_text, usd_to_micros

log = logging.getLogger(__name__)

# The task that charges an automatic top-up (billing.tasks registers it under this name).
TOP_UP_CHARGE = dispatch.task_name("billing.tasks.top_up_charge")


def top_up_bounds() -> tuple[int, int]:
    return (usd_to_micros(Decimal(settings.BILLING_TOP_UP_MIN_USD)),
            usd_to_micros(Decimal(settings.BILLING_TOP_UP_MAX_USD)))


def top_up_for_idempotency_key(*, user: User, idempotency_key: str, request_fingerprint: str) -> TopUp | None:
    existing = TopUp.objects.filter(user=user, idempotency_key=idempotency_key).first()
    if existing is not None and existing.request_fingerprint != request_fingerprint:
        raise IdempotencyKeyReused(
            f"This Idempotency-Key was already used for a different top-up ({existing.pk}). "
            "Send the same body to get that top-up again, or use a new key."
        )
    return existing


def top_up_create(*, user: User, amount_micros: int, card: Card, idempotency_key: str = "",
                  request_fingerprint: str = "") -> tuple[TopUp, bool]:
    """Charge a saved card and return the top-up (`processing`: the credit follows with Stripe's webhook).

    Returns (top_up, created): an Idempotency-Key seen before returns that top-up without charging again.
    Raises ValidationFailed (400), PaymentDeclined (402, recorded as failed), Unavailable (503) or
    UpstreamRefused (502), the last three naming the failed top-up in `extra["top_up"]`; in each case nothing
    was credited.
    """
    low, high = top_up_bounds()
    if type(amount_micros) is not int or not low <= amount_micros <= high:
        raise ValidationFailed(f"Top up between {usd_text(low)} and {usd_text(high)}.", field="amount")
    if amount_micros % MICROS_PER_CENT:
        raise ValidationFailed("Amounts are in whole cents.", field="amount")
    if card.user_id != user.pk:
        raise ValidationFailed("No such card.", field="card")
    top_up, created = create_once(idempotency_key, lambda: top_up_for_idempotency_key(
        user=user, idempotency_key=idempotency_key, request_fingerprint=request_fingerprint),
        lambda: _top_up_insert(user=user, amount_micros=amount_micros, card=card, idempotency_key=idempotency_key,
                               request_fingerprint=request_fingerprint))
    return (top_up_charge(top_up=top_up), True) if created else (top_up, False)


def _top_up_insert(*, user: User, amount_micros: int, card: Card, idempotency_key: str,
                   request_fingerprint: str) -> TopUp:
    with transaction.atomic():  # a savepoint: the key's unique index may refuse it inside a caller's transaction
        return TopUp.objects.create(
            user=user, amount_micros=amount_micros, card=card, card_label=str(card), idempotency_key=idempotency_key,
            request_fingerprint=request_fingerprint if idempotency_key else "")


def top_up_charge(*, top_up: TopUp) -> TopUp:
    """Charge a pending top-up's card off-session (outside any transaction) and record Stripe's answer."""
    if top_up.status != TopUpStatus.PENDING or top_up.card is None:
        return top_up
    if top_up.automatic and not _auto_top_up_still_wanted(top_up=top_up):
        return top_up  # ended as not charged (or charged meanwhile by another path): top_up holds what it is now
    user = top_up.user
    try:
        customer = customer_for(user=user)
        intent = client().v1.payment_intents.create(
            # `payment_method_types`: the name localstripe (tests, demo) knows; Stripe's API of stripe 16 calls
            # it `allowed_payment_method_types`.
            params={  # type: ignore[typeddict-unknown-key]
                "amount": cents(top_up.amount_micros), "currency": "usd", "customer": customer,
                "payment_method": top_up.card.stripe_payment_method_id, "off_session": True, "confirm": True,
                "payment_method_types": ["card"],
                "metadata": {"top_up_id": str(top_up.pk), "user_id": str(user.pk)},
            },
            options={"idempotency_key": f"top-up-{top_up.pk}"},
        )
    except ApplicationError as exc:  # from customer_for: no charge was asked for
        exc.message += " Your card was not charged."
        top_up_fail(top_up=top_up, message=exc.message, notify=False)
        exc.extra["top_up"] = top_up.pk
        raise
    except stripe.StripeError as exc:
        error = translate(exc, "charging your card")
        payment_intent = getattr(getattr(exc, "error", None), "payment_intent", None)
        unknown = not is_definite(exc)
        if unknown:
            log.warning("top-up %s: outcome unknown (%s); looked up at Stripe in a few minutes", top_up.pk, exc)
            error.message += (" If your card was charged, the top-up is credited within minutes, when the payment "
                              "provider confirms it; do not top up again until then.")
        top_up_fail(top_up=top_up, message=error.message, payment_intent_id=getattr(payment_intent, "id", None),
                    notify=isinstance(error, PaymentDeclined), outcome_unknown=unknown)
        error.extra["top_up"] = top_up.pk
        raise error from None
    if intent.status in ("succeeded", "processing", "requires_capture"):
        with transaction.atomic():
            top_up = TopUp.objects.select_for_update().get(pk=top_up.pk)
            if top_up.payment_intent_id is None:
                top_up.payment_intent_id = intent.id
            if top_up.can_transition_to(TopUpStatus.PROCESSING):  # the webhook may have been faster
                top_up.transition_to(TopUpStatus.PROCESSING)
            top_up.save(update_fields=["payment_intent_id", "status", "updated_at"])
        return top_up
    message = ("Your bank asks for authentication, which a saved card cannot give off-session; "
               "use another card." if intent.status == "requires_action" else f"The payment is {intent.status}.")
    top_up_fail(top_up=top_up, message=message, payment_intent_id=intent.id, notify=True)
    raise PaymentDeclined(message + " Nothing was credited.", extra={"top_up": top_up.pk})


def top_up_fail(*, top_up: TopUp, message: str, payment_intent_id: str | None = None, notify: bool,
                outcome_unknown: bool = False) -> None:
    """Mark a top-up failed. `outcome_unknown`: Stripe's answer was lost, so it may have charged; the follow-up
    (reconcile.top_ups_find_lost) looks the payment up and credits it if it did."""
    with transaction.atomic():
        if notify and top_up.automatic:
            # A decline turns auto top-up off (_auto_top_up_stop writes the profile): the profile's lock first, then
            # the top-up's, the order every automatic top-up's writer takes (auto_top_up_start, the charge's
            # re-check _auto_top_up_still_wanted, a card's removal).
            BillingProfile.objects.select_for_update().filter(user_id=top_up.user_id).first()
        locked = TopUp.objects.select_for_update().get(pk=top_up.pk)
        if locked.can_transition_to(TopUpStatus.FAILED):
            locked.transition_to(TopUpStatus.FAILED)
            locked.failure_message = message[:500]
            locked.outcome_unknown = outcome_unknown
            if payment_intent_id and locked.payment_intent_id is None:
                locked.payment_intent_id = payment_intent_id
            locked.save(update_fields=["status", "failure_message", "payment_intent_id", "outcome_unknown",
                                       "updated_at"])
            if notify:  # declined: told; and an automatic one is not tried again on the same card by itself
                told, data = f"Your top-up of {usd_text(locked.amount_micros)} failed: {message}", {"top_up": locked.pk}
                if locked.automatic and _auto_top_up_stop(user_id=locked.user_id, card_id=locked.card_id):
                    told, data["auto_top_up_stopped"] = told + AUTO_TOP_UP_STOPPED, True
                event_create(user=locked.user, kind=EventKind.TOP_UP_FAILED, message=told, data=data,
                             email=locked.automatic)
        top_up.refresh_from_db()


def top_up_credit(*, top_up_id: int, payment_intent_id: str, amount_micros: int) -> bool:
    """Credit the wallet for a top-up Stripe says succeeded. Once per top-up; False if it was already.

    Call inside a transaction (the webhook's). A top-up that failed here (Stripe unreachable) but was
    charged after all is credited too: the money arrived.
    """
    top_up = TopUp.objects.select_for_update().get(pk=top_up_id)
    if top_up.status == TopUpStatus.SUCCEEDED:
        return False
    if amount_micros != top_up.amount_micros:
        raise ValueError(f"top-up {top_up.pk} is for {top_up.amount_micros} µ$, Stripe charged {amount_micros} µ$")
    txn, _ = ledger_post(
        idempotency_key=f"top-up:{top_up.pk}", kind=TransactionKind.TOP_UP,
        lines=[(user_account(user_id=top_up.user_id, kind=AccountKind.CUSTOMER_WALLET), amount_micros),
               (platform_account(kind=AccountKind.PAYMENT_CLEARING), -amount_micros)],
        memo=f"Top-up {top_up.pk} ({payment_intent_id})",
    )
    top_up.transition_to(TopUpStatus.SUCCEEDED)
    top_up.failure_message = ""
    top_up.outcome_unknown = False
    top_up.transaction = txn
    top_up.payment_intent_id = top_up.payment_intent_id or payment_intent_id
    # The ledger's own moment, not a second clock read after its writes: the statement places the top-up by its
    # transaction, and dates its line by credited_at (found by review: credited at 23:59:59.999 on a month's last
    # day, it was listed in that month and dated the next).
    top_up.credited_at = txn.created_at
    top_up.save(update_fields=["status", "failure_message", "outcome_unknown", "transaction", "payment_intent_id",
                               "credited_at", "updated_at"])
    event_create(user=top_up.user, kind=EventKind.TOP_UP_SUCCEEDED,
                 message=f"{usd_text(amount_micros)} was added to your balance.",
                 data={"top_up": top_up.pk, "amount": str(micros_to_usd(amount_micros))})
    return True


# ----------------------------------------------------------------------------------- auto top-up

# A declined automatic top-up turns automatic top-ups off: else the meter, which starts one whenever the balance
# is under the threshold, would charge the declined card again every minute (and tell the user each time).
AUTO_TOP_UP_STOPPED = (" Automatic top-ups are now off, so that card is not charged again: turn them on again on "
                       "the Billing page (or PATCH /api/v1/billing/profile/) once it works, or with another card.")
# An automatic top-up that failed for another reason (the payment provider did not answer) is retried, but not
# sooner than this after the last one.
AUTO_TOP_UP_RETRY_AFTER = timedelta(hours=1)


def _auto_top_up_stop(*, user_id: int, card_id: int | None) -> bool:
    """Turn a user's automatic top-ups off after their card was declined; True if they were on with that card."""
    return bool(BillingProfile.objects.filter(user_id=user_id, auto_top_up_enabled=True,
                                              auto_top_up_card_id=card_id).update(auto_top_up_enabled=False))


# Why an automatic top-up, pending since it was started, is ended before its charge (_auto_top_up_still_wanted).
NOT_CHARGED_DEACTIVATED = ("Not charged: the account is deactivated, so automatic top-ups no longer charge its card. "
                           "Your card was not charged.")
NOT_CHARGED_TURNED_OFF = ("Not charged: automatic top-ups were turned off before this one was charged. Your card was "
                          "not charged.")
NOT_CHARGED_CHANGED = ("Not charged: the card or the amount of automatic top-ups was changed before this one was "
                       "charged; the next one follows the new settings. Your card was not charged.")
NOT_CHARGED = (NOT_CHARGED_DEACTIVATED, NOT_CHARGED_TURNED_OFF, NOT_CHARGED_CHANGED)


def _account_active(*, user_id: int) -> bool:
    """Whether the account is active, read under a key-share lock on its row, as a booking reads its provider's
    (marketplace.services.instances.allocation): a deactivation under way (account_status.account_deactivate, FOR
    UPDATE) is waited for and what it committed is read; a log-in's update of the row does not wait for it."""
    if connection.vendor != "postgresql":  # SQLite: writes are serialised anyway; Django has no FOR KEY SHARE
        return bool(User.objects.filter(pk=user_id).values_list("is_active", flat=True).first())
    with connection.cursor() as cursor:  # a locked row is read as last committed, after any wait (READ COMMITTED)
        cursor.execute(f"SELECT is_active FROM {User._meta.db_table} WHERE id = %s FOR KEY SHARE",  # noqa: S608
                       [user_id])
        row = cursor.fetchone()
    return bool(row and row[0])


def _auto_top_up_not_wanted(*, profile: BillingProfile | None, user_id: int, card_id: int | None,
                            amount_micros: int) -> str | None:
    """Why an automatic top-up of `amount_micros` on card `card_id` may not be charged now, or None when it may:
    auto top-up on with that card and that amount, and the account active. Call under the profile's lock."""
    if profile is None or not profile.auto_top_up_enabled or profile.auto_top_up_card_id is None:
        return NOT_CHARGED_TURNED_OFF
    if profile.auto_top_up_card_id != card_id or profile.auto_top_up_amount_micros != amount_micros:
        return NOT_CHARGED_CHANGED
    if not _account_active(user_id=user_id):
        return NOT_CHARGED_DEACTIVATED
    return None


def _auto_top_up_still_wanted(*, top_up: TopUp) -> bool:
    """Right before an automatic top-up's charge: whether it may go out. Its owner's profile and account are read
    again under the profile's lock (then the account's key share, then the top-up's lock: the order of
    auto_top_up_start, of a card's removal, and of a decline's top_up_fail), so that a switch-off (profile_update
    holds the profile's lock), a card or amount changed since it started, or a deactivation (the account's row,
    FOR UPDATE) committed before this point is seen, and one under way is waited for. Otherwise it is ended as not
    charged, in the same transaction: failed, `outcome_unknown` False, no event (its owner made the change, or
    cannot log in to read one). Stripe is called after this commits, outside any transaction: a change that
    commits after this check comes after the charge started, as one a moment after the charge would.
    False also when the top-up is no longer pending (another path charged or ended it meanwhile)."""
    with transaction.atomic():
        profile = BillingProfile.objects.select_for_update().filter(user_id=top_up.user_id).first()
        why = _auto_top_up_not_wanted(profile=profile, user_id=top_up.user_id, card_id=top_up.card_id,
                                      amount_micros=top_up.amount_micros)
        status = TopUp.objects.select_for_update().filter(pk=top_up.pk).values_list("status", flat=True).first()
        if status != TopUpStatus.PENDING:  # charged (processing) or ended by another path meanwhile: left as it is
            top_up.refresh_from_db()
            return False
        if why is None:
            return True
        log.info("automatic top-up %s of user %s: %s", top_up.pk, top_up.user_id, why)
        top_up_fail(top_up=top_up, message=why, notify=False)  # locks the top-up; refreshes `top_up`
        return False


def auto_top_up_start(*, user_id: int) -> TopUp | None:
    """Start an automatic top-up for a user below their threshold, unless one is under way already, or the account
    is deactivated (its owner cannot log in to turn auto top-up off; the platform does not charge their card).

    Called by the meter tick; the charge itself runs in a task (TOP_UP_CHARGE), which checks again right before
    charging (_auto_top_up_still_wanted).
    """
    with transaction.atomic():
        profile = BillingProfile.objects.select_for_update().filter(user_id=user_id).first()
        if profile is None or not profile.auto_top_up_enabled or profile.auto_top_up_card_id is None:
            return None
        if not _account_active(user_id=user_id):  # after the profile's lock, as the charge's re-check takes them
            return None
        if wallet_balance(user_id=user_id) >= profile.auto_top_up_threshold_micros:
            return None
        # One under way, however old (pending, processing, or failed with its outcome unknown: the card may have
        # been charged, and the follow-ups settle it), or one that definitely failed within the hour since the
        # user last changed their auto top-up: not another yet. (Before, the hour bounded the ones under way too:
        # one still processing after an hour, its webhook lost, no longer counted and the card was charged again
        # every hour.)
        # A top-up ended before its charge (_auto_top_up_still_wanted: the account deactivated, auto top-up turned
        # off or changed) reached no card: it holds none back. Before, one ended by a deactivation held the next
        # back for an hour after the account was reactivated, its balance below the threshold (found by review).
        since = timezone.now() - AUTO_TOP_UP_RETRY_AFTER
        automatic = TopUp.objects.filter(user_id=user_id, automatic=True)
        failed_since = max(since, profile.auto_top_up_changed_at or since)
        if (automatic.filter(Q(status__in=[TopUpStatus.PENDING, TopUpStatus.PROCESSING])
                             | Q(status=TopUpStatus.FAILED, outcome_unknown=True)).exists()
                or automatic.filter(status=TopUpStatus.FAILED, created_at__gt=failed_since)
                .exclude(failure_message__in=NOT_CHARGED).exists()):
            return None
        top_up = TopUp.objects.create(
            user_id=user_id, amount_micros=profile.auto_top_up_amount_micros, card_id=profile.auto_top_up_card_id,
            card_label=str(profile.auto_top_up_card), automatic=True, idempotency_key=f"auto-{uuid.uuid4()}",
        )

        # A broker that refuses the charge leaves the top-up pending: reconcile.top_ups_charge_pending charges
        # it after BILLING_TOP_UP_RECONCILE_AFTER_S.
        dispatch.enqueue_on_commit(TOP_UP_CHARGE, top_up.pk)
    return top_up


def auto_top_up_rearm(*, user_id: int) -> TopUp | None:
    """An account turned on again (marketplace.services.account_status.account_reactivate): its auto top-up, left
    as its owner set it while it was off, starts at once if the balance is below the threshold, not at the next
    tick. auto_top_up_start decides, under the profile's lock (one under way already: none; the charge re-checks
    under it too), so a tick at the same moment starts no second one. Never raises: a failure is logged, and the
    next tick (every minute) tries as always."""
    try:
        return auto_top_up_start(user_id=user_id)
    except Exception:
        log.exception("auto top-up of reactivated account %s not started now; the next tick tries", user_id)
        return None


def top_up_charge_by_id(*, top_up_id: int) -> None:
    top_up = TopUp.objects.select_related("user", "card").filter(pk=top_up_id).first()
    if top_up is None or top_up.status != TopUpStatus.PENDING:
        return
    try:
        top_up_charge(top_up=top_up)
    except ApplicationError as exc:
        log.info("automatic top-up %s failed: %s", top_up_id, exc.message)
