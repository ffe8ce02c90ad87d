"""Weekly payouts of providers' earnings through Stripe Connect transfers.

For each period (a week, Monday to Sunday, UTC) a provider with a Connect account and at least
BILLING_PAYOUT_MINIMUM_USD of earnings gets one payout: the unique constraint on (provider, period
start) and the ledger key `payout:<provider>:<period start>` make a second run for the same week a
no-op. The amount is the earnings balance as of the end of the period (its Sunday, UTC; payout_amount_micros):
that week's earnings and earlier unpaid ones, never more than the balance at run time, in whole cents; earnings
credited after the period (Monday morning, before the run) wait for the next payout. It is moved from the
provider's earnings to payout clearing *before* the transfer is sent (in one database transaction), so it cannot
be paid twice; then the transfer is sent outside any transaction, by one sender at a time. If Stripe refuses it, the
payout fails and a reversal gives the earnings back; if Stripe's answer is lost (no answer, a 5xx, an idempotency
conflict), the payout stays pending, and the next try (the per-minute follow-up, billing.tasks.top_ups_reconcile,
after BILLING_TOP_UP_RECONCILE_AFTER_S) first looks for the transfer by its transfer group, so that a transfer
that was made is recorded rather than made again.

A deactivated provider is not paid (account_status.account_deactivate: the operators' lever for an account taken
over or a fraud; before, the weekly run sent the whole earnings balance to the Connect account on file, perhaps the
thief's: found by review). The run makes no payout for them, their earnings staying in the balance; a payout made
before the deactivation stays pending, its earnings reserved, and is not sent (payout_send records why, HELD_INACTIVE,
for the operators on its admin page, marked by the per-minute follow-up; not counted as waiting on Stripe) until
the account is reactivated; then the follow-up sends it within minutes, and the next weekly run pays what has accrued.
"""
import logging
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

import stripe
from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.db.models import F, Sum
from django.utils import timezone

from billing.models import (
    Account,
    AccountKind,
    BillingProfile,
    Entry,
    EventKind,
    Payout,
    PayoutStatus,
    TransactionKind,
)
from billing.services.ledger import accounts_lock, ledger_post, platform_account, user_account
from billing.services.notify import event_create
from billing.services.stripe_gateway import MICROS_PER_CENT, cents, client, is_definite, translate
from core.locks import advisory_lock
from marketplace.models import User
from marketplace.money import micros_to_usd, usd_text, usd_to_micros
from notifications.services.notify import Kind, notify

log = logging.getLogger(__name__)

PAYOUT_FOLLOW_UP_BATCH = 100  # pending payouts taken up per follow-up run at most
# A pending payout of a deactivated provider: why it is not sent (its failure_message, shown to operators).
HELD_INACTIVE = ("Held, not sent: the provider's account is deactivated. Its earnings stay reserved for it, and it is "
                 "sent once the account is reactivated.")


def payout_period(today: date) -> tuple[date, date]:
    """The last full week before `today`: (its Monday, its Sunday)."""
    this_monday = today - timedelta(days=today.weekday())
    return this_monday - timedelta(days=7), this_monday - timedelta(days=1)


def payout_minimum_micros() -> int:
    return usd_to_micros(Decimal(settings.BILLING_PAYOUT_MINIMUM_USD))


def period_cutoff(period_end: date) -> datetime:
    """The end of the period's last day, UTC: the first moment whose ledger lines are not in its payout."""
    return datetime.combine(period_end + timedelta(days=1), time.min, tzinfo=UTC)


def payout_amount_micros(*, earnings: Account, period_end: date) -> int:
    """What a payout for the period ending `period_end` pays: the earnings balance as of the end of that day (UTC),
    i.e. the balance now less the net of the account's ledger lines posted since, never more than the balance now
    (earnings taken back since are not paid), rounded down to whole cents. Zero or less: nothing to pay.

    Before, the balance at run time was paid: earnings credited on Monday morning before the weekly run went with
    the week before's payout, whose memo and period said otherwise (found by review). `earnings` is read under its
    lock (accounts_lock): no posting to it commits between that read and this one.
    """
    since = (Entry.objects.filter(account=earnings, transaction__created_at__gte=period_cutoff(period_end))
             .aggregate(net=Sum("amount_micros"))["net"] or 0)
    amount = min(earnings.balance_micros - since, earnings.balance_micros)
    if amount <= 0:
        return 0
    return amount - amount % MICROS_PER_CENT


def payout_create(*, provider_id: int, period_start: date, period_end: date) -> Payout | None:
    """Reserve the provider's earnings up to the end of `period_end` (payout_amount_micros) for this period's
    payout; the existing payout if there is one.

    None when they have no Connect account, their account is deactivated, or they have less than the minimum to
    pay (a balance below zero: nothing).
    """
    destination = (BillingProfile.objects.filter(user_id=provider_id)
                   .values_list("stripe_connect_account_id", flat=True).first())
    existing = Payout.objects.filter(provider_id=provider_id, period_start=period_start).first()
    if existing is not None:
        return existing
    if not destination:
        return None
    with transaction.atomic():
        # Read under the account row's key-share lock, before the ledger's locks: a deactivation under way (FOR
        # UPDATE) is waited for, and one committed before is seen (as an auto top-up reads it: top_ups).
        if not _provider_active(provider_id):
            return None
        # Both accounts of the posting, locked in one step in id order (ledger.accounts_lock) before the balance is
        # read: the earnings locked on their own first, then payout clearing by ledger_post, against a failed
        # payout's reversal (_payout_failed: clearing, then earnings, by id) deadlocked, and PostgreSQL aborted one.
        earnings = user_account(user_id=provider_id, kind=AccountKind.PROVIDER_EARNINGS)
        clearing = platform_account(kind=AccountKind.PAYOUT_CLEARING)
        earnings = accounts_lock([earnings, clearing])[earnings.pk]
        amount = payout_amount_micros(earnings=earnings, period_end=period_end)
        if amount < max(payout_minimum_micros(), MICROS_PER_CENT):
            return None
        txn, created = ledger_post(
            idempotency_key=f"payout:{provider_id}:{period_start.isoformat()}", kind=TransactionKind.PAYOUT,
            lines=[(earnings, -amount), (clearing, amount)],
            memo=f"Payout of earnings to {period_end.isoformat()}",
        )
        if not created:
            return Payout.objects.get(transaction=txn)
        # Dated at its ledger transaction (what the earnings by month count it by), not by a second clock read.
        return Payout.objects.create(provider_id=provider_id, period_start=period_start, period_end=period_end,
                                     amount_micros=amount, destination=destination, transaction=txn,
                                     created_at=txn.created_at)


def payout_send(*, payout: Payout) -> Payout:
    """Send a pending payout's transfer (outside any transaction) and record the answer.

    One sender at a time per payout (an advisory lock: the weekly run and an operator's "send again" may overlap;
    the second does nothing). A payout tried before whose answer was lost is first looked up at Stripe by its
    transfer group: a transfer made then is recorded, not made again (Stripe forgets an Idempotency-Key after a
    day, and the retry may come a week later).

    A deactivated provider's payout is held: left pending, its earnings reserved, nothing sent, HELD_INACTIVE
    recorded as its failure_message (a transfer an earlier try made is still recorded: that money went already).
    A deactivation that commits after this check is as one a moment after the transfer.
    """
    if payout.status != PayoutStatus.PENDING:
        return payout
    with advisory_lock(f"billing.payout_send:{payout.pk}") as acquired:
        if not acquired:
            log.info("payout %s: another process is sending it", payout.pk)
            return payout
        payout.refresh_from_db()
        if payout.status != PayoutStatus.PENDING:
            return payout
        Payout.objects.filter(pk=payout.pk).update(last_tried_at=timezone.now())
        try:
            transfer = _transfer_made(payout) if payout.attempts else None
        except stripe.StripeError as exc:
            # Whether the earlier try made its transfer is not known, whatever the error: failed on it (its earnings
            # given back), a payout Stripe had made was paid again with the next one (found by review). It stays
            # pending, its earnings reserved, until a lookup answers.
            message = translate(exc, "looking up the transfer an earlier try may have made").message
            Payout.objects.filter(pk=payout.pk).update(failure_message=message[:500])
            log.warning("payout %s: %s", payout.pk, message)
            payout.refresh_from_db()
            return payout
        if transfer is None and not _provider_active(payout.provider_id):
            Payout.objects.filter(pk=payout.pk).update(failure_message=HELD_INACTIVE)
            log.warning("payout %s of provider %s: %s", payout.pk, payout.provider_id, HELD_INACTIVE)
            payout.refresh_from_db()
            return payout
        try:
            if transfer is None:
                Payout.objects.filter(pk=payout.pk).update(attempts=F("attempts") + 1)
                transfer = client(connect=True).v1.transfers.create(
                    params={"amount": cents(payout.amount_micros), "currency": "usd",
                            "destination": payout.destination, "transfer_group": f"payout-{payout.pk}",
                            "metadata": {"payout_id": str(payout.pk), "provider_id": str(payout.provider_id)}},
                    options={"idempotency_key": f"payout-{payout.pk}"},
                )
        except stripe.StripeError as exc:
            message = translate(exc, "sending the transfer").message
            if not is_definite(exc):  # unknown outcome: stays pending; the next try looks it up first
                Payout.objects.filter(pk=payout.pk).update(failure_message=message[:500])
                log.warning("payout %s: %s", payout.pk, message)
            else:
                _payout_failed(payout.pk, message)
            payout.refresh_from_db()
            return payout
        return _payout_paid(payout.pk, transfer)


def _provider_active(provider_id: int) -> bool:
    """Whether the provider's account is active, read under a key-share lock on its row inside a transaction (as
    top_ups._account_active): a deactivation under way (FOR UPDATE) is waited for and what it committed is read."""
    if connection.vendor != "postgresql" or not connection.in_atomic_block:  # SQLite: no FOR KEY SHARE
        return bool(User.objects.filter(pk=provider_id).values_list("is_active", flat=True).first())
    with connection.cursor() as cursor:  # a locked row is read as last committed, after any wait (READ COMMITTED)
        cursor.execute(f"SELECT is_active FROM {User._meta.db_table} WHERE id = %s FOR KEY SHARE",  # noqa: S608
                       [provider_id])
        row = cursor.fetchone()
    return bool(row and row[0])


def _transfer_made(payout: Payout) -> Any:
    """The transfer an earlier try made for this payout (its transfer group and metadata), or None."""
    page = client(connect=True).v1.transfers.list(params={"transfer_group": f"payout-{payout.pk}", "limit": 10})
    return next((t for t in page.auto_paging_iter() if _made_for(t, payout) and not t.reversed), None)


def _made_for(transfer: Any, payout: Payout) -> bool:
    return (transfer.to_dict().get("metadata") or {}).get("payout_id") == str(payout.pk)


def _payout_paid(payout_id: int, transfer: Any) -> Payout:
    with transaction.atomic():
        payout = Payout.objects.select_for_update().get(pk=payout_id)
        if payout.can_transition_to(PayoutStatus.PAID):
            payout.transition_to(PayoutStatus.PAID)
            payout.transfer_id = transfer.id
            payout.paid_at = timezone.now()
            payout.failure_message = ""
            payout.save(update_fields=["status", "transfer_id", "paid_at", "failure_message"])
            message = (f"{usd_text(payout.amount_micros)} of your earnings was sent to your Stripe account "
                       f"({transfer.id}).")
            event_create(user=payout.provider, kind=EventKind.PAYOUT_PAID, message=message,
                         data={"payout": payout.pk, "transfer": transfer.id})
            notify(user=payout.provider, kind=Kind.PAYOUT_SENT, dedupe_key=f"payout_sent:{payout.pk}", payload={
                "payout": payout.pk, "transfer": transfer.id, "amount": str(micros_to_usd(payout.amount_micros)),
                "message": message})
        elif payout.transfer_id != transfer.id:
            log.error("payout %s is %s, but Stripe made transfer %s for it: for an operator", payout.pk,
                      payout.status, transfer.id)
    return payout


def _payout_failed(payout_id: int, message: str) -> None:
    with transaction.atomic():
        payout = Payout.objects.select_for_update().get(pk=payout_id)
        if not payout.can_transition_to(PayoutStatus.FAILED):
            return
        reversal, _ = ledger_post(
            idempotency_key=f"payout-reversal:{payout.pk}", kind=TransactionKind.PAYOUT_REVERSAL,
            lines=[(user_account(user_id=payout.provider_id, kind=AccountKind.PROVIDER_EARNINGS), payout.amount_micros),
                   (platform_account(kind=AccountKind.PAYOUT_CLEARING), -payout.amount_micros)],
            memo=f"Payout {payout.pk} failed: earnings given back", reverses=payout.transaction,
        )
        payout.transition_to(PayoutStatus.FAILED)
        payout.failure_message = message[:500]
        payout.reversal = reversal
        payout.save(update_fields=["status", "failure_message", "reversal"])
        event_create(user=payout.provider, kind=EventKind.PAYOUT_FAILED, email=True,
                     message=f"Your payout of {usd_text(payout.amount_micros)} failed: {message} "
                             "The amount is back in your earnings and goes with the next payout; check your "
                             "Stripe account id.",
                     data={"payout": payout.pk})


def payouts_pending_elsewhere(*, user_id: int, account: str) -> list[Payout]:
    """The user's pending payouts made out to another Connect account than `account` (their current one, "" for
    none), oldest first. A payout keeps the account it was made out to when the provider changes or removes theirs:
    its transfer may already be made or under way (Stripe has not confirmed it), and its next try (same transfer
    group, same Idempotency-Key) must find that transfer, not pay a second account."""
    return list(Payout.objects.filter(provider_id=user_id, status=PayoutStatus.PENDING)
                .exclude(destination=account).order_by("period_start", "pk"))


def payouts_pending_elsewhere_text(payouts: list[Payout]) -> str:
    """What the provider is told of payouts_pending_elsewhere when they change or remove their account: each
    payout, its amount and the account it still goes to, and why; "" for none."""
    if not payouts:
        return ""
    each = [f"{usd_text(p.amount_micros)} (week {p.period_start:%Y-%m-%d} to {p.period_end:%Y-%m-%d}) to "
            f"{p.destination}" for p in payouts]
    if len(payouts) == 1:
        return (f"A payout of {each[0]} is still being sent there, to the account it was made out to. Its transfer "
                "may already be made or under way (Stripe has not confirmed it), so it is only ever sent to that "
                "account: sending it to another could pay it twice.")
    return (f"Payouts still being sent go to the account each was made out to: {'; '.join(each)}. Their transfers "
            "may already be made or under way (Stripe has not confirmed them), so each is only ever sent to its "
            "account: sending one to another could pay it twice.")


def payouts_send_pending(*, now: datetime | None = None) -> int:
    """Send again the payouts still pending after BILLING_TOP_UP_RECONCILE_AFTER_S (a lost answer, a crash between
    reserving and sending): minutes later, not next week. Each looks its transfer up first (payout_send). At most
    PAYOUT_FOLLOW_UP_BATCH a run, the least recently tried first: payouts whose lookup Stripe keeps refusing went
    first every run and hid the others for good (each tried again only a run later than the rest). A deactivated
    provider's are passed over (held: payout_send), so that they neither go out nor take the batch's places, and
    marked held (HELD_INACTIVE) for the operators within a minute of the deactivation; once the account is
    reactivated, they are sent here."""
    held = (Payout.objects.filter(status=PayoutStatus.PENDING, provider__is_active=False)
            .exclude(failure_message=HELD_INACTIVE).update(failure_message=HELD_INACTIVE))
    if held:
        log.warning("payouts: %d pending payout(s) of deactivated providers held, not sent", held)
    cutoff = (now or timezone.now()) - timedelta(seconds=settings.BILLING_TOP_UP_RECONCILE_AFTER_S)
    pending = list(Payout.objects.filter(status=PayoutStatus.PENDING, created_at__lt=cutoff,
                                         provider__is_active=True)
                   .order_by(F("last_tried_at").asc(nulls_first=True), "pk")[:PAYOUT_FOLLOW_UP_BATCH])
    for payout in pending:
        _send_going_on(payout, "the follow-up")
    return len(pending)


def _send_going_on(payout: Payout, run: str) -> bool:
    """payout_send, its database error (a deadlock, a lock timeout) logged and not raised, so that a run of many
    goes on with the others: False then, the payout left pending for the next follow-up."""
    try:
        payout_send(payout=payout)
    except DatabaseError:
        log.exception("%s: payout %s of provider %s was not sent (a database error); it stays pending, the run goes "
                      "on", run, payout.pk, payout.provider_id)
        return False
    return True


def payouts_run(*, today: date | None = None) -> list[Payout]:
    """Pay every provider due for last week's period who has no payout for it yet, and retry payouts left pending.

    Run every day (beat, 03:00 UTC): a payout is made once per (provider, period), so Monday's run pays the week and
    the other days' pay only a week a run missed (beat down or recreated without its schedule file over Monday 03:00:
    the week went unpaid, its earnings paid a week late with the next; found by review), or a provider who became
    payable since (a Connect account added, an account reactivated), for the same period and amount.

    One provider's database error (a deadlock, a lock or statement timeout, a constraint) is logged and counted,
    and the run goes on with the others: it escaped, and every provider after that one went unpaid that week. Its
    payout_create runs in a savepoint, so the error undoes that provider's reservation only; their earnings stay
    and go with the next run (the same period's once it is run again: payout_create is idempotent per period).

    A deactivated provider gets no payout (their earnings wait for a run after reactivation); their payouts still
    pending are held, each marked so (payout_send, HELD_INACTIVE).
    """
    today = today or timezone.now().date()
    start, end = payout_period(today)
    due = list(Account.objects.filter(kind=AccountKind.PROVIDER_EARNINGS,
                                      balance_micros__gte=payout_minimum_micros(),
                                      user__billing_profile__stripe_connect_account_id__gt="",
                                      user__is_active=True)
               .order_by("user_id").values_list("user_id", flat=True))
    payouts, failed = [], 0
    for provider_id in due:
        try:
            with transaction.atomic():
                payout = payout_create(provider_id=provider_id, period_start=start, period_end=end)
        except DatabaseError:
            failed += 1
            log.exception("payouts %s: provider %s's payout was not made (a database error); the run goes on",
                          start.isoformat(), provider_id)
            continue
        if payout is not None:
            payouts.append(payout)
    for payout in Payout.objects.filter(status=PayoutStatus.PENDING).select_related("provider").order_by("pk"):
        if not _send_going_on(payout, f"payouts {start.isoformat()}"):
            failed += 1
    if failed:
        log.error("payouts %s: %d of the run's payouts failed with a database error (above); the others went on",
                  start.isoformat(), failed)
    return list(Payout.objects.filter(pk__in=[p.pk for p in payouts]).order_by("pk"))
