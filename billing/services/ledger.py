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
from datetime import datetime
from decimal import Decimal

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import F
from django.utils import timezone

from billing.models import (
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
REVERSIBLE_CREDITS = (TransactionKind.CREDIT, TransactionKind.SERVICE_CREDIT)
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


def ledger_reverse(*, txn: LedgerTransaction, reason: str, created_by: User | None = None,
                   idempotency_key: str | None = None, customer_note: str = "") -> tuple[LedgerTransaction, bool]:
    """Undo a transaction with one that posts the opposite entries. A transaction is reversed at most once.

    `reason` is the operator's, kept for operators; `customer_note` is what the customer reads (REVERSAL_NOTE
    when not given). The reversal of a credit tells the customer (a billing event and a notification).
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
    note = customer_note.strip() or REVERSAL_NOTE
    try:
        with transaction.atomic():
            reversal, created = ledger_post(
                idempotency_key=idempotency_key or f"reversal:{txn.pk}", kind=TransactionKind.REVERSAL,
                lines=lines, memo=f"Reverses #{txn.pk}: {txn.memo}", reason=reason, customer_note=note,
                created_by=created_by, reverses=txn,
            )
            if created and txn.kind in REVERSIBLE_CREDITS:
                _credit_reversed_tell(txn=txn, reversal=reversal, lines=lines, note=note)
            return reversal, created
    except IntegrityError:  # reversed meanwhile under another key
        existing = LedgerTransaction.objects.filter(reverses=txn).first()
        if existing is None:
            raise
        return existing, False


def _credit_reversed_tell(*, txn: LedgerTransaction, reversal: LedgerTransaction,
                          lines: Sequence[tuple[Account, int]], note: str) -> None:
    """Tell each customer whose wallet the reversal debits (in the reversal's transaction)."""
    for account, amount in lines:
        if account.kind != AccountKind.CUSTOMER_WALLET or account.user_id is None or amount >= 0:
            continue
        user = User.objects.get(pk=account.user_id)
        message = f"{usd_text(-amount)} credited to your balance on {txn.created_at:%Y-%m-%d} was reversed: {note}"
        data = {"amount": str(micros_to_usd(-amount)), "transaction": reversal.pk, "reverses": txn.pk}
        event_create(user=user, kind=EventKind.CREDIT_REVERSED, message=message, data=data)
        notify(user=user, kind=Kind.CREDIT_REVERSED, payload={**data, "message": message},
               dedupe_key=f"credit_reversed:{reversal.pk}")


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
