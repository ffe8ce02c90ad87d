"""Refunds: (part of) a top-up given back to its card, by an operator here or by someone in Stripe's dashboard.

One rule for every refund, whoever made it (`stripe_refund_apply`): the wallet is debited while Stripe has the
refund pending, requires_action or succeeded (once: ledger key `refund:<Stripe refund id>`), and given back once when
it fails or is canceled (`refund-failed:<refund id>`, a reversal of the debit; the customer told). Stripe's events
may come twice and in any order: a refund told failed is failed for good, and a later (stale) event saying it is
pending or succeeded debits nothing.

An operator's refund takes its amount from the wallet before Stripe is asked: a `pending` Refund and, in the same
transaction and under the same locks (the top-up, then every account a refund touches, in one id-sorted step:
_accounts_locked), its hold: wallet → the platform's `refunds_pending` account (ledger key `refund-hold:<refund id>`,
kind `refund_hold`, the customer told that the amount is held for a refund to their card). Every balance reader (the
booking and start funds check, enforcement, auto top-up, the balance API) sees the held money as gone, so it cannot be
spent while the refund is pending (before, only other refunds were held back from it, and a confirmed refund drove the
wallet below zero: found by review). Stripe is called outside the transaction; on its answer the refund is made
(refund_confirm: the hold → payment clearing, under `refund:<Stripe refund id>`; the wallet is not touched again). When
Stripe says it made none (a definite error, a failed or canceled refund, or refunds_reconcile finding none), the refund
fails and its hold goes back to the wallet, once (`refund-hold-release:<refund id>`, a reversal of the hold:
refund_not_made). When Stripe's answer is lost (no answer, a 5xx, an idempotency conflict), Stripe may have refunded:
the refund stays pending, its amount held, so that no second refund can give it back again and it cannot be spent,
until Stripe's refund event or billing.services.reconcile.refunds_reconcile finds Stripe's refund for it (by its
metadata) and settles it. A refund pending from before holds were posted (migration 0017: no `hold`) is still debited
from the wallet when made, and the reservation check counts its amount as before; so is one made at Stripe after it
failed here (its hold given back).

A refund made in Stripe's dashboard is recorded when Stripe tells it (`refund.created`/`.updated`/`.failed`,
`charge.refund.updated`, or `charge.refunded` with the charge's refunds): a Refund of origin `stripe`, without an
operator, under the same rule. What a top-up has left to refund (`refundable_micros`) counts every refund not
failed, and what a dispute holds (billing.services.disputes): Stripe no longer has that money. A refund made at
Stripe has no hold: it is recorded and settled (debited or failed) in the transaction of Stripe's event.
"""
from typing import Any

import stripe
from django.db import transaction
from django.db.models import Sum

from billing.models import (
    Account,
    AccountKind,
    Dispute,
    EventKind,
    LedgerTransaction,
    Refund,
    RefundOrigin,
    RefundStatus,
    TopUp,
    TopUpStatus,
    TransactionKind,
)
from billing.services.charges import (
    ChargeEventUnusable,
    StripeLookups,
    object_id,
    refund_matched,
    refunds_listed,
    top_up_for,
    whole_cents,
)
from billing.services.ledger import accounts_lock, ledger_post, platform_account, user_account, wallet_balance
from billing.services.notify import event_create
from billing.services.stripe_gateway import MICROS_PER_CENT, cents, client, is_definite, translate
from core.errors import Conflict, IdempotencyKeyReused, Unavailable, ValidationFailed
from core.idempotency import create_once
from core.staff import STAFF_ACCOUNT_REFUSED, staff_of_a_non_superuser
from marketplace.models import User
from marketplace.money import micros_to_usd, usd_text


def refundable_micros(*, top_up: TopUp) -> int:
    """What of a top-up can still be refunded: its amount less every refund not failed (the platform's, pending or
    debited, and those made at Stripe) and what disputes hold (under dispute, or lost to a chargeback: the bank took
    it, so Stripe has it no more). Never below zero."""
    if top_up.status != TopUpStatus.SUCCEEDED:
        return 0
    taken = top_up.refunds.filter(status__in=[RefundStatus.PENDING, RefundStatus.SUCCEEDED]).aggregate(
        total=Sum("amount_micros"))["total"] or 0
    return max(0, top_up.amount_micros - taken - disputed_micros(top_up=top_up))


def disputed_micros(*, top_up: TopUp) -> int:
    """What disputes of a top-up hold: debited and not given back (under dispute, or lost)."""
    return Dispute.objects.filter(top_up=top_up, debit__isnull=False, reversal__isnull=True).aggregate(
        total=Sum("amount_micros"))["total"] or 0


REFUND_NOTE = "Refunded to your card."
REFUND_HOLD_NOTE = ("Held for a refund to your card: taken from your balance now, and back in it if the refund is "
                    "not made.")
REFUND_RELEASED_NOTE = "The refund to your card was not made: the amount held for it is back in your balance."


def refund_for_idempotency_key(*, created_by: User, idempotency_key: str, request_fingerprint: str) -> Refund | None:
    """The refund an earlier request of this operator with this key made, or None.

    Raises IdempotencyKeyReused (422) when that request had another body."""
    existing = Refund.objects.filter(created_by=created_by, idempotency_key=idempotency_key).first()
    if existing is not None and existing.request_fingerprint != request_fingerprint:
        raise IdempotencyKeyReused(
            f"This Idempotency-Key was already used for a different refund ({existing.pk}, of top-up "
            f"{existing.top_up_id}). Send the same body to get that refund again, or use a new key.")
    return existing


# Separation of duties: no operator moves money on their own account, superuser or not (a refund of their own top-up
# would send their wallet, credits included, to their card). Another operator does it. billing/admin.py refuses
# credits and reversals on the operator's own accounts with the same words.
OWN_ACCOUNT_REFUSED = ("an operator does not move money on their own account (separation of duties); "
                       "ask another operator.")
# And a staff account's top-up is a superuser's to refund (core.staff): two non-superuser staff may not do for each
# other what neither may do for themselves. Here, not in the admin alone, so that the refunds API keeps it too (before,
# POST /api/v1/billing/refunds/ refunded another staff account's top-up that the admin refused: found by review).
STAFF_TOP_UP_REFUSED = (f"{STAFF_ACCOUNT_REFUSED}: a staff account's top-up is refunded by a superuser; nothing was "
                        "refunded.")


def refund_create(*, top_up: TopUp, amount_micros: int, reason: str, created_by: User,
                  customer_note: str = "") -> Refund:
    """Give (part of) a top-up back to its card and debit the wallet. Operators only.

    `reason` is the operator's (operators only); `customer_note` is what the customer reads (REFUND_NOTE when not
    given).

    The amount is held first (a pending refund and its hold, taken from the wallet under locks on the top-up and the
    wallet), so that two refunds at once cannot give back more than was paid, or more than the customer has left,
    and the customer cannot spend it while Stripe is asked.
    """
    refund, _ = refund_create_once(top_up=top_up, amount_micros=amount_micros, reason=reason,
                                   created_by=created_by, customer_note=customer_note)
    return refund


def refund_create_once(*, top_up: TopUp, amount_micros: int, reason: str, created_by: User,
                       customer_note: str = "", idempotency_key: str = "",
                       request_fingerprint: str = "") -> tuple[Refund, bool]:
    """refund_create for a request that may come twice (an API retry, an admin form sent again): returns (refund,
    created). With an `idempotency_key` this operator used before and the same body: the earlier refund (in
    whatever state it is now) and False, and nothing is refunded again; with another body, IdempotencyKeyReused
    (422). The database decides a race between the two (refund_unique_idempotency_key), not a look before.

    Refused (Conflict) for the operator's own top-up (OWN_ACCOUNT_REFUSED), and for a staff account's top-up unless
    the operator is a superuser (STAFF_TOP_UP_REFUSED)."""
    if top_up.user_id == created_by.pk:
        raise Conflict(OWN_ACCOUNT_REFUSED)
    if staff_of_a_non_superuser(created_by, top_up.user):
        raise Conflict(STAFF_TOP_UP_REFUSED)
    if type(amount_micros) is not int or amount_micros <= 0 or amount_micros % MICROS_PER_CENT:
        raise ValidationFailed("Refund a positive amount in whole cents.", field="amount")
    if not reason.strip():
        raise ValidationFailed("Give a reason.", field="reason")
    fingerprint = request_fingerprint if idempotency_key else ""
    # The database decides a race between two requests with the key (refund_unique_idempotency_key); a retry
    # refused because its original used the refundable amount gets the original.
    refund, created = create_once(idempotency_key, lambda: refund_for_idempotency_key(
        created_by=created_by, idempotency_key=idempotency_key, request_fingerprint=fingerprint),
        lambda: _refund_reserve(top_up=top_up, amount_micros=amount_micros, reason=reason, created_by=created_by,
                                customer_note=customer_note, idempotency_key=idempotency_key,
                                request_fingerprint=fingerprint))
    return (_refund_send(refund=refund), True) if created else (refund, False)


def _refund_reserve(*, top_up: TopUp, amount_micros: int, reason: str, created_by: User, customer_note: str,
                    idempotency_key: str, request_fingerprint: str) -> Refund:
    """The pending refund and its hold (its amount from the wallet to the refunds-pending account), in one
    transaction under locks on the top-up, then every account a refund touches (_accounts_locked)."""
    with transaction.atomic():
        top_up = TopUp.objects.select_for_update().get(pk=top_up.pk)
        if top_up.status != TopUpStatus.SUCCEEDED or not top_up.payment_intent_id:
            raise Conflict(f"Only a credited top-up can be refunded; this one is {top_up.status}.")
        left = refundable_micros(top_up=top_up)
        if amount_micros > left:
            held = disputed_micros(top_up=top_up)
            raise Conflict(f"At most {usd_text(left)} of this top-up can still be refunded"
                           + (f" ({usd_text(held)} of it is under dispute or was taken back by the card holder's bank)"
                              if held else "") + ".")
        # Every account a refund can touch, locked now in one step in id order (_accounts_locked): the balance read
        # here is the one the hold is posted against.
        accounts = _accounts_locked(user_id=top_up.user_id)
        wallet, pending = accounts[AccountKind.CUSTOMER_WALLET], accounts[AccountKind.REFUNDS_PENDING]
        mine = Refund.objects.filter(top_up__user_id=top_up.user_id, status=RefundStatus.PENDING)
        # Refunds pending from before holds were posted (migration 0017) are still in the balance: held back here.
        unheld = mine.filter(hold__isnull=True).aggregate(total=Sum("amount_micros"))["total"] or 0
        if amount_micros > wallet.balance_micros - unheld:
            # What else is not in the balance: held for their other pending refunds (out of the balance already),
            # or spent, or debited (refunds, disputes, corrections). "The rest was spent" was said of held money too.
            held = mine.filter(hold__isnull=False).aggregate(total=Sum("amount_micros"))["total"] or 0
            raise Conflict(
                f"The customer's balance is {usd_text(wallet.balance_micros)}"
                + (f", {usd_text(unheld)} of it kept back for their refunds pending from before refunds were held"
                   if unheld else "")
                + (f"; {usd_text(held)} more is held for their other refunds, still pending" if held else "")
                + ". The rest of what they paid in was spent or debited. Refund at most "
                + f"{usd_text(max(0, wallet.balance_micros - unheld))}."
            )
        refund = Refund.objects.create(top_up=top_up, amount_micros=amount_micros, reason=reason,
                                       customer_note=customer_note.strip() or REFUND_NOTE, created_by=created_by,
                                       idempotency_key=idempotency_key, request_fingerprint=request_fingerprint)
        refund.hold, _ = ledger_post(
            idempotency_key=f"refund-hold:{refund.pk}", kind=TransactionKind.REFUND_HOLD,
            lines=[(wallet, -amount_micros), (pending, amount_micros)],
            memo=f"Refund {refund.pk} of top-up {top_up.pk}: held until the card is refunded", reason=reason,
            customer_note=REFUND_HOLD_NOTE, created_by=created_by,
        )
        refund.save(update_fields=["hold"])
        return refund


def _refund_send(*, refund: Refund) -> Refund:
    """Ask Stripe for a held refund (outside any transaction) and record its answer."""
    top_up = refund.top_up
    assert top_up.payment_intent_id is not None  # _refund_reserve refunds only a top-up Stripe charged
    try:
        answer = client().v1.refunds.create(
            params={"payment_intent": top_up.payment_intent_id, "amount": cents(refund.amount_micros),
                    "metadata": {"refund_id": str(refund.pk), "top_up_id": str(top_up.pk)}},
            options={"idempotency_key": f"refund-{refund.pk}"},
        )
    except stripe.StripeError as exc:
        error = translate(exc, "refunding the card")
        if not is_definite(exc):  # Stripe may have refunded: the amount stays held until it is asked
            Refund.objects.filter(pk=refund.pk, status=RefundStatus.PENDING).update(
                failure_message=f"Outcome unknown: {error.message}"[:500])
            raise Unavailable(
                f"The payment provider's answer to refund {refund.pk} was lost, so whether the card was refunded is "
                "not known yet. The refund stays pending, its amount held from the customer's balance, and is settled "
                "with what the payment provider says within a few minutes: do not refund it again.",
                extra={"refund": refund.pk}) from None
        # Stripe made no refund: failed and its hold given back, unless its event said otherwise meanwhile (then that
        # stands).
        refund_not_made(refund_id=refund.pk, failure_message=error.message)
        raise error from None
    if answer.status in REFUND_GIVEN_BACK:
        # The one rule, as for its events: failed with its Stripe id kept (a late event finds it failed and debits
        # nothing), and a debit its event made while this answer travelled given back.
        with transaction.atomic():
            _give_back(refund=_locked(refund.pk), stripe_refund={"id": answer.id, "status": answer.status})
        raise Conflict(f"The payment provider says the refund {answer.status}; nothing was refunded, and the amount "
                       "held for it is back in the customer's balance.")
    confirmed = refund_confirm(refund_id=refund.pk, stripe_refund_id=answer.id)
    if confirmed.status == RefundStatus.FAILED:  # Stripe's refund.failed came first (refund_confirm leaves it)
        raise Conflict(f"{confirmed.failure_message} The refund failed; the customer's balance is as it was.")
    return confirmed


def refund_confirm(*, refund_id: int, stripe_refund_id: str) -> Refund:
    """Post the refund (to payment clearing), once: idempotent on the Stripe refund id. A pending refund with a hold
    moves its hold (refunds pending → payment clearing: the wallet gave the amount when it was held); any other (made
    at Stripe, pending from before holds, or failed here, its hold given back, and made at Stripe after all) is
    debited from the wallet."""
    with transaction.atomic():
        refund = _locked(refund_id)
        if refund.status == RefundStatus.SUCCEEDED:
            return refund
        if refund.status == RefundStatus.FAILED and refund.stripe_refund_id == stripe_refund_id:
            # Stripe's refund.failed for this very refund came while its create's answer was on the way (found
            # by review: the wallet was debited for a refund Stripe said failed). Failed stays failed.
            return refund
        top_up = refund.top_up
        # A refund's hold stands while it is pending: every way out of pending but this one gives it back
        # (refund_not_made, _give_back).
        source = (platform_account(kind=AccountKind.REFUNDS_PENDING)
                  if refund.hold_id is not None and refund.status == RefundStatus.PENDING
                  else user_account(user_id=top_up.user_id, kind=AccountKind.CUSTOMER_WALLET))
        txn, _ = ledger_post(
            idempotency_key=f"refund:{stripe_refund_id}", kind=TransactionKind.REFUND,
            lines=[(source, -refund.amount_micros),
                   (platform_account(kind=AccountKind.PAYMENT_CLEARING), refund.amount_micros)],
            memo=f"Refund {refund.pk} of top-up {top_up.pk} ({stripe_refund_id})", reason=refund.reason,
            customer_note=refund.customer_note, created_by=refund.created_by,
        )
        refund.transition_to(RefundStatus.SUCCEEDED)
        refund.stripe_refund_id = stripe_refund_id
        refund.transaction = txn
        refund.failure_message = ""
        refund.save(update_fields=["status", "stripe_refund_id", "transaction", "failure_message"])
        data = {"top_up": top_up.pk, "refund": refund.pk, "amount": str(micros_to_usd(refund.amount_micros))}
        if refund.origin == RefundOrigin.STRIPE:  # not asked for here: told by e-mail, with the balance left
            event_create(user=top_up.user, kind=EventKind.REFUND, email=True,
                         message=f"{usd_text(refund.amount_micros)} of your top-up {top_up.pk} was refunded to your "
                                 "card, so it was debited from your balance, which is now "
                                 f"{usd_text(wallet_balance(user_id=top_up.user_id))}.",
                         data={**data, "transaction": txn.pk, "outside_platform": True})
        else:
            event_create(user=top_up.user, kind=EventKind.REFUND,
                         message=f"{usd_text(refund.amount_micros)} of your top-up {top_up.pk} was refunded to "
                                 f"your card: {refund.customer_note or REFUND_NOTE}", data=data)
    return refund


def refund_not_made(*, refund_id: int, failure_message: str, stripe_refund_id: str | None = None) -> bool:
    """A pending refund Stripe did not make (its definite error, or none found at Stripe, or one it failed or
    canceled: `stripe_refund_id`): failed, and its hold given back to the wallet (once). False, and nothing done,
    when it is no longer pending (an event settled it meanwhile)."""
    with transaction.atomic():
        refund = _locked(refund_id)
        if refund.status != RefundStatus.PENDING:
            return False
        _fail_pending(refund=refund, failure_message=failure_message, stripe_refund_id=stripe_refund_id)
    return True


def _fail_pending(*, refund: Refund, failure_message: str, stripe_refund_id: str | None) -> None:
    """Fail a pending refund (`refund` locked, in a transaction) and give its hold back to the wallet: a reversal of
    the hold, once (ledger key `refund-hold-release:<refund id>`, and a hold is reversed at most once). Its Stripe id
    is kept (refund_confirm, with the create's answer or an older event still on its way, must not take it for a
    refund that was made after all)."""
    outcome = " Nothing was debited."
    if refund.hold_id is not None:
        top_up = refund.top_up
        hold = LedgerTransaction.objects.get(pk=refund.hold_id)
        ledger_post(
            idempotency_key=f"refund-hold-release:{refund.pk}", kind=TransactionKind.REVERSAL, reverses=hold,
            lines=[(user_account(user_id=top_up.user_id, kind=AccountKind.CUSTOMER_WALLET), refund.amount_micros),
                   (platform_account(kind=AccountKind.REFUNDS_PENDING), -refund.amount_micros)],
            memo=f"Refund {refund.pk} of top-up {top_up.pk} not made: its hold given back",
            customer_note=REFUND_RELEASED_NOTE,
        )
        outcome = " Nothing was refunded: the amount held for it is back in the balance."
    Refund.transition_rows(Refund.objects.filter(pk=refund.pk), RefundStatus.FAILED,
                           stripe_refund_id=refund.stripe_refund_id or stripe_refund_id,
                           failure_message=f"{failure_message}{outcome}"[:500])


def _locked(refund_id: int) -> Refund:
    """A refund locked after its top-up and the accounts a refund touches: the order every refund path takes (a
    webhook of its charge locks the top-up first), so that two of them never wait on each other."""
    top_up_id, user_id = Refund.objects.filter(pk=refund_id).values_list("top_up_id", "top_up__user_id").get()
    list(TopUp.objects.select_for_update().filter(pk=top_up_id).values_list("pk", flat=True))
    _accounts_locked(user_id=user_id)
    return Refund.objects.select_for_update(of=("self",)).select_related("top_up__user").get(pk=refund_id)


def _accounts_locked(*, user_id: int) -> dict[str, Account]:
    """Every account a refund of the customer's top-ups can touch (their wallet, payment clearing, refunds pending),
    locked in one step, in id order, by kind. Each refund path takes it right after the top-up's lock and before its
    first posting; then the postings of one transaction (charge.refunded settles each of a charge's refunds: a hold
    made, a hold given back, a dashboard refund debited) lock nothing more. ledger_post locks one posting's accounts
    in id order, but a second posting locked its own after holding the first's: settling a held refund (payment
    clearing, refunds pending) and then debiting the wallet for a dashboard refund, while an operator's refund of
    another top-up held the wallet and waited for refunds pending, or a top-up credited held payment clearing and
    waited for the wallet, deadlocked (found by review). A top-up's credit and a dispute post once (or twice to the
    same two accounts) and lock in one step already."""
    accounts = {AccountKind.CUSTOMER_WALLET: user_account(user_id=user_id, kind=AccountKind.CUSTOMER_WALLET),
                AccountKind.PAYMENT_CLEARING: platform_account(kind=AccountKind.PAYMENT_CLEARING),
                AccountKind.REFUNDS_PENDING: platform_account(kind=AccountKind.REFUNDS_PENDING)}
    locked = accounts_lock(accounts.values())
    return {kind: locked[account.pk] for kind, account in accounts.items()}


REFUND_DEBITED = ("pending", "requires_action", "succeeded")
REFUND_GIVEN_BACK = ("failed", "canceled")
REFUND_FAILED_NOTE = "The refund to your card failed at the payment provider: the amount is back in your balance."


def stripe_refund_apply(*, stripe_refund: dict[str, Any], looked: StripeLookups | None = None,
                        top_up: TopUp | None = None) -> bool:
    """Apply what Stripe says of one refund, whoever made it (the one rule: the module's docstring). A refund that is
    not the platform's is recorded first, as made at Stripe, against the top-up its charge paid (`top_up` when the
    caller found it already: a charge.refunded's). Call inside a transaction. Raises ChargeEventUnusable for a refund
    that cannot be read or is no top-up's, ValueError for one of a top-up not credited yet."""
    refund_id = object_id(stripe_refund, "refund")
    status = stripe_refund.get("status")
    if status not in REFUND_DEBITED + REFUND_GIVEN_BACK:
        raise ChargeEventUnusable(f"Refund {refund_id} has status {str(status)[:40]!r}, not one this platform acts on: "
                                  "nothing was done.")
    # Another top-up's refund listed with a charge is refused before its top-up is locked: not after this one's.
    refund = refund_matched(stripe_refund, lock=top_up is None)
    if refund is not None and top_up is not None:
        if refund.top_up_id != top_up.pk:
            raise ChargeEventUnusable(f"Refund {refund_id} is listed with the charge of top-up {top_up.pk}, but is a "
                                      f"refund of top-up {refund.top_up_id} here: nothing was done.")
        refund = refund_matched(stripe_refund)
    if refund is None:
        if top_up is None:
            top_up = top_up_for(stripe_refund, "Refund", refund_id, looked)
        refund = _made_at_stripe(top_up=top_up, stripe_refund=stripe_refund, refund_id=refund_id)
    _accounts_locked(user_id=refund.top_up.user_id)  # before the first posting (_accounts_locked)
    if status in REFUND_GIVEN_BACK:
        _give_back(refund=refund, stripe_refund=stripe_refund)
    else:
        refund_confirm(refund_id=refund.pk, stripe_refund_id=refund_id)
    return True


def _made_at_stripe(*, top_up: TopUp, stripe_refund: dict[str, Any], refund_id: str) -> Refund:
    """The record of a refund made at Stripe (pending here: stripe_refund_apply debits it or fails it next), made
    once: under the top-up's lock, found again by its Stripe id. One debited before refunds made at Stripe were kept
    one by one (migration 0013: no Stripe id) is the one of the same amount: it takes this id."""
    currency = stripe_refund.get("currency")
    if not isinstance(currency, str) or currency.lower() != "usd":
        raise ChargeEventUnusable(f"Refund {refund_id} is in {str(currency)[:10]!r}, not in usd as top-up {top_up.pk} "
                                  "was: nothing was done.")
    amount = whole_cents(stripe_refund, "amount", "Refund", refund_id) * MICROS_PER_CENT
    if not 0 < amount <= top_up.amount_micros:
        raise ChargeEventUnusable(f"Refund {refund_id} is for {usd_text(amount)}, not an amount of top-up {top_up.pk} "
                                  f"({usd_text(top_up.amount_micros)}): nothing was done.")
    mine = Refund.objects.select_for_update(of=("self",)).select_related("top_up__user")
    refund = mine.filter(stripe_refund_id=refund_id).first()
    if refund is not None:
        return refund
    earlier = mine.filter(top_up=top_up, origin=RefundOrigin.STRIPE, stripe_refund_id__isnull=True,
                          amount_micros=amount).order_by("pk").first()
    if earlier is not None:
        earlier.stripe_refund_id = refund_id
        earlier.save(update_fields=["stripe_refund_id"])
        return earlier
    why = str(stripe_refund.get("reason") or "not given")[:60]
    return Refund.objects.create(
        top_up=top_up, amount_micros=amount, origin=RefundOrigin.STRIPE, stripe_refund_id=refund_id,
        reason=f"Refunded at Stripe (its dashboard), not through the platform: Stripe refund {refund_id}, reason: "
               f"{why}.",
        customer_note=REFUND_NOTE)


def _give_back(*, refund: Refund, stripe_refund: dict[str, Any]) -> None:
    """A refund Stripe says failed or was canceled (`refund` locked). Debited here already: the debit is reversed
    (once: ledger key `refund-failed:<id>`), the refund failed, and the customer told; still pending here: failed,
    its hold (if it has one) given back (_fail_pending), its amount refundable again; failed here already:
    nothing."""
    failure_reason = stripe_refund.get("failure_reason")  # text, or left out (one of another type failed the event)
    why = (failure_reason if isinstance(failure_reason, str) else "").replace("_", " ")
    told = f"The payment provider says the refund {stripe_refund.get('status')}{f' ({why})' if why else ''}."
    if refund.status == RefundStatus.PENDING:
        _fail_pending(refund=refund, failure_message=told,
                      stripe_refund_id=stripe_refund.get("id") or None)
        return
    if refund.status != RefundStatus.SUCCEEDED or refund.transaction is None:
        return  # failed here already: nothing was debited, or it was given back
    top_up = refund.top_up
    ledger_post(
        idempotency_key=f"refund-failed:{refund.pk}", kind=TransactionKind.REVERSAL, reverses=refund.transaction,
        lines=[(user_account(user_id=top_up.user_id, kind=AccountKind.CUSTOMER_WALLET), refund.amount_micros),
               (platform_account(kind=AccountKind.PAYMENT_CLEARING), -refund.amount_micros)],
        memo=f"Refund {refund.pk} of top-up {top_up.pk} failed at Stripe ({refund.stripe_refund_id})",
        customer_note=REFUND_FAILED_NOTE,
    )
    refund.transition_to(RefundStatus.FAILED)
    refund.failure_message = f"{told} The amount is back in the balance."[:500]
    refund.save(update_fields=["status", "failure_message"])
    event_create(user=top_up.user, kind=EventKind.REFUND,
                 message=f"The refund of {usd_text(refund.amount_micros)} of your top-up {top_up.pk} to your card "
                         f"failed at the payment provider; {usd_text(refund.amount_micros)} is back in your balance.",
                 data={"top_up": top_up.pk, "refund": refund.pk, "failed": True,
                       "amount": str(micros_to_usd(refund.amount_micros))}, email=True)


def charge_refunded_apply(*, charge: dict[str, Any], looked: StripeLookups | None = None) -> bool:
    """Apply `charge.refunded`: each of the charge's refunds (listed in the event by API versions before 2022-11-15,
    else listed at Stripe before the event's transaction: billing.services.charges.stripe_lookups) by the one rule.
    The charge's refunded total is not read: each refund is debited or given back by its own id and status."""
    charge_id = object_id(charge, "charge")
    top_up = top_up_for(charge, "Charge", charge_id, looked)
    _accounts_locked(user_id=top_up.user_id)  # every posting below (each refund's) under one step's locks
    if refunds_listed(charge):
        refunds = charge["refunds"]["data"]
    elif looked is not None and charge_id in looked.refunds:
        refunds = looked.refunds[charge_id]
    else:  # matched to a top-up only now (its credit came meanwhile): Stripe is asked on the next delivery
        raise ValueError(f"Charge {charge_id}: its refunds were not listed, nor looked up at Stripe")
    for stripe_refund in refunds:
        if not isinstance(stripe_refund, dict):
            raise ChargeEventUnusable(f"Charge {charge_id} lists a refund that is not an object: nothing was done.")
        stripe_refund_apply(stripe_refund=stripe_refund, looked=looked, top_up=top_up)
    return True
