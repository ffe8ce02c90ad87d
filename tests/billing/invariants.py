"""What must hold in the billing tables at any moment, checked after every billing test."""
from itertools import pairwise

from django.db.models import Count, Q, Sum
from django.db.models.functions import Coalesce

from billing.models import (
    Account,
    AccountKind,
    Entry,
    LedgerTransaction,
    Refund,
    RefundStatus,
    TransactionKind,
    UsageInterval,
)
from billing.services.metering import GIVE_BACK_REASON, SECOND, cost_for, fee_for
from billing.services.storage import DISK_GIVE_BACK_REASON, storage_cost
from marketplace.models import Instance


def assert_billing_invariants() -> None:
    # Every transaction has at least two entries, and they sum to zero.
    bad = (LedgerTransaction.objects.annotate(n=Count("entries"), total=Coalesce(Sum("entries__amount_micros"), 0))
           .filter(Q(n__lt=2) | ~Q(total=0)).values_list("pk", "n", "total"))
    assert not bad, f"unbalanced transactions: {list(bad)}"
    # Cached balances equal the sum of entries; the whole ledger sums to zero.
    for account in Account.objects.annotate(total=Coalesce(Sum("entries__amount_micros"), 0)):
        assert account.balance_micros == account.total, f"{account}: cached {account.balance_micros}, " \
                                                         f"entries {account.total}"
    assert (Account.objects.aggregate(t=Coalesce(Sum("balance_micros"), 0))["t"]) == 0
    # Every reference resolves (the database checks them per statement, not with foreign keys: migration 0007).
    assert not Entry.objects.filter(Q(transaction__isnull=True) | Q(account__isnull=True)).exists()
    assert not UsageInterval.objects.filter(instance__isnull=True).exists()
    assert not UsageInterval.objects.filter(transaction_id__isnull=False, transaction__isnull=True).exists()
    # Usage: what renters paid equals what providers earned plus what the platform kept.
    usage = Entry.objects.filter(transaction__kind=TransactionKind.USAGE)
    paid = -(usage.filter(account__kind=AccountKind.CUSTOMER_WALLET)
             .aggregate(t=Coalesce(Sum("amount_micros"), 0))["t"])
    earned = usage.filter(account__kind=AccountKind.PROVIDER_EARNINGS).aggregate(
        t=Coalesce(Sum("amount_micros"), 0))["t"]
    kept = usage.filter(account__kind=AccountKind.PLATFORM_REVENUE).aggregate(t=Coalesce(Sum("amount_micros"), 0))["t"]
    assert paid == earned + kept
    assert paid == (UsageInterval.objects.aggregate(t=Coalesce(Sum("amount_micros"), 0))["t"])
    assert not LedgerTransaction.objects.filter(kind=TransactionKind.USAGE, usage_interval__isnull=True).exists()
    _assert_refund_holds()

    intervals_by_instance: dict[int, list[UsageInterval]] = {}
    for interval in UsageInterval.objects.select_related("transaction").order_by("instance_id", "started_at"):
        intervals_by_instance.setdefault(interval.instance_id, []).append(interval)
    entries_by_txn: dict[int, dict[tuple[str, int | None], int]] = {}
    for e in Entry.objects.filter(transaction__kind=TransactionKind.USAGE).select_related("account"):
        entries_by_txn.setdefault(e.transaction_id, {})[(e.account.kind, e.account.user_id)] = e.amount_micros

    # What each usage charge had given back by usage_give_back (its reversal's credit to the wallet).
    given_back = dict(Entry.objects.filter(
        transaction__kind=TransactionKind.REVERSAL, transaction__reason=GIVE_BACK_REASON,
        account__kind=AccountKind.CUSTOMER_WALLET).values_list("transaction__reverses_id", "amount_micros"))

    # What each stopped instance's disk had given back by storage.disk_give_back (its reversals' credits).
    disk_given_back: dict[int, int] = {}
    for key, amount in Entry.objects.filter(
            transaction__kind=TransactionKind.REVERSAL, transaction__reason=DISK_GIVE_BACK_REASON,
            account__kind=AccountKind.CUSTOMER_WALLET).values_list("transaction__reverses__idempotency_key",
                                                                   "amount_micros"):
        instance_id = int(key.split(":")[2])  # storage:disk:<id>:<start µs>
        disk_given_back[instance_id] = disk_given_back.get(instance_id, 0) + amount

    for instance in Instance.objects.select_related("node"):
        _assert_disk_rate_base(instance, disk_given_back.get(instance.pk))
        intervals = intervals_by_instance.get(instance.pk, [])
        assert sum(i.seconds for i in intervals) == instance.billed_seconds, f"instance {instance.pk}: seconds"
        assert sum(i.amount_micros for i in intervals) == instance.cost_micros, f"instance {instance.pk}: amount"
        # Cumulative rounding: the total depends only on the seconds billed (since the rate base, if any).
        assert instance.cost_micros == instance.rate_base_cost_micros + cost_for(
            instance.price_per_hour_micros, instance.billed_seconds - instance.rate_base_seconds)
        # The stretch before the last price change (rate_base_*), then the current price (a change re-bases the
        # meter: instances.pricing; a price raised back to the booked one is equal to the first stretch's).
        before_base = intervals[:_price_base(instance, intervals, given_back)]
        assert all(i.price_per_hour_micros == instance.price_per_hour_micros for i in intervals[len(before_base):])
        booked = (instance.price_before_cut_per_gpu_hour_micros or instance.price_per_gpu_hour_micros) \
            * instance.num_gpus
        assert sum(i.fee_micros for i in intervals) == fee_for(instance.cost_micros, instance.platform_fee_bps)
        if intervals:
            assert instance.billed_until == intervals[-1].ended_at
        for a, b in pairwise(intervals):
            assert b.started_at >= a.ended_at, f"instance {instance.pk}: {a} overlaps {b}"
        for i in intervals:
            assert i.ended_at - i.started_at == i.seconds * SECOND, f"{i}: not whole seconds"
            # The booking's snapshot, or one a re-check cut (never above the price before the first cut).
            assert i.price_per_hour_micros <= booked
            assert i.platform_fee_bps == instance.platform_fee_bps
            if i.amount_micros == 0:
                assert i.transaction_id is None
                continue
            expected = {(AccountKind.CUSTOMER_WALLET, instance.renter_id): -i.amount_micros}
            if i.amount_micros - i.fee_micros:
                expected[(AccountKind.PROVIDER_EARNINGS, instance.node.provider_id)] = i.amount_micros - i.fee_micros
            if i.fee_micros:
                expected[(AccountKind.PLATFORM_REVENUE, None)] = i.fee_micros
            assert entries_by_txn[i.transaction_id] == expected, f"{i}: entries"


def _price_base(instance: Instance, intervals: list[UsageInterval], given_back: dict[int | None, int]) -> int:
    """How many of the instance's intervals (in order) came before its last price change, asserting that its rate
    base is there: at the seconds they billed and what they charged (rate_base_*, set by instances.pricing; 0 and 0
    when its price never changed), or moved on from there by give-backs (usage_give_back re-bases the meter at the
    seconds paid for): by at most the seconds given back, and by exactly what the give-backs of the charges after it
    gave back (each moves the base's cost by what it gave back). No other rate base passes."""
    base_s, base_cost = instance.rate_base_seconds, instance.rate_base_cost_micros
    seconds, cost = [0], [0]
    for i in intervals:
        seconds.append(seconds[-1] + i.seconds)
        cost.append(cost[-1] + i.amount_micros)
    for n in range(len(intervals), -1, -1):  # the latest boundary at or before the base first
        if seconds[n] > base_s:
            continue
        if seconds[n] == base_s and cost[n] == base_cost:
            return n
        moved = base_s - seconds[n]
        if 0 < moved <= instance.given_back_seconds and base_cost - cost[n] == sum(
                given_back.get(i.transaction_id, 0) for i in intervals[n:] if i.transaction_id):
            return n
    raise AssertionError(f"instance {instance.pk}: rate base ({base_s} s, {base_cost} µ$) is neither where a price "
                         f"changed nor moved on from there by what was given back since")


def _assert_disk_rate_base(instance: Instance, given_back: int | None) -> None:
    """A stopped instance's disk: cumulative rounding from its rate base (disk_rate_base_*), which is 0 and 0 until
    a give-back (storage.disk_give_back) moves it on by the seconds given back, its cost by exactly what the
    give-backs gave back (`given_back`: None when none did). No other rate base passes."""
    base_s, base_cost = instance.disk_rate_base_seconds, instance.disk_rate_base_cost_micros
    assert instance.disk_cost_micros == base_cost + storage_cost(
        size_gb=instance.disk_gb, price_per_gb_month_micros=instance.disk_price_per_gb_month_micros,
        seconds=instance.disk_billed_seconds - base_s), f"instance {instance.pk}: disk's cumulative rounding"
    if given_back is None:
        assert (base_s, base_cost) == (0, 0), f"instance {instance.pk}: a disk rate base with no give-back"
    else:
        assert 0 < base_s <= instance.disk_billed_seconds and base_cost == given_back, (
            f"instance {instance.pk}: disk rate base ({base_s} s, {base_cost} µ$) not moved on by exactly what was "
            f"given back ({given_back} µ$)")


def _entries(txn_id: int | None) -> dict[tuple[str, int | None], int]:
    return {(e.account.kind, e.account.user_id): e.amount_micros
            for e in Entry.objects.filter(transaction_id=txn_id).select_related("account")}


def _assert_refund_holds() -> None:
    """A refund's hold (billing.services.refunds) stands while it is pending and leaves the refunds-pending account
    exactly once after: to payment clearing when made, back to the wallet when not."""
    held = Account.objects.filter(kind=AccountKind.REFUNDS_PENDING).values_list("balance_micros", flat=True).first()
    standing = Refund.objects.filter(status=RefundStatus.PENDING, hold__isnull=False).aggregate(
        t=Coalesce(Sum("amount_micros"), 0))["t"]
    assert (held or 0) == standing, f"refunds pending holds {held}, pending refunds' holds {standing}"
    assert not LedgerTransaction.objects.filter(kind=TransactionKind.REFUND_HOLD, refund_held__isnull=True).exists()
    # Every refund's debit of a wallet is its Refund's: a statement lists each as a refund line (selectors).
    assert not LedgerTransaction.objects.filter(kind=TransactionKind.REFUND, refund__isnull=True,
                                                entries__account__kind=AccountKind.CUSTOMER_WALLET).exists()
    for refund in Refund.objects.filter(hold__isnull=False).select_related("top_up"):
        wallet = (AccountKind.CUSTOMER_WALLET, refund.top_up.user_id)
        pending = (AccountKind.REFUNDS_PENDING, None)
        assert _entries(refund.hold_id) == {wallet: -refund.amount_micros, pending: refund.amount_micros}, refund
        release = LedgerTransaction.objects.filter(reverses_id=refund.hold_id).first()
        if release is not None:
            assert release.idempotency_key == f"refund-hold-release:{refund.pk}", refund
            assert _entries(release.pk) == {wallet: refund.amount_micros, pending: -refund.amount_micros}, refund
        made_from_hold = refund.transaction_id is not None and pending in _entries(refund.transaction_id)
        if made_from_hold:
            assert _entries(refund.transaction_id) == {
                pending: -refund.amount_micros, (AccountKind.PAYMENT_CLEARING, None): refund.amount_micros}, refund
        assert int(release is not None) + int(made_from_hold) == (refund.status != RefundStatus.PENDING), \
            f"{refund}: its hold left {int(release is not None) + int(made_from_hold)} times"
