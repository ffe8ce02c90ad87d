"""The ledger: accounts, posting balanced transactions once, balances, reversals, manual credits.

Every movement of money is one `ledger_post`: a transaction with a unique idempotency key and entries
that sum to zero, with the cached balances of the accounts it touches updated in the same database
transaction. Accounts are locked (SELECT ... FOR UPDATE) in the order of their ids, so two postings
that touch the same accounts queue behind each other instead of deadlocking. Posting twice with the
same key returns the first transaction and changes nothing: the unique constraint decides, not a
"check, then insert".

That order holds only if nothing locked one of a transaction's accounts on its own before: a caller that
must read a balance under lock before it posts (a payout, a refund's hold) locks every account it will
post to, in one step, with `accounts_lock`, never one of them first and the others later through
ledger_post. A payout locked its provider's earnings alone and then posted to payout clearing; a failed
payout's reversal posted to both in id order (clearing first): the two deadlocked (found by review).
"""
import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from decimal import Decimal

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import F
from django.utils import timezone

from billing.models import (
    USER_ACCOUNT_KINDS,
    Account,
    AccountKind,
    Entry,
    EventKind,
    LedgerTransaction,
    TransactionKind,
)
from billing.services.notify import event_create
from core.sql import prepared_cursor
from marketplace.models import User
from marketplace.money import micros_to_usd, usd_text, usd_to_micros
from notifications.services.notify import Kind, notify


class LedgerError(Exception):
    """A posting that cannot be made; nothing was written."""


def platform_account(*, kind: str) -> Account:
    """One of the platform's own accounts (revenue, clearing, promotions), created on first use."""
    account, _ = Account.objects.get_or_create(kind=kind, user=None)
    return account


def user_account(*, user_id: int, kind: str) -> Account:
    """A user's wallet or earnings account, created on first use."""
    account, _ = Account.objects.get_or_create(kind=kind, user_id=user_id)
    return account


def wallet_balance(*, user_id: int, lock: bool = False) -> int:
    """The user's wallet balance in micro-dollars (0 before their first transaction).

    `lock`: hold the wallet's row lock (SELECT ... FOR UPDATE) until the caller's transaction ends, as every
    posting to it does (a user without a wallet row has nothing to lock, and a balance of 0).
    """
    if lock and connection.vendor == "postgresql":  # every booking and start runs it: one prepared statement
        with prepared_cursor() as cursor:
            cursor.execute(_WALLET_FOR_UPDATE_SQL, [AccountKind.CUSTOMER_WALLET.value, user_id])
            row = cursor.fetchone()
        return row[0] if row else 0
    wallet = Account.objects.filter(kind=AccountKind.CUSTOMER_WALLET, user_id=user_id)
    if lock:
        wallet = wallet.select_for_update()
    return wallet.values_list("balance_micros", flat=True).first() or 0


_WALLET_FOR_UPDATE_SQL = (f"SELECT balance_micros FROM {Account._meta.db_table} "  # noqa: S608
                          "WHERE kind = %s AND user_id = %s FOR UPDATE")  # one per kind and user


def earnings_balance(*, user_id: int) -> int:
    value = (Account.objects.filter(kind=AccountKind.PROVIDER_EARNINGS, user_id=user_id)
             .values_list("balance_micros", flat=True).first())
    return value or 0


def span_text(start: datetime, end: datetime) -> str:
    """The span a charge covers, for its memo (the statement's line): "from 2026-03-31 23:00:00 to 23:59:50 UTC",
    the end's date written when it is another day."""
    start, end = start.astimezone(UTC), end.astimezone(UTC)
    to = f"{end:%H:%M:%S}" if end.date() == start.date() else f"{end:%Y-%m-%d %H:%M:%S}"
    return f"from {start:%Y-%m-%d %H:%M:%S} to {to} UTC"


def ledger_post(
    *,
    idempotency_key: str,
    kind: str,
    lines: Sequence[tuple[Account, int]],
    memo: str = "",
    reason: str = "",
    customer_note: str = "",
    created_by: User | None = None,
    reverses: LedgerTransaction | None = None,
    at: datetime | None = None,
) -> tuple[LedgerTransaction, bool]:
    """Post a transaction once: (transaction, True), or (the earlier one, False) for a key seen before.

    `lines` are (account, amount) pairs, amounts integer micro-dollars, not zero, summing to zero. `reason` is
    the operator's (operators only); `customer_note` what the customer reads about it.
    Raises LedgerError for lines that do not balance.

    A transaction is dated now, when it is posted: a statement (renter) or the earnings (provider) of a month that
    is over never change. A charge or credit for time in an earlier month (the meters' last seconds of a month,
    an outage's catch-up, an interruption's credit) names that span in its memo instead of being dated in it
    (review r55 MEDIUM-1). `at` is for tests that build a history; no posting path passes it.
    """
    if len(lines) < 2:
        raise LedgerError("A transaction needs at least two entries.")
    for _, amount in lines:
        if type(amount) is not int or amount == 0:  # no floats, no Decimals, no bools, no zero entries
            raise LedgerError(f"Entry amounts are non-zero integers of micro-dollars, not {amount!r}.")
    if sum(amount for _, amount in lines) != 0:
        raise LedgerError(f"The entries sum to {sum(a for _, a in lines)}, not zero.")
    if not idempotency_key:
        raise LedgerError("A transaction needs an idempotency key.")
    with transaction.atomic():
        try:
            with transaction.atomic():
                txn = LedgerTransaction.objects.create(
                    idempotency_key=idempotency_key, kind=kind, memo=memo[:300], reason=reason,
                    customer_note=customer_note,
                    created_by=created_by, reverses=reverses, created_at=at or timezone.now(),
                )
        except IntegrityError:
            existing = LedgerTransaction.objects.filter(idempotency_key=idempotency_key).first()
            if existing is None:
                raise
            return existing, False
        deltas: dict[int, int] = defaultdict(int)
        for account, amount in lines:
            deltas[account.pk] += amount
        _lock_accounts(deltas)
        Entry.objects.bulk_create(Entry(transaction=txn, account=account, amount_micros=amount)
                                  for account, amount in lines)
        for account_id, delta in sorted(deltas.items()):
            if delta:
                Account.objects.filter(pk=account_id).update(balance_micros=F("balance_micros") + delta)
    return txn, True


def accounts_lock(accounts: Iterable[Account]) -> dict[int, Account]:
    """Lock the accounts' rows (SELECT ... FOR UPDATE) in one step, in id order, the order every posting takes,
    and read them again under the locks: {id: account}, balances as committed. Call inside a transaction, before
    the first of its postings to any of them (the module's docstring): every account a transaction locks is
    locked here or by ledger_post, never by a select_for_update of its own."""
    ids = sorted({account.pk for account in accounts})
    return {account.pk: account for account in
            Account.objects.select_for_update().filter(pk__in=ids).order_by("pk")}


def _lock_accounts(account_ids: Iterable[int]) -> None:
    """Row locks on the accounts, always taken in id order (no deadlocks between postings)."""
    list(Account.objects.select_for_update().filter(pk__in=list(account_ids)).order_by("pk")
         .values_list("pk", flat=True))


CREDIT_NOTE = "A credit from the platform."
REVERSAL_NOTE = "A correction: an earlier credit to your balance was taken back."
# A reversal's default wording by the way its money moves for the one who reads it (a wallet's or an earnings
# account's holder) and by what it reverses. Before, every reversal read REVERSAL_NOTE: the reversal of a usage
# charge, which gives the renter money back, said on their statement that a credit was taken back (found by review).
USAGE_GIVEN_BACK_NOTE = "A correction: a charge for GPU time was given back to your balance."
_GIVEN_BACK_TO_WALLET = {
    TransactionKind.USAGE: USAGE_GIVEN_BACK_NOTE,
    TransactionKind.STORAGE: "A correction: a storage charge was given back to your balance.",
}
WALLET_GIVEN_BACK_NOTE = "A correction: an earlier charge to your balance was given back."
_TAKEN_FROM_EARNINGS = {
    TransactionKind.USAGE: "A correction: a renter's charge for GPU time was given back to them, and your earnings "
                           "from it were taken back.",
    TransactionKind.STORAGE: "A correction: a renter's storage charge was given back to them, and your earnings "
                             "from it were taken back.",
}
EARNINGS_TAKEN_BACK_NOTE = "A correction: an earlier credit to your earnings was taken back."
EARNINGS_GIVEN_BACK_NOTE = "A correction: an earlier charge to your earnings was given back."
# Money that came in or went out through Stripe (or is held for it) has its own way back; reversing its ledger
# rows would leave Stripe's side standing and pay twice (a payout's earnings back while its transfer stands, a
# top-up's money gone from the wallet while the top-up stays refundable, a refund's debit or hold undone while the
# card keeps the money).
NOT_REVERSIBLE = {
    TransactionKind.TOP_UP: "refund the top-up instead (Top-ups: Refund), which gives it back to the card",
    TransactionKind.REFUND: "the card got the money back at Stripe; post a manual credit if the customer is owed",
    TransactionKind.REFUND_HOLD: "a refund's hold is given back by itself if the refund is not made, and goes to the "
                                 "card if it is; post a manual credit if the customer is owed",
    TransactionKind.PAYOUT: "its transfer was sent at Stripe; a payout whose transfer failed is reversed by itself",
    TransactionKind.PAYOUT_REVERSAL: "it gave back a failed payout's earnings; they go with the next payout",
    TransactionKind.CHARGEBACK: "the bank took the card payment back; a dispute won gives the debit back by itself",
}


def reversal_note(*, kind: str, account_kind: str, amount_micros: int) -> str:
    """The default wording of a reversal of a `kind` transaction for the holder of an account it moves by
    `amount_micros` (positive: money to them)."""
    if account_kind == AccountKind.PROVIDER_EARNINGS:
        return (EARNINGS_GIVEN_BACK_NOTE if amount_micros > 0
                else _TAKEN_FROM_EARNINGS.get(TransactionKind(kind), EARNINGS_TAKEN_BACK_NOTE))
    if amount_micros > 0:
        return _GIVEN_BACK_TO_WALLET.get(TransactionKind(kind), WALLET_GIVEN_BACK_NOTE)
    return REVERSAL_NOTE


def _moved(lines: Sequence[tuple[Account, int]]) -> list[tuple[Account, int]]:
    """What the lines move on each user's account (wallet, earnings), in the order first met; platform accounts
    (no user) and accounts the lines leave as they were are left out."""
    accounts: dict[int, Account] = {}
    totals: dict[int, int] = defaultdict(int)
    for account, amount in lines:
        if account.user_id is not None and account.kind in USER_ACCOUNT_KINDS:
            accounts.setdefault(account.pk, account)
            totals[account.pk] += amount
    return [(accounts[pk], totals[pk]) for pk in accounts if totals[pk]]


def ledger_reverse(*, txn: LedgerTransaction, reason: str, created_by: User | None = None,
                   idempotency_key: str | None = None, customer_note: str = "") -> tuple[LedgerTransaction, bool]:
    """Undo a transaction with one that posts the opposite entries. A transaction is reversed at most once.

    `reason` is the operator's, kept for operators; `customer_note` is what the customers read. Not given, each
    reads the default for the way the money moves for them (reversal_note): the note kept with the reversal, read
    on statements, is the customer wallet's (else the first user account's). Every user whose wallet or earnings
    the reversal moves is told (a billing event and a notification), the platform's accounts are no one's.
    """
    if txn.reverses_id is not None:
        raise LedgerError("A reversal cannot itself be reversed; post a new transaction instead.")
    if txn.kind in NOT_REVERSIBLE:
        raise LedgerError(f"A {txn.get_kind_display().lower()} transaction is not reversed here: "
                          f"{NOT_REVERSIBLE[TransactionKind(txn.kind)]}.")
    existing = LedgerTransaction.objects.filter(reverses=txn).first()
    if existing is not None:
        return existing, False
    lines = [(entry.account, -entry.amount_micros) for entry in txn.entries.select_related("account")]
    moved = _moved(lines)
    custom = customer_note.strip()
    notes = {account.pk: custom or reversal_note(kind=txn.kind, account_kind=account.kind, amount_micros=amount)
             for account, amount in moved}
    wallets = [account.pk for account, _ in moved if account.kind == AccountKind.CUSTOMER_WALLET]
    shown = wallets[0] if wallets else (moved[0][0].pk if moved else None)
    note = custom or (notes[shown] if shown is not None else REVERSAL_NOTE)
    try:
        with transaction.atomic():
            reversal, created = ledger_post(
                idempotency_key=idempotency_key or f"reversal:{txn.pk}", kind=TransactionKind.REVERSAL,
                lines=lines, memo=f"Reverses #{txn.pk}: {txn.memo}", reason=reason, customer_note=note,
                created_by=created_by, reverses=txn,
            )
            if created:
                _reversal_tell(txn=txn, reversal=reversal, moved=moved, notes=notes)
            return reversal, created
    except IntegrityError:  # reversed meanwhile under another key
        existing = LedgerTransaction.objects.filter(reverses=txn).first()
        if existing is None:
            raise
        return existing, False


def _reversal_tell(*, txn: LedgerTransaction, reversal: LedgerTransaction, moved: Sequence[tuple[Account, int]],
                   notes: dict[int, str]) -> None:
    """Tell each user whose wallet or earnings the reversal moves (in the reversal's transaction), as a credit and
    its reversal are told: a billing event, and a notification that is e-mailed by the user's preference for it.
    Money to them reads as a credit (credit_posted), money from them as a credit reversed. Before, only a reversed
    credit's customer was told, while the form promised a notice to all (found by review)."""
    on = f"{txn.created_at:%Y-%m-%d}"
    for account, amount in moved:
        assert account.user_id is not None  # _moved keeps users' accounts only
        user = User.objects.get(pk=account.user_id)
        earnings = account.kind == AccountKind.PROVIDER_EARNINGS
        data = {"amount": str(micros_to_usd(abs(amount))), "transaction": reversal.pk, "reverses": txn.pk,
                "account": account.kind}
        # Its own title: the kinds' ("0.500000 USD was credited to your balance") named the balance for earnings
        # too, with the payload's exact amount; the title reads in cents, as the message (found by review).
        if amount < 0:
            what = "added to your earnings" if earnings else "credited to your balance"
            message = f"{usd_text(-amount)} {what} on {on} was reversed: {notes[account.pk]}"
            title = (f"{usd_text(-amount)} taken from your earnings" if earnings
                     else f"A credit of {usd_text(-amount)} to your balance was reversed")
            event_kind, kind = EventKind.CREDIT_REVERSED, Kind.CREDIT_REVERSED
            # A wallet's keeps the key it had (one notice per reversal, as before).
            key = f"credit_reversed:{reversal.pk}" if not earnings else f"reversal:{reversal.pk}:{account.pk}"
        else:
            what = "taken from your earnings" if earnings else "charged to your balance"
            message = f"{usd_text(amount)} {what} on {on} was given back: {notes[account.pk]}"
            title = f"{usd_text(amount)} given back to your {'earnings' if earnings else 'balance'}"
            event_kind, kind = EventKind.CREDIT, Kind.CREDIT_POSTED
            key = f"reversal:{reversal.pk}:{account.pk}"
        event_create(user=user, kind=event_kind, message=message, data=data)
        title = title[:1].upper() + title[1:]  # "Less than $0.01 given back ..."
        notify(user=user, kind=kind, payload={**data, "message": message}, dedupe_key=key, title=title)


def credit_grant(*, user: User, amount_micros: int, reason: str, created_by: User | None = None,
                 idempotency_key: str | None = None, memo: str = "",
                 customer_note: str = "") -> tuple[LedgerTransaction, bool]:
    """Credit a customer's wallet from the platform's promotions account (an operator's credit, the demo's).

    `created_by` is the operator; `reason` (theirs, for operators only) is kept with the transaction;
    `customer_note` is what the customer reads (CREDIT_NOTE when not given). Idempotent on `idempotency_key`
    (a fresh one per call when not given).
    """
    if type(amount_micros) is not int or amount_micros <= 0:
        raise LedgerError("A credit is a positive amount.")
    if not reason.strip():
        raise LedgerError("Give a reason for the credit.")
    note = customer_note.strip() or CREDIT_NOTE
    with transaction.atomic():
        txn, created = ledger_post(
            idempotency_key=idempotency_key or f"credit:{uuid.uuid4()}", kind=TransactionKind.CREDIT,
            lines=[(user_account(user_id=user.pk, kind=AccountKind.CUSTOMER_WALLET), amount_micros),
                   (platform_account(kind=AccountKind.PROMOTIONS), -amount_micros)],
            memo=memo or f"Credit of {usd_text(amount_micros)}", reason=reason, customer_note=note,
            created_by=created_by,
        )
        if created:
            message = f"{usd_text(amount_micros)} was credited to your balance: {note}"
            data = {"amount": str(micros_to_usd(amount_micros)), "transaction": txn.pk}
            event_create(user=user, kind=EventKind.CREDIT, message=message, data=data)
            notify(user=user, kind=Kind.CREDIT_POSTED, payload={**data, "message": message},
                   dedupe_key=f"credit:{txn.pk}")
    return txn, created


def funds_required_micros(*, price_per_hour_micros: int) -> int:
    """The balance renting at this hourly price needs (BILLING_FUNDS_REQUIRED_S of it, rounded up)."""
    return -(-price_per_hour_micros * settings.BILLING_FUNDS_REQUIRED_S // 3600)


def demo_credit_grant(*, user: User) -> tuple[LedgerTransaction, bool]:
    """The demo customer's starting credit (BILLING_DEMO_CREDIT_USD): an ordinary credit, posted once per user."""
    return credit_grant(user=user, amount_micros=usd_to_micros(Decimal(settings.BILLING_DEMO_CREDIT_USD)),
                        reason="Demo starting credit", idempotency_key=f"demo-credit:{user.pk}",
                        memo="Demo starting credit", customer_note="Demo starting credit.")
