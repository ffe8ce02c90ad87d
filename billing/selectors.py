"""Reads with rules: whose usage a user sees, monthly statements, provider earnings.

Statements and earnings are built from ledger entries grouped by the month (UTC) in which they were
posted, so that each month's opening balance plus its movements is its closing balance, exactly.
"""
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import (
    BigIntegerField,
    CharField,
    Count,
    Exists,
    F,
    Func,
    Max,
    Min,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    Sum,
    Value,
)
from django.db.models.functions import Cast, Coalesce, Concat, StrIndex, Substr, Trunc, TruncMonth
from django.db.models.query import ModelIterable
from django.utils import timezone

from billing.models import (
    Account,
    AccountKind,
    BillingEvent,
    BillingProfile,
    Card,
    EarningsRollup,
    Entry,
    LedgerTransaction,
    Payout,
    PayoutStatus,
    Refund,
    RefundStatus,
    RevenueSlot,
    TopUp,
    TopUpStatus,
    TransactionKind,
    UsageInterval,
)
from billing.pricing import NODE_BILLING_FIELDS, instance_cost_so_far
from marketplace.models import Instance, InstanceStatus, User, Volume, VolumeState
from marketplace.models.host import SECONDS_PER_MONTH


def _given_back(kind: str) -> Coalesce:
    """What the reversal of an interval's charge (an operator's, or usage given back after a VM was found lost:
    billing.services.metering.usage_give_back; at most one per charge) moved on the account of `kind` (signed as
    posted; 0 when the charge was not reversed)."""
    moved = (Entry.objects.filter(transaction__reverses_id=OuterRef("transaction_id"), account__kind=kind)
             .order_by().values("transaction__reverses_id").annotate(total=Sum("amount_micros")).values("total"))
    return Coalesce(Subquery(moved, output_field=BigIntegerField()), Value(0), output_field=BigIntegerField())


if TYPE_CHECKING:
    _IntervalIterable = ModelIterable[UsageInterval]  # generic in django-stubs only
else:
    _IntervalIterable = ModelIterable


class _UsageNetIterable(_IntervalIterable):
    """The intervals as ModelIterable makes them, each given its nets from the two give-back columns (usage_net)."""

    def __iter__(self) -> Iterator[UsageInterval]:
        for interval in super().__iter__():
            back, fee_back = interval.given_back_micros, interval.fee_given_back_micros  # type: ignore[attr-defined]
            interval.net_amount_micros = interval.amount_micros - back  # type: ignore[attr-defined]
            interval.net_fee_micros = interval.fee_micros - fee_back  # type: ignore[attr-defined]
            interval.net_provider_micros = (  # type: ignore[attr-defined]
                interval.amount_micros - back - interval.fee_micros + fee_back)
            yield interval


def usage_net(intervals: QuerySet[UsageInterval]) -> QuerySet[UsageInterval]:
    """Usage intervals with what the ledger says of them now, reversals included (integer micro-dollars):
    `given_back_micros` (back to the renter's wallet since), `fee_given_back_micros` (of it, taken back from the
    platform's fee), and their net: `net_amount_micros` (what the renter paid), `net_fee_micros`,
    `net_provider_micros` (what the provider earned). An interval's own amount_micros and fee_micros stay what was
    charged (the meter's cumulative arithmetic reads them); every reader of what was paid or earned reads these.
    Before, the usage API and page showed what was charged: a charge given back (or reversed by an operator) still
    read as paid there, while the statement and the balance counted it back (found by review).

    The two give-backs are the query's columns, each correlated subquery written once; the nets are worked out
    from them as the rows are read (not SQL: a net annotated on top of them repeated its subquery in the SELECT,
    and PostgreSQL ran each copy, six reversal lookups per row instead of two). Sums over the rows: usage_totals."""
    netted = intervals.annotate(
        given_back_micros=_given_back(AccountKind.CUSTOMER_WALLET),
        fee_given_back_micros=-_given_back(AccountKind.PLATFORM_REVENUE),
    )
    netted._iterable_class = _UsageNetIterable  # kept by filter(), slicing, select_related(), as Django clones it
    return netted


def usage_totals(intervals: QuerySet[UsageInterval]) -> dict[str, int | None]:
    """Sums over usage_net's intervals, in one query: `amount` (what was paid: charged less given back), `given_back`,
    `seconds`, `count` (None for the sums of no rows, as Sum says). The wallet's give-back subquery is the only one
    in the SQL (values() leaves the fee's out), run once per row; what was paid is worked out from the sums.
    `seconds` are those paid for: less the instances' given_back_seconds (a second query, only when any were
    billed), so `intervals` must hold each of its instances' intervals whole (the usage page: all, or one
    instance's); before, it counted the seconds given back ("$0.05 for 2 min 09 s", paid for 60 s)."""
    totals = intervals.values("given_back_micros").aggregate(  # type: ignore[misc]  # an annotation, unseen by the stubs
        charged=Sum("amount_micros"), given_back=Sum("given_back_micros"), seconds=Sum("seconds"), count=Count("id"))
    charged = totals.pop("charged")
    totals["amount"] = None if charged is None else charged - totals["given_back"]
    if totals["seconds"]:  # the seconds paid for: less those given back of the instances listed (whole instances)
        totals["seconds"] -= Instance.objects.filter(
            pk__in=intervals.values("instance_id"), given_back_seconds__gt=0).aggregate(
            back=Coalesce(Sum("given_back_seconds"), 0))["back"]
    return totals


def usage_for_user(*, user: User) -> QuerySet[UsageInterval]:
    """The user's usage intervals, with what was paid for each net of what was given back since (usage_net)."""
    return usage_net(UsageInterval.objects.filter(instance__renter=user).select_related("instance"))


def usage_given_back_micros(*, instance_ids: Collection[int]) -> dict[int, int]:
    """Instance id -> what was given back to its renter of its GPU time's charges (reversals of them), for those
    with any: one query for a page of instances."""
    rows = (Entry.objects.filter(account__kind=AccountKind.CUSTOMER_WALLET,
                                 transaction__reverses__usage_interval__instance_id__in=list(instance_ids))
            .values("transaction__reverses__usage_interval__instance_id").annotate(total=Sum("amount_micros"))
            .order_by())
    return {row["transaction__reverses__usage_interval__instance_id"]: row["total"] for row in rows
            if row["total"]}


def usage_given_back(instance: OuterRef) -> Coalesce:
    """Correlated: what was given back to the renter of the instance's GPU time's charges (the reversals of its
    usage intervals' ledger transactions; 0 when none). usage_given_back_micros says the same for a set of ids."""
    moved = (Entry.objects.filter(account__kind=AccountKind.CUSTOMER_WALLET,
                                  transaction__reverses__usage_interval__instance_id=instance)
             .order_by().values(total=Func(F("amount_micros"), function="SUM")))
    return Coalesce(Subquery(moved, output_field=BigIntegerField()), Value(0), output_field=BigIntegerField())


# The ledger keys billing.services.storage.storage_key gives storage charges: storage:<volume|disk>:<id>:<start µs>.
_STORAGE_KEY_OF = {"volume": "storage:volume:", "disk": "storage:disk:"}


def storage_given_back(what: str, *, object_id: OuterRef, owner_id: OuterRef) -> Coalesce:
    """Correlated: what was given back to the owner of a volume (`what` "volume") or of a stopped instance's disk
    ("disk") of its storage charges, by their reversals (an operator's; 0 when none). Storage charges name what they
    bill by their ledger key only (billing.services.storage.storage_key: storage:<what>:<id>:<start µs>), so they
    are found by its prefix, the trailing ':' keeping id 1 from matching 12. The volume's cost_micros and the
    instance's disk_cost_micros stay what was charged (the meter's cumulative arithmetic reads them)."""
    prefix = Concat(Value(_STORAGE_KEY_OF[what]), Cast(object_id, CharField()), Value(":"))
    moved = (Entry.objects.filter(account__kind=AccountKind.CUSTOMER_WALLET, account__user_id=owner_id,
                                  transaction__reverses__kind=TransactionKind.STORAGE,
                                  transaction__reverses__idempotency_key__startswith=prefix)
             .order_by().values(total=Func(F("amount_micros"), function="SUM")))
    return Coalesce(Subquery(moved, output_field=BigIntegerField()), Value(0), output_field=BigIntegerField())


def top_ups_for_user(*, user: User) -> QuerySet[TopUp]:
    return TopUp.objects.filter(user=user)


def cards_for_user(*, user: User) -> QuerySet[Card]:
    return Card.objects.filter(user=user)


def events_for_user(*, user: User) -> QuerySet[BillingEvent]:
    return BillingEvent.objects.filter(user=user)


def payouts_for_user(*, user: User) -> QuerySet[Payout]:
    return Payout.objects.filter(provider=user)


def payout_account(*, user: User) -> str:
    """The provider's Stripe Connect account id ("" when none is set)."""
    return BillingProfile.objects.filter(user=user).values_list("stripe_connect_account_id", flat=True).first() or ""


def burn_rate_micros(*, user: User) -> int:
    """What the user's running instances cost per hour now (GPU time only: burn_rate adds storage)."""
    return Instance.objects.filter(renter=user, status=InstanceStatus.RUNNING).aggregate(
        rate=Sum("price_per_hour_micros"))["rate"] or 0


def storage_burn_per_hour(*, renter_id: int | None = None) -> dict[int, int]:
    """Renter -> micro-dollars per hour of their available volumes (at their size) and stopped instances' disks
    (at the size booked), each at the price per GB-month it was created with (billing.services.storage), rounded
    down once per renter; only renters with some. `renter_id`: that renter's alone.

    The one rule for storage's burn rate: the low-balance warning (billing.services.enforcement, through
    billing.services.storage) and the balance's API and page (burn_rate) read it here."""
    volumes = Volume.objects.filter(state=VolumeState.AVAILABLE)
    disks = Instance.objects.filter(status=InstanceStatus.STOPPED)
    if renter_id is not None:
        volumes, disks = volumes.filter(owner_id=renter_id), disks.filter(renter_id=renter_id)
    volume_rows = (volumes.order_by().values("owner_id")
                   .annotate(gb_price=Sum(F("size_gb") * F("price_per_gb_month_micros")))
                   .values_list("owner_id", "gb_price"))
    disk_rows = (disks.order_by().values("renter_id")
                 .annotate(gb_price=Sum(F("disk_gb") * F("disk_price_per_gb_month_micros")))
                 .values_list("renter_id", "gb_price"))
    rates: dict[int, int] = {}
    for renter, gb_price in volume_rows.union(disk_rows, all=True):  # one query
        rates[renter] = rates.get(renter, 0) + (gb_price or 0)
    return {renter: gb_price * 3600 // SECONDS_PER_MONTH for renter, gb_price in rates.items() if gb_price}


@dataclass(frozen=True)
class BurnRate:
    """What a renter is billed per hour now, in its parts (micro-dollars)."""

    instances_micros: int  # running instances' GPU time, at their booked price
    storage_micros: int  # volumes and stopped instances' disks (storage_burn_per_hour)

    @property
    def total_micros(self) -> int:
        return self.instances_micros + self.storage_micros


def burn_rate(*, user: User) -> BurnRate:
    """Everything the user is billed per second now, per hour: GPU time and storage, as enforcement counts it."""
    return BurnRate(instances_micros=burn_rate_micros(user=user),
                    storage_micros=storage_burn_per_hour(renter_id=user.pk).get(user.pk, 0))


def seconds_left(*, balance_micros: int, rate_micros: int) -> int | None:
    """How long the balance lasts at `rate_micros` per hour (0 once it is at or below zero); None at no rate."""
    return max(balance_micros, 0) * 3600 // rate_micros if rate_micros else None


def stop_notice_until(*, stop_not_before: datetime | None, now: datetime | None = None) -> datetime | None:
    """A billing profile's `stop_not_before` while it is ahead (a cost rise's notice holds: the renter's running
    instances are not stopped at zero before it; billing.services.low_balance), else None."""
    return stop_not_before if stop_not_before is not None and (now or timezone.now()) < stop_not_before else None


def month_bounds(month: date) -> tuple[datetime, datetime]:
    start = datetime(month.year, month.month, 1, tzinfo=UTC)
    end = datetime(month.year + (month.month == 12), month.month % 12 + 1, 1, tzinfo=UTC)
    return start, end


def _account(user: User, kind: str) -> Account | None:
    return Account.objects.filter(user=user, kind=kind).first()


# ------------------------------------------------------------------------------------ statements


class RefundLineKind:
    HOLD = "hold"  # held from the balance when an operator asked for the refund (ledger kind refund_hold)
    DEBIT = "debit"  # debited when the payment provider had it (ledger kind refund)


@dataclass
class RefundLine:
    """One movement of a refund's money out of the balance, in the month it moved: its hold, or its debit. A refund
    held, its hold given back (not made), and made at Stripe after all has two: its money left the balance twice
    and came back once (the release, an adjustment line). Lines of a month sum to its `refunds`."""

    refund: Refund
    kind: str  # RefundLineKind
    amount_micros: int  # positive: what left the balance
    at: datetime  # when it left
    given_back: bool  # came back since (the hold given back, or the debit reversed): an adjustment line, in its month

    @property
    def made_after_its_hold_was_given_back(self) -> bool:
        return self.kind == RefundLineKind.DEBIT and self.refund.hold_id is not None


@dataclass
class Statement:
    month: date
    opening_micros: int = 0
    closing_micros: int = 0
    usage_micros: int = 0  # positive: what was charged
    storage_micros: int = 0  # positive: charged for volumes and stopped instances' disks
    top_ups_micros: int = 0
    refunds_micros: int = 0  # positive: what was given back, or held for a refund to the card (refund holds)
    adjustments_micros: int = 0  # credits and reversals, signed
    usage_lines: list[dict[str, Any]] = field(default_factory=list)
    top_ups: list[TopUp] = field(default_factory=list)
    refunds: list[RefundLine] = field(default_factory=list)
    adjustments: list[dict[str, Any]] = field(default_factory=list)
    storage: list[dict[str, Any]] = field(default_factory=list)

    @property
    def net_micros(self) -> int:
        """What the month added to the balance (signed): closing = opening + this."""
        return (self.top_ups_micros - self.usage_micros - self.storage_micros - self.refunds_micros
                + self.adjustments_micros)


_KIND_TOTALS: dict[str, str] = {
    TransactionKind.USAGE: "usage_micros",
    TransactionKind.STORAGE: "storage_micros",  # storage was counted as "credits and corrections" (found by review)
    TransactionKind.TOP_UP: "top_ups_micros",
    TransactionKind.REFUND: "refunds_micros",
    # An operator's refund leaves the balance when it is asked for (its hold; billing.services.refunds): a refund
    # line then. A hold given back (the refund not made) is a reversal: an adjustment line; a debit after it (made at
    # Stripe after all) is a refund line of its own (_refund_lines).
    TransactionKind.REFUND_HOLD: "refunds_micros",
}


def _apply_totals(statement: Statement, kind: str, total: int) -> None:
    attr = _KIND_TOTALS.get(kind)
    if attr in ("usage_micros", "storage_micros", "refunds_micros"):
        setattr(statement, attr, getattr(statement, attr) - total)
    elif attr:
        setattr(statement, attr, getattr(statement, attr) + total)
    else:
        statement.adjustments_micros += total


def statement_months(*, user: User) -> list[Statement]:
    """Every month with activity in the user's wallet, newest first, with totals (no lines)."""
    wallet = _account(user, AccountKind.CUSTOMER_WALLET)
    if wallet is None:
        return []
    rows = (Entry.objects.filter(account=wallet).annotate(month=TruncMonth("transaction__created_at", tzinfo=UTC))
            .values("month", "transaction__kind").annotate(total=Sum("amount_micros")).order_by("month"))
    months: dict[date, Statement] = {}
    for row in rows:
        month = row["month"].date()
        statement = months.setdefault(month, Statement(month=month))
        _apply_totals(statement, row["transaction__kind"], row["total"])
    running = 0
    for statement in months.values():  # oldest first
        statement.opening_micros = running
        running += statement.net_micros
        statement.closing_micros = running
    return sorted(months.values(), key=lambda s: s.month, reverse=True)


def _entry_lines(entries: QuerySet[Entry]) -> list[dict[str, Any]]:
    return [{"at": e.transaction.created_at, "kind": e.transaction.kind, "amount_micros": e.amount_micros,
             "memo": e.transaction.memo, "note": e.transaction.customer_note}
            for e in entries.select_related("transaction").order_by("transaction__created_at", "pk")]


def _refund_lines(in_month: QuerySet[Entry]) -> list[RefundLine]:
    """The month's refund lines: one per wallet entry of a refund's hold or debit, so that they sum to `refunds`
    exactly. Before, a refund was listed once if its hold or its debit fell in the month: held, given back and made
    after all, its money left the balance twice and was listed once, and across months in both (found by review)."""
    moved = list(in_month.filter(transaction__kind__in=[TransactionKind.REFUND_HOLD, TransactionKind.REFUND])
                 .annotate(given_back=Exists(LedgerTransaction.objects.filter(reverses_id=OuterRef("transaction_id"))))
                 .values_list("transaction_id", "transaction__kind", "transaction__created_at", "amount_micros",
                              "given_back")
                 .order_by("transaction__created_at", "pk"))
    ids = [txn_id for txn_id, *_ in moved]
    refunds = Refund.objects.filter(Q(hold_id__in=ids) | Q(transaction_id__in=ids)).select_related("transaction")
    by_txn: dict[int | None, Refund] = {}  # every refund and hold transaction has its Refund (tests' invariants)
    for refund in refunds:
        by_txn[refund.hold_id] = by_txn[refund.transaction_id] = refund
    # A hold made into the refund (hold -> payment clearing, the wallet untouched) comes back to the wallet by the
    # refund's reversal when Stripe fails it after all: that reversal names the refund's transaction, not the hold's
    # (found by review: such a hold line said given_back false, for money back in the balance).
    made = [r.transaction_id for r in refunds if r.hold_id is not None and r.transaction_id is not None]
    made_reversed = set(LedgerTransaction.objects.filter(reverses_id__in=made).values_list("reverses_id", flat=True))
    lines = []
    for txn_id, kind, at, amount, given_back in moved:
        refund = by_txn[txn_id]
        hold = kind == TransactionKind.REFUND_HOLD
        if hold and not given_back and refund.transaction_id in made_reversed:
            given_back = True
        lines.append(RefundLine(refund=refund, amount_micros=-amount, at=at, given_back=given_back,
                                kind=RefundLineKind.HOLD if hold else RefundLineKind.DEBIT))
    return lines


def statement_for(*, user: User, month: date) -> Statement:
    """The statement of one month: usage per instance, storage, top-ups, refunds, adjustments, and totals."""
    start, end = month_bounds(month)
    statement = Statement(month=start.date())
    wallet = _account(user, AccountKind.CUSTOMER_WALLET)
    if wallet is None:
        return statement
    entries = Entry.objects.filter(account=wallet)
    statement.opening_micros = entries.filter(transaction__created_at__lt=start).aggregate(
        total=Sum("amount_micros"))["total"] or 0
    in_month = entries.filter(transaction__created_at__gte=start, transaction__created_at__lt=end)
    for row in in_month.values("transaction__kind").annotate(total=Sum("amount_micros")).order_by():
        _apply_totals(statement, row["transaction__kind"], row["total"])
    statement.closing_micros = statement.opening_micros + statement.net_micros
    lines = (UsageInterval.objects.filter(instance__renter=user, created_at__gte=start, created_at__lt=end)
             .values("instance_id", "instance__label", "instance__gpu_model__slug", "instance__num_gpus",
                     "price_per_hour_micros")
             .annotate(seconds=Sum("seconds"), amount=Sum("amount_micros"), intervals=Count("id"),
                       first=Min("started_at"), last=Max("ended_at"))
             .order_by("instance_id"))
    statement.usage_lines = [
        {"instance": r["instance_id"], "label": r["instance__label"], "gpu_model": r["instance__gpu_model__slug"],
         "num_gpus": r["instance__num_gpus"], "price_per_hour_micros": r["price_per_hour_micros"],
         "seconds": r["seconds"], "amount_micros": r["amount"], "intervals": r["intervals"],
         "from": r["first"], "to": r["last"]}
        for r in lines
    ]
    # Refunds prefetched: each line says what of it was refunded (TopUpSerializer.refunded), a query a line before.
    statement.top_ups = list(TopUp.objects.filter(user=user, transaction__created_at__gte=start,
                                                  transaction__created_at__lt=end)
                             .prefetch_related("refunds").order_by("transaction__created_at"))
    statement.refunds = _refund_lines(in_month)
    listed = [kind for kind in _KIND_TOTALS if kind != TransactionKind.STORAGE]  # usage, top-ups, refunds: above
    for line in _entry_lines(in_month.exclude(transaction__kind__in=listed)):  # one query for both lists
        if line["kind"] == TransactionKind.STORAGE:
            statement.storage.append({**line, "charged_micros": -line["amount_micros"]})  # as usage: positive
        else:
            statement.adjustments.append(line)
    return statement


# -------------------------------------------------------------------------------------- earnings


@dataclass
class Earnings:
    """A provider's earnings, all from the ledger: gross_micros - fees_micros + adjustments_micros == earned_micros,
    and earned_micros - paid_out_micros - payout_pending_micros == balance_micros."""

    balance_micros: int = 0  # earned and not paid out yet (nor reserved for a payout still pending)
    earned_micros: int = 0  # all time, after the platform fee
    paid_out_micros: int = 0  # payouts Stripe confirmed (paid); a failed one's earnings are back in the balance
    payout_pending_micros: int = 0  # reserved for payouts whose transfer is not confirmed yet
    gross_micros: int = 0  # what renters paid for the provider's GPU time and storage, net of reversals
    fees_micros: int = 0  # the platform's share of it
    adjustments_micros: int = 0  # service credits charged to the provider, and other corrections (negative: taken)
    # Running time billed, an instance counted once whatever its GPUs (the API's billed_seconds, kept as it was).
    seconds: int = 0
    gpu_seconds: int = 0  # whole-GPU time sold: each instance's billed seconds x its GPUs (MIG slices not in it)
    # MIG slice time sold per profile: billed seconds x slices. Not GPU time: a slice is a part of a GPU, and
    # slices of different profiles are different parts, so they are neither added to GPU time nor to each other.
    mig_slice_seconds: dict[str, int] = field(default_factory=dict)
    months: list[dict[str, Any]] = field(default_factory=list)


def earnings_for(*, user: User) -> Earnings:
    """What a provider earned, was paid (payouts Stripe confirmed), has waiting in pending payouts and has left,
    what renters paid for it and the platform kept of it, and the time it sold: as earnings_from_ledger says (its
    docstring tells each figure), read in a few queries whatever the provider's history.

    The entries' sums come from the rollup (EarningsRollup: per month and node, kept by the database as entries are
    posted, each into the month of its transaction's date: the moment it was posted, so a month that is over keeps
    its figures; rows dated earlier, by history or by tests, go into their own month too), the payouts' from the
    payouts themselves (paid and pending ones count, by their status now: a rollup could not follow a status), and
    the time sold from the instances' billed and given-back seconds (each instance's billed_seconds is the sum of
    its intervals' seconds). Before, every read summed every entry and every usage interval of the provider's
    history: about 43,000 of each an instance-month, seconds per page for months of history, and past the web
    server's timeout for a fleet's year (found by review). The SQLite first run keeps no rollup: it reads
    earnings_from_ledger.

    Every figure is read from one snapshot of the database: a READ ONLY, REPEATABLE READ transaction of its own
    (a caller already in a transaction reads in that one). Before, each query was READ COMMITTED on its own, so a
    meter tick committed between the balance's and the rollup's reads had `earned - paid - pending` differ from the
    balance on that page load (found by review r55)."""
    if connection.vendor != "postgresql":
        return earnings_from_ledger(user=user)
    if connection.in_atomic_block or not connection.get_autocommit():  # the caller's transaction decides
        return _earnings_read(user=user)
    with transaction.atomic():
        with connection.cursor() as cursor:  # the transaction's first statement: its snapshot is not taken yet
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        return _earnings_read(user=user)


def _earnings_read(*, user: User) -> Earnings:
    """earnings_for's reads (PostgreSQL: the rollup), in the caller's transaction."""
    result = Earnings()
    sold = (Instance.objects.filter(node__provider=user, billed_seconds__gt=0)
            .values("mig_profile").order_by("mig_profile")
            .annotate(running=Sum(F("billed_seconds") - F("given_back_seconds")),
                      units=Sum((F("billed_seconds") - F("given_back_seconds")) * F("num_gpus"),
                                output_field=BigIntegerField())))
    for sold_row in sold:
        profile, units = sold_row["mig_profile"], sold_row["units"] or 0
        result.seconds += sold_row["running"] or 0
        if profile:
            result.mig_slice_seconds[profile] = units
        else:
            result.gpu_seconds += units
    account = _account(user, AccountKind.PROVIDER_EARNINGS)
    if account is None:
        return result
    result.balance_micros = account.balance_micros
    months: dict[date, dict[str, Any]] = {}

    def month_of(month: date) -> dict[str, Any]:
        return months.setdefault(month, {"month": month, "earned_micros": 0, "paid_out_micros": 0,
                                         "payout_pending_micros": 0})

    sales = fees = 0
    for month, earned, sold_micros, fee in (
            EarningsRollup.objects.filter(account=account).values("month").order_by("month")
            .annotate(earned=Sum("earned_micros"), sales=Sum("sales_micros"), fees=Sum("fees_micros"))
            .values_list("month", "earned", "sales", "fees")):
        month_of(month)["earned_micros"] = earned
        result.earned_micros += earned
        sales += sold_micros
        fees += fee
    # A payout's month is its ledger transaction's; paid and pending ones count, a failed one (and its reversal)
    # in no month (earnings_from_ledger). From the payouts (a few a month), each one's entries by its transaction.
    for month, status, total in (
            Payout.objects.filter(provider=user, status__in=[PayoutStatus.PAID, PayoutStatus.PENDING],
                                  transaction__kind=TransactionKind.PAYOUT,
                                  transaction__entries__account=account)
            .annotate(month=TruncMonth("transaction__created_at", tzinfo=UTC))
            .values("month", "status").order_by()
            .annotate(total=Sum("transaction__entries__amount_micros"))
            .values_list("month", "status", "total")):
        row = month_of(month.date())
        if status == PayoutStatus.PAID:
            row["paid_out_micros"] -= total
            result.paid_out_micros -= total
        else:
            row["payout_pending_micros"] -= total
            result.payout_pending_micros -= total
    result.months = [months[month] for month in sorted(months, reverse=True)]
    result.fees_micros = fees
    result.gross_micros = sales + fees
    result.adjustments_micros = result.earned_micros - sales
    return result


def earnings_from_ledger(*, user: User) -> Earnings:
    """earnings_for summed from every entry of the provider's earnings account and every usage interval of its
    instances (what it read before the rollup): the SQLite first run's reads, and the tests' oracle for the
    rollup. What a provider earned, was paid (payouts Stripe confirmed), has waiting in pending payouts and has left,
    what renters paid for it and the platform kept of it.

    gross_micros and fees_micros come from the same ledger transactions as the earnings (GPU time and storage: the
    provider's share, and the platform-revenue entry beside it), so that "renters paid" less "platform fees" is
    what the sales earned; before, they were summed from GPU-time intervals only and left storage out (found by
    review). A charge of which the platform kept all (a micro-dollar's fee rounding) has no line for the provider
    and is counted in neither.

    Time sold: gpu_seconds counts every GPU of an instance and mig_slice_seconds every slice, by profile; before,
    "GPU time sold" was running time with an instance counted once (a 4-GPU instance's hour read "1 h", found by
    review). That figure stays as `seconds`, the API's billed_seconds. All three count the seconds renters paid
    for: those given back (Instance.given_back_seconds, usage billed after a VM's last sighting) are not time sold;
    before, they were counted while the earnings on them had been taken back.
    """
    result = Earnings()
    # Time sold, from the usage intervals (an interval whose amount rounds to zero has no ledger line, so this
    # does not wait for an earnings account).
    billed = (UsageInterval.objects.filter(instance__node__provider=user)
              .values("instance__mig_profile").order_by("instance__mig_profile")
              .annotate(running=Sum("seconds"),
                        units=Sum(F("seconds") * F("instance__num_gpus"), output_field=BigIntegerField())))
    for sold_row in billed:
        profile, units = sold_row["instance__mig_profile"], sold_row["units"] or 0
        result.seconds += sold_row["running"] or 0
        if profile:
            result.mig_slice_seconds[profile] = units
        else:
            result.gpu_seconds = units
    # Less the seconds given back to renters (usage_give_back: the earnings on them were taken back too): not sold.
    back = (Instance.objects.filter(node__provider=user, given_back_seconds__gt=0)
            .values("mig_profile").order_by("mig_profile")
            .annotate(running=Sum("given_back_seconds"),
                      units=Sum(F("given_back_seconds") * F("num_gpus"), output_field=BigIntegerField())))
    for back_row in back:
        profile, units = back_row["mig_profile"], back_row["units"] or 0
        result.seconds -= back_row["running"] or 0
        if profile:
            result.mig_slice_seconds[profile] = result.mig_slice_seconds.get(profile, 0) - units
        else:
            result.gpu_seconds -= units
    account = _account(user, AccountKind.PROVIDER_EARNINGS)
    if account is None:
        return result
    result.balance_micros = account.balance_micros
    # Paid out is what Stripe confirmed: a payout still pending is counted apart, and a failed one (its entry and
    # its reversal's) in no month. Before, every payout entry and reversal counted as paid out: a pending payout
    # read "Paid out", and one made in March and refused in April read paid in March and minus that in April
    # (found by review). Each payout's month is its ledger transaction's, as before.
    payouts = Q(transaction__kind__in=[TransactionKind.PAYOUT, TransactionKind.PAYOUT_REVERSAL])
    paid = Q(transaction__kind=TransactionKind.PAYOUT, transaction__payout__status=PayoutStatus.PAID)
    pending = Q(transaction__kind=TransactionKind.PAYOUT, transaction__payout__status=PayoutStatus.PENDING)
    rows = (Entry.objects.filter(account=account).filter(~payouts | paid | pending)
            .annotate(month=TruncMonth("transaction__created_at", tzinfo=UTC))
            .values("month").order_by("-month")
            .annotate(paid=Sum("amount_micros", filter=paid), pending=Sum("amount_micros", filter=pending),
                      other=Sum("amount_micros", filter=~payouts)))
    for row in rows:
        earned, paid_out, waiting = row["other"] or 0, -(row["paid"] or 0), -(row["pending"] or 0)
        result.earned_micros += earned
        result.paid_out_micros += paid_out
        result.payout_pending_micros += waiting
        result.months.append({"month": row["month"].date(), "earned_micros": earned, "paid_out_micros": paid_out,
                              "payout_pending_micros": waiting})
    sold = Entry.objects.filter(_sales(), account=account).values("transaction_id")
    split = Entry.objects.filter(transaction_id__in=sold).aggregate(
        earned=Sum("amount_micros", filter=Q(account=account)),
        fee=Sum("amount_micros", filter=Q(account__kind=AccountKind.PLATFORM_REVENUE)))
    result.fees_micros = split["fee"] or 0
    result.gross_micros = (split["earned"] or 0) + result.fees_micros
    result.adjustments_micros = result.earned_micros - (split["earned"] or 0)
    return result


def current_month() -> date:
    return timezone.now().date().replace(day=1)


# ------------------------------------------------------------------------------ pages and panels


@dataclass(frozen=True)
class DestroyDeadline:
    """One entry of BillingProfile.destroy_deadlines: what the zero-balance grace period destroys, and when."""

    kind: str  # "instance" or "volume"
    id: int
    at: datetime  # aware UTC
    warned: bool  # a destroy warning named it with this time; nothing unwarned is destroyed


def destroy_deadlines(record: Any) -> list[DestroyDeadline]:
    """BillingProfile.destroy_deadlines as written by billing.services.enforcement._grace ({"instance:<id>":
    {"at": ISO time, "warned": bool}}), soonest first. An entry not in that form is left out rather than shown wrong
    (the field is JSON: nothing in the database enforces its shape)."""
    out = []
    for key, value in (record or {}).items() if isinstance(record, dict) else ():
        kind, _, pk = str(key).partition(":")
        try:
            at = datetime.fromisoformat(value["at"])
            entry = DestroyDeadline(kind=kind, id=int(pk), at=at.astimezone(UTC), warned=bool(value.get("warned")))
        except (TypeError, ValueError, KeyError, AttributeError):
            continue
        if kind in ("instance", "volume") and at.tzinfo is not None:
            out.append(entry)
    return sorted(out, key=lambda d: (d.at, d.kind, d.id))


@dataclass
class BalanceStatus:
    balance_micros: int
    rate_micros: int  # what the user is billed per hour now: instances_rate_micros + storage_rate_micros
    seconds_left: int | None  # at that rate; None when nothing is billed (nothing runs, no storage)
    low: bool  # less than BILLING_LOW_BALANCE_WARNING_S left at that rate (enforcement's low-balance warning)
    depleted_at: datetime | None  # when the balance reached zero (instances were stopped), until it recovers
    # While a cost rise's notice holds (a raise, a resume that found the balance low): running instances are not
    # stopped at zero before it (stop_notice_until).
    stop_not_before: datetime | None = None
    instances_rate_micros: int = 0  # of rate_micros: the running instances' GPU time
    storage_rate_micros: int = 0  # of rate_micros: volumes and stopped instances' disks
    # At zero: what the grace period destroys, and when (destroy_deadlines); empty while the balance is above zero.
    destroy_deadlines: list[DestroyDeadline] = field(default_factory=list)


def balance_status(*, user: User) -> BalanceStatus:
    """The wallet balance, the burn rate (GPU time and storage), how long it lasts, and whether the user is being
    warned. Before, the rate left storage out: a renter with only volumes or stopped instances' disks was told
    the balance was not being used while enforcement warned them and then deleted that storage (found by review)."""
    balance = _account(user, AccountKind.CUSTOMER_WALLET)
    micros = balance.balance_micros if balance else 0
    rate = burn_rate(user=user)
    left = seconds_left(balance_micros=micros, rate_micros=rate.total_micros)
    depleted, held, record = BillingProfile.objects.filter(user=user).values_list(
        "depleted_at", "stop_not_before", "destroy_deadlines").first() or (None, None, None)
    return BalanceStatus(balance_micros=micros, rate_micros=rate.total_micros, seconds_left=left,
                         low=left is not None and left < settings.BILLING_LOW_BALANCE_WARNING_S,
                         depleted_at=depleted, instances_rate_micros=rate.instances_micros,
                         storage_rate_micros=rate.storage_micros,
                         stop_not_before=stop_notice_until(stop_not_before=held),
                         # Above zero nothing is destroyed (_grace does nothing then), though the record is cleared
                         # only at the next enforcement tick: not shown as still due.
                         destroy_deadlines=destroy_deadlines(record) if micros <= 0 else [])


def instance_cost(*, instance: Instance) -> dict[str, int]:
    """What an instance has cost so far, including the whole seconds of this run not metered yet, net of what was
    given back of its charges since (reversals: usage billed after its VM's last sighting, an operator's), as the
    ledger and the usage page count it; and what its disk cost while stopped, net of its reversals too. The live
    part ends where a state change now would bill (at the node's last healthy moment while its checks fail).

    {"amount_micros", "billed_seconds" (seconds paid for: in closed usage intervals, less those given back),
    "given_back_seconds", "given_back_micros", "disk_amount_micros", "disk_given_back_micros"}, in one query.
    Before, the amount was what was charged: a give-back still read as paid on the instance's page (found by
    review); so did an operator's reversal of a disk charge (the page read disk_cost_micros). And the seconds were
    those charged: "2 min 09 s metered" for a cost the ledger charged 60 s for
    (tests/billing/test_given_back_seconds_shown.py).
    """
    # The node's fields bound the live part (instance_cost_so_far), read in the same query.
    given_back, disk_given_back, last_seen, failures, state = (
        Instance.objects.filter(pk=instance.pk)
        .annotate(usage=usage_given_back(OuterRef("pk")),
                  disk=storage_given_back("disk", object_id=OuterRef("pk"), owner_id=OuterRef("renter_id")),
                  **NODE_BILLING_FIELDS)
        .values_list("usage", "disk", *NODE_BILLING_FIELDS).first() or (0, 0, None, 0, ""))
    return {"amount_micros": instance_cost_so_far(instance=instance, node=(last_seen, failures, state)) - given_back,
            "billed_seconds": instance.billed_seconds - instance.given_back_seconds,
            "given_back_seconds": instance.given_back_seconds, "given_back_micros": given_back,
            "disk_amount_micros": instance.disk_cost_micros - disk_given_back,
            "disk_given_back_micros": disk_given_back}


def storage_given_back_micros(what: str, *, ids: Collection[int]) -> dict[int, int]:
    """Volume (`what` "volume") or instance ("disk") id -> what was given back to its owner of its storage charges
    (storage_given_back), for those with any: one query for a page of them (a reader without the annotation)."""
    model, owner = (Volume, "owner_id") if what == "volume" else (Instance, "renter_id")
    rows = (model.objects.filter(pk__in=list(ids))
            .annotate(given_back=storage_given_back(what, object_id=OuterRef("pk"), owner_id=OuterRef(owner)))
            .values_list("pk", "given_back"))
    return {pk: amount for pk, amount in rows if amount}


def earnings_by_node(*, user: User) -> dict[int, int]:
    """A provider's earnings (after the platform fee) per node id, all time: GPU time (through the instance its
    charge's key names), volumes and stopped instances' disks (through the volume or instance their storage key
    names), each net of its reversals; nodes whose earnings net to zero are left out. Service credits and other
    corrections are the provider's, not a node's: they are in earnings_for's adjustments.

    Read from the rollup (EarningsRollup: a few rows per month and node), not from the entries: before, every read
    summed every entry of the provider's history, seconds for a few months of one instance's per-minute ticks
    (found by review). earnings_by_node_from_ledger sums the entries, as before: the SQLite first run reads it (no
    rollup there), and the tests hold the rollup to it."""
    if connection.vendor != "postgresql":
        return earnings_by_node_from_ledger(user=user)
    rows = (EarningsRollup.objects.filter(account__user=user, account__kind=AccountKind.PROVIDER_EARNINGS)
            .exclude(node_id=0).values("node_id").annotate(amount=Sum("sales_micros")).order_by()
            .values_list("node_id", "amount"))
    return {node_id: amount for node_id, amount in rows if amount}


def earnings_by_node_from_ledger(*, user: User) -> dict[int, int]:
    """earnings_by_node summed from every entry of the provider's earnings account (what it read before the rollup):
    the SQLite first run's reads, and the tests' oracle for the rollup. A node whose earnings net to zero may be
    listed with 0 here. GPU time is found through its usage interval's instance, storage through the volume or
    instance its key names, each net of its reversals. Before, only GPU time counted (found by review)."""
    account = _account(user, AccountKind.PROVIDER_EARNINGS)
    if account is None:
        return {}
    mine = Entry.objects.filter(account=account)
    per_node: dict[int, int] = {}

    def add(node_id: int | None, amount: int | None) -> None:
        if node_id is not None and amount:
            per_node[node_id] = per_node.get(node_id, 0) + amount

    usage = Q(transaction__kind=TransactionKind.USAGE) | Q(transaction__reverses__kind=TransactionKind.USAGE)
    for row in (mine.filter(usage)
                .annotate(node=Coalesce("transaction__reverses__usage_interval__instance__node_id",
                                        "transaction__usage_interval__instance__node_id"))
                .values("node").annotate(amount=Sum("amount_micros")).order_by()):
        add(row["node"], row["amount"])
    storage = Q(transaction__kind=TransactionKind.STORAGE) | Q(transaction__reverses__kind=TransactionKind.STORAGE)
    charges = mine.filter(storage).annotate(key=Coalesce("transaction__reverses__idempotency_key",
                                                         "transaction__idempotency_key"))
    for what, model in (("volume", Volume), ("disk", Instance)):
        prefix = _STORAGE_KEY_OF[what]
        rest = Substr("key", len(prefix) + 1)  # "<id>:<start µs>"
        rows = (charges.filter(key__startswith=prefix)
                .annotate(object_id=Cast(Substr(rest, 1, StrIndex(rest, Value(":")) - 1), BigIntegerField()))
                .values("object_id").annotate(amount=Sum("amount_micros")).order_by())
        amounts = {row["object_id"]: row["amount"] for row in rows}
        for object_id, node_id in model.objects.filter(pk__in=amounts).values_list("pk", "node_id"):
            add(node_id, amounts[object_id])
    return per_node


# What renters buy: GPU time (metering) and storage (volumes, stopped instances' disks). Each such transaction
# debits the renter's wallet, credits the provider's earnings with the amount less the platform's fee, and the
# platform-revenue account with the fee.
SALES = (TransactionKind.USAGE, TransactionKind.STORAGE)


def _sales() -> Q:
    """An entry of a sale, or of the reversal of one (an operator's correction)."""
    return Q(transaction__kind__in=SALES) | Q(transaction__reverses__kind__in=SALES)


_REVENUE_CHARGED = Q(account__kind=AccountKind.CUSTOMER_WALLET) & _sales()
_REVENUE_TOTALS = {"charged": Sum("amount_micros", filter=_REVENUE_CHARGED),
                   "fee": Sum("amount_micros", filter=Q(account__kind=AccountKind.PLATFORM_REVENUE))}


def _revenue_sums(**window: Any) -> QuerySet[Entry]:
    """The revenue figures' entries (the platform-revenue account's, and renters' wallets' in sales and their
    reversals), of the transactions `window` filters (created_at lookups)."""
    return Entry.objects.filter(Q(account__kind=AccountKind.PLATFORM_REVENUE) | _REVENUE_CHARGED,
                                **{f"transaction__{lookup}": value for lookup, value in window.items()})


def revenue_from_ledger(*, start: datetime, end: datetime) -> dict[str, int]:
    """revenue_between's figures summed from every entry in [start, end): what it reads for the hours not settled
    yet, and the oracle of its tests and bench (bench/operator_revenue.py)."""
    row = _revenue_sums(created_at__gte=start, created_at__lt=end).aggregate(**_REVENUE_TOTALS)
    return {"charged_micros": -(row["charged"] or 0), "fee_micros": row["fee"] or 0}


# A slot of ten minutes is settled, its revenue figures kept (RevenueSlot), once it has been over this long: every
# posting is dated when it is posted (ledger_post; the metering tick dates its postings at the tick's start, and a
# tick lasts seconds) and committed before its Celery task's hard time limit (CELERY_TASK_TIME_LIMIT, 15 minutes)
# at the latest, so no entry dated in a settled slot can appear later.
REVENUE_SLOT = timedelta(minutes=10)
REVENUE_SETTLED_AFTER = timedelta(minutes=20)


def _slot_of(moment: datetime) -> datetime:
    """The start of the slot holding `moment` (UTC)."""
    moment = moment.astimezone(UTC)
    return moment.replace(minute=moment.minute - moment.minute % 10, second=0, microsecond=0)


def _settled_slots(first: datetime, last: datetime) -> tuple[int, int]:
    """(charged, fee) of the slots in [first, last) (settled, whole), from RevenueSlot; the slots it lacks summed
    from the entries once (one query grouped by minute over their span) and kept."""
    kept = RevenueSlot.objects.filter(start__gte=first, start__lt=last)
    want = int((last - first) / REVENUE_SLOT)
    row = kept.aggregate(n=Count("pk"), charged=Sum("charged_micros"), fee=Sum("fee_micros"))
    if row["n"] == want:  # every slot kept: the usual load
        return row["charged"] or 0, row["fee"] or 0
    have = set(kept.values_list("start", flat=True))
    missing = [slot for slot in (first + i * REVENUE_SLOT for i in range(want)) if slot not in have]
    sums = {slot: [0, 0] for slot in missing}
    minutes: Any = (_revenue_sums(created_at__gte=missing[0], created_at__lt=missing[-1] + REVENUE_SLOT)
                    .annotate(minute=Trunc("transaction__created_at", "minute", tzinfo=UTC))
                    .values("minute").annotate(**_REVENUE_TOTALS).order_by())
    for minute in minutes:
        if (slot := sums.get(_slot_of(minute["minute"]))) is not None:
            slot[0] -= minute["charged"] or 0
            slot[1] += minute["fee"] or 0
    RevenueSlot.objects.bulk_create([RevenueSlot(start=slot, charged_micros=charged, fee_micros=fee)
                                     for slot, (charged, fee) in sums.items()],
                                    ignore_conflicts=True)  # a concurrent load may have kept some first
    return ((row["charged"] or 0) + sum(charged for charged, _ in sums.values()),
            (row["fee"] or 0) + sum(fee for _, fee in sums.values()))


def revenue_between(*, start: datetime, end: datetime, now: datetime | None = None) -> dict[str, int]:
    """What renters were charged for GPU time and storage, and what the platform-revenue account received, posted
    in [start, end), from the ledger; both net of reversals. Integer micro-dollars: {"charged_micros",
    "fee_micros"}.

    "fee_micros" is every entry of the platform-revenue account in the window, whatever posted it: its fees on GPU
    time and on storage, less their reversals (found by review: only GPU time was counted, so the platform's fee
    on storage never reached the operators' dashboard).

    The same figures as revenue_from_ledger (every entry), read in milliseconds whatever the month holds: the
    whole slots of ten minutes of the window settled by `now` (REVENUE_SETTLED_AFTER) from their kept sums
    (RevenueSlot, summed on first need), the rest (the window's partial first slot, its last 20 to 30 minutes)
    from the entries. Before, each dashboard load summed the month's every entry (bench/operator_revenue.py).
    """
    now = now or timezone.now()
    first = _slot_of(start)
    if first < start:
        first += REVENUE_SLOT
    last = _slot_of(min(end, now - REVENUE_SETTLED_AFTER))
    if last <= first:
        return revenue_from_ledger(start=start, end=end)
    charged, fee = _settled_slots(first, last)
    row = (_revenue_sums().filter(Q(transaction__created_at__gte=start, transaction__created_at__lt=first)
                                  | Q(transaction__created_at__gte=last, transaction__created_at__lt=end))
           .aggregate(**_REVENUE_TOTALS))
    return {"charged_micros": charged - (row["charged"] or 0), "fee_micros": fee + (row["fee"] or 0)}


WAITING_LIST_LIMIT = 10
# Top-ups whose outcome Stripe has not told: processing, or failed with the answer lost (charged or not unknown).
WAITING_TOP_UPS = Q(status=TopUpStatus.PROCESSING) | Q(status=TopUpStatus.FAILED, outcome_unknown=True)


def waiting_on_stripe(*, kind: str, now: datetime | None = None) -> dict[str, Any]:
    """Money whose Stripe answer is still not known past the follow-up's delay (BILLING_TOP_UP_RECONCILE_AFTER_S),
    for operators: "payouts" (earnings reserved, transfer not known made), "refunds" (held from a wallet) or
    "top_ups" (processing, or charged-or-not unknown). {"count", "amount_micros", "oldest": the WAITING_LIST_LIMIT
    oldest rows, with their failure_message}. Each stays so while Stripe refuses to answer its lookup (a key
    without the permission, an account closed): the follow-up tries again every minute, and nothing else tells
    anyone. A deactivated provider's pending payout is not waiting on Stripe but held by the platform until the
    account is reactivated (billing.services.payouts.HELD_INACTIVE): not counted (it was, as if Stripe were late)."""
    cutoff = (now or timezone.now()) - timedelta(seconds=settings.BILLING_TOP_UP_RECONCILE_AFTER_S)
    rows: QuerySet[Any]
    if kind == "payouts":
        rows = Payout.objects.filter(status=PayoutStatus.PENDING, created_at__lt=cutoff,
                                     provider__is_active=True).select_related("provider")
    elif kind == "refunds":
        rows = Refund.objects.filter(status=RefundStatus.PENDING, created_at__lt=cutoff).select_related("top_up__user")
    elif kind == "top_ups":
        rows = TopUp.objects.filter(WAITING_TOP_UPS, created_at__lt=cutoff).select_related("user")
    else:
        raise ValueError(f"unknown kind {kind!r}")
    totals = rows.aggregate(count=Count("id"), amount=Sum("amount_micros"))
    return {"count": totals["count"], "amount_micros": totals["amount"] or 0,
            "oldest": list(rows.order_by("created_at", "pk")[:WAITING_LIST_LIMIT])}
