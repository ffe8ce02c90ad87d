"""The operators' revenue figures (billing.selectors.revenue_between: the dashboard's today and month to date) read
from kept sums of settled slots of ten minutes (billing.RevenueSlot) plus a live sum of the rest: the same figures,
to the micro-dollar, as summing every entry, checked against a sum of the entries in Python over a history that
spans a month boundary, with storage and GPU-time charges posted today, top-ups (not revenue) and reversals posted
later."""
from datetime import UTC, datetime, timedelta

import pytest

from billing.models import AccountKind, Entry, LedgerTransaction, RevenueSlot, TransactionKind
from billing.selectors import REVENUE_SETTLED_AFTER, REVENUE_SLOT, revenue_between, revenue_from_ledger
from billing.services.ledger import ledger_post, ledger_reverse, platform_account, user_account
from billing.services.metering import usage_meter
from operations.dashboard import revenue_figures
from tests.billing.helpers import fund, node, running
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

SALES = (TransactionKind.USAGE, TransactionKind.STORAGE)


def _entries() -> list[tuple[datetime, int, int]]:
    """(dated, charged, fee) of each entry: by hand, one by one."""
    rows = []
    for entry in Entry.objects.select_related("account", "transaction__reverses"):
        txn, kind = entry.transaction, entry.account.kind
        sale = txn.kind in SALES or (txn.reverses is not None and txn.reverses.kind in SALES)
        rows.append((txn.created_at, -entry.amount_micros if kind == AccountKind.CUSTOMER_WALLET and sale else 0,
                     entry.amount_micros if kind == AccountKind.PLATFORM_REVENUE else 0))
    return rows


def _direct(start: datetime, end: datetime, entries: list | None = None) -> dict[str, int]:
    """The figures by hand: the entries of the transactions dated in [start, end)."""
    inside = [(charged, fee) for dated, charged, fee in (entries or _entries()) if start <= dated < end]
    return {"charged_micros": sum(c for c, _ in inside), "fee_micros": sum(f for _, f in inside)}


def _kept_rows_are_their_slots() -> None:
    entries = _entries()
    for row in RevenueSlot.objects.all():
        assert {"charged_micros": row.charged_micros, "fee_micros": row.fee_micros} == _direct(
            row.start, row.start + REVENUE_SLOT, entries), row.start


def _sale(n: int, at: datetime, renter, provider) -> LedgerTransaction:
    """A storage charge (GPU time's come from the meter: tests/billing/invariants.py wants their intervals)."""
    amount = 1_000 + 7_919 * n % 100_003  # no two alike: a charge counted twice or lost changes the sums
    fee = amount * 15 // 100
    txn, _ = ledger_post(idempotency_key=f"storage:bench:{n}", kind=TransactionKind.STORAGE, at=at, lines=[
        (user_account(user_id=renter.pk, kind=AccountKind.CUSTOMER_WALLET), -amount),
        (user_account(user_id=provider.pk, kind=AccountKind.PROVIDER_EARNINGS), amount - fee),
        (platform_account(kind=AccountKind.PLATFORM_REVENUE), fee)])
    return txn


def _top_up(n: int, at: datetime, renter) -> None:
    ledger_post(idempotency_key=f"top_up:{n}", kind=TransactionKind.TOP_UP, at=at, lines=[
        (user_account(user_id=renter.pk, kind=AccountKind.CUSTOMER_WALLET), 25_000_000),
        (platform_account(kind=AccountKind.PAYMENT_CLEARING), -25_000_000)])


def _history(clock, renter, provider) -> list[LedgerTransaction]:
    """Storage charges every 37 minutes from 2026-02-27 05:03 to the clock's now (2026-03-02 12:00:00.25), a top-up
    every 10th, and charges on each side of the month's first instant and of a slot's."""
    march = datetime(2026, 3, 1, tzinfo=UTC)
    at, n, sales = datetime(2026, 2, 27, 5, 3, tzinfo=UTC), 0, []
    while at < clock.now:
        sales.append(_sale(n, at, renter, provider))
        if n % 10 == 0:
            _top_up(n, at + timedelta(seconds=1), renter)
        at, n = at + timedelta(minutes=37, microseconds=n), n + 1
    for edge in (march, march + timedelta(hours=9)):
        sales.append(_sale(n, edge - timedelta(microseconds=1), renter, provider))
        sales.append(_sale(n + 1, edge, renter, provider))
        n += 2
    return sales


def _windows(now: datetime) -> list[tuple[datetime, datetime]]:
    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    return [
        (day, now), (day.replace(day=1), now),  # the dashboard's
        (datetime(2026, 2, 27, 5, 17, 3, tzinfo=UTC), now),  # across the month's start, from within a slot
        (datetime(2026, 3, 1, 0, 0, 0, 1, tzinfo=UTC), now),  # from just after the charge at the month's start
        (datetime(2026, 2, 1, tzinfo=UTC), datetime(2026, 3, 1, tzinfo=UTC)),  # February, whole slots only
        (datetime(2026, 2, 28, 22, 30, tzinfo=UTC), datetime(2026, 3, 1, 1, 45, 10, tzinfo=UTC)),
        (now - timedelta(minutes=15), now),  # inside what is not settled: summed live only
        (day, now + timedelta(days=2)),  # ending in the future
        (datetime(2026, 3, 1, 8, tzinfo=UTC), datetime(2026, 3, 1, 9, tzinfo=UTC)),  # whole slots only
        (datetime(2026, 3, 2, 11, 32, tzinfo=UTC), datetime(2026, 3, 2, 11, 38, tzinfo=UTC)),  # within one
    ]


def _check(now: datetime) -> None:
    entries = _entries()
    for start, end in _windows(now):
        assert revenue_between(start=start, end=end, now=now) == _direct(start, end, entries), (start, end)
        assert revenue_between(start=start, end=end, now=now) == revenue_from_ledger(start=start, end=end)
    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    assert revenue_figures(now) == {"today": _direct(day, now, entries), "month": _direct(day.replace(day=1), now,
                                                                                           entries)}


def test_revenue_from_kept_slots_equals_the_sum_of_every_entry_across_a_month_and_reversals(clock):
    renter, provider = UserFactory(), UserFactory()
    sales = _history(clock, renter, provider)
    assert len(sales) > 120
    _check(clock.now)
    kept = RevenueSlot.objects.count()
    # The slots kept are the settled ones of the windows read, each holding its own entries' sums, to the
    # micro-dollar (a slot read in another time zone, or a window one slot off, fails here).
    assert kept > 6 * 24 * 3
    assert not RevenueSlot.objects.filter(start__gt=clock.now - REVENUE_SETTLED_AFTER - REVENUE_SLOT).exists()
    _kept_rows_are_their_slots()
    assert RevenueSlot.objects.exclude(fee_micros=0).count() > 24 * 2  # a charge every 37 minutes

    # Later today: an instance runs and the meter charges its GPU time, a storage charge is dated a minute ago, an
    # operator reverses a charge of February and one of this morning (posted now: counted now, less, in today's and
    # this month's figures).
    fund(renter, "100")
    running(renter, node(provider=provider))
    clock.advance(10 * 60)
    assert usage_meter().intervals == 1
    clock.advance(15 * 60)
    assert usage_meter().intervals == 1
    assert LedgerTransaction.objects.filter(kind=TransactionKind.USAGE).count() == 2
    _sale(10_000, clock.now - timedelta(minutes=1), renter, provider)
    this_morning = next(sale for sale in reversed(sales) if sale.created_at.date() == clock.now.date())
    ledger_reverse(txn=sales[20], reason="charged by mistake")
    ledger_reverse(txn=this_morning, reason="charged by mistake")
    _check(clock.now)
    # A posting dated 15 minutes ago that commits only now (a long task's): its slot was not settled, nor kept.
    _sale(10_002, clock.now - timedelta(minutes=15), renter, provider)
    _check(clock.now)

    # Hours later: what was live is settled and kept, and the kept slots are read again, not summed again.
    clock.advance(3 * 3600)
    assert usage_meter().intervals == 1
    _sale(10_001, clock.now - timedelta(seconds=5), renter, provider)
    _check(clock.now)
    assert RevenueSlot.objects.count() > kept
    assert RevenueSlot.objects.filter(start=datetime(2026, 3, 2, 12, 20, tzinfo=UTC)).exists()  # the reversals'

    _kept_rows_are_their_slots()


def test_a_kept_slot_is_what_is_read(clock):
    """The figures of settled slots come from RevenueSlot, not from the entries (what makes them fast): a kept row
    changed by hand shows in the figure."""
    renter, provider = UserFactory(), UserFactory()
    _sale(1, datetime(2026, 3, 2, 8, 30, tzinfo=UTC), renter, provider)
    day = datetime(2026, 3, 2, tzinfo=UTC)
    before = revenue_between(start=day, end=clock.now)
    assert before == revenue_from_ledger(start=day, end=clock.now) and before["fee_micros"] > 0
    assert RevenueSlot.objects.filter(start=datetime(2026, 3, 2, 8, 30, tzinfo=UTC)).update(fee_micros=1) == 1
    assert revenue_between(start=day, end=clock.now)["fee_micros"] == 1
