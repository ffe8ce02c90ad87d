"""A provider's earnings are read from a rollup by month and node (billing.EarningsRollup, kept by a trigger of
migration 0022) instead of every ledger entry and usage interval of their history (review r54 earn #1: seconds per
read for months of per-minute ticks). The rollup must say exactly what summing the ledger says: a seeded random run
of GPU time (both kinds of meter tick), storage, reversals, usage given back, service credits, manual corrections,
postings backdated into past months, and payouts paid, pending and failed, across months, holds earnings_for and
earnings_by_node to earnings_from_ledger and earnings_by_node_from_ledger (what they read before) along the way; the
migration's backfill rebuilds the same rows; and the reads no longer touch the entries or the intervals."""
import contextlib
import importlib
import random
from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from billing.models import AccountKind, BillingProfile, EarningsRollup, LedgerTransaction, Payout, TransactionKind
from billing.selectors import earnings_by_node, earnings_by_node_from_ledger, earnings_for, earnings_from_ledger
from billing.services import payouts
from billing.services.ledger import ledger_post, ledger_reverse, platform_account, user_account
from billing.services.metering import usage_give_back, usage_meter
from billing.services.storage import storage_meter
from core.errors import ApplicationError
from marketplace.models import Instance, Volume
from marketplace.services import volumes as volume_svc
from tests.billing.helpers import fund, node, running, start, stop
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

ROLLUP_MIGRATION = importlib.import_module("billing.migrations.0022_earnings_rollup")


def _assert_rollup_is_the_ledger(providers) -> None:
    for provider in providers:
        assert earnings_for(user=provider) == earnings_from_ledger(user=provider), provider
        by_ledger = {node_id: amount for node_id, amount in earnings_by_node_from_ledger(user=provider).items()
                     if amount}
        assert earnings_by_node(user=provider) == by_ledger, provider


def _rollup_rows() -> list[tuple]:
    return list(EarningsRollup.objects.order_by("account_id", "month", "node_id").values_list(
        "account_id", "month", "node_id", "earned_micros", "sales_micros", "fees_micros"))


def _ids(**lookup) -> list[int]:
    return list(Instance.objects.filter(**lookup).values_list("pk", flat=True))


def _volume(owner, on) -> Volume:
    volume = volume_svc.volume_create(owner=owner, node_id=on.pk, size_gb=500)
    return volume_svc.volume_mark_available(volume_id=volume.pk)


@pytest.mark.parametrize("seed", [1, 2])
def test_the_rollup_says_what_the_ledger_says_through_a_random_history(clock, seed):
    rng = random.Random(seed)
    providers = [UserFactory() for _ in range(2)]
    for provider in providers:
        BillingProfile.objects.update_or_create(user=provider,
                                                defaults={"stripe_connect_account_id": f"acct_test{provider.pk}"})
    nodes = []
    for provider in providers:
        for price in ("1.234567", "3.000001"):
            on = node(price, gpu_count=8, provider=provider)
            on.disk_price_per_gb_month_micros = 1_500_000
            on.save()
            nodes.append(on)
    renters = [UserFactory() for _ in range(3)]
    for renter in renters:
        fund(renter, "1000000")
    promotions = platform_account(kind=AccountKind.PROMOTIONS)
    posted = {"backdated": 0, "given_back": 0, "reversed": 0, "paid": 0, "failed": 0, "pending": 0}
    months = set()

    def earnings(provider):
        return user_account(user_id=provider.pk, kind=AccountKind.PROVIDER_EARNINGS)

    for step in range(160):
        clock.advance(rng.uniform(60, 3 * 86400))
        months.add(clock.now.strftime("%Y-%m"))
        action = rng.choices(["rent", "stop", "start", "tick", "storage", "volume", "reverse", "give_back", "credit",
                              "backdated", "payout", "payout_outcome"],
                             weights=[4, 3, 3, 8, 3, 2, 2, 2, 2, 2, 2, 3])[0]
        if action == "rent":
            with contextlib.suppress(ApplicationError):  # the node is full
                running(rng.choice(renters), rng.choice(nodes), rng.randint(1, 2))
        elif action == "stop" and (ids := _ids(status="running")):
            stop(Instance.objects.get(pk=rng.choice(ids)))
        elif action == "start" and (ids := _ids(status="stopped")):
            with contextlib.suppress(ApplicationError):  # its GPUs were taken meanwhile
                start(Instance.objects.get(pk=rng.choice(ids)))
        elif action == "tick":
            usage_meter(set_based=rng.random() < 0.6)
        elif action == "storage":
            storage_meter()
        elif action == "volume":
            _volume(rng.choice(renters), rng.choice(nodes))
        elif action == "reverse":  # an operator's reversal of a sale, in the month it is made
            sales = list(LedgerTransaction.objects.filter(
                kind__in=[TransactionKind.USAGE, TransactionKind.STORAGE], reversed_by__isnull=True,
                entries__account__kind=AccountKind.PROVIDER_EARNINGS).values_list("pk", flat=True))
            if sales:
                ledger_reverse(txn=LedgerTransaction.objects.get(pk=rng.choice(sales)), reason="charged by mistake")
                posted["reversed"] += 1
        elif action == "give_back" and (ids := _ids(status="running", billed_seconds__gt=600)):
            instance = Instance.objects.get(pk=rng.choice(ids))
            usage_meter(set_based=False)
            instance.refresh_from_db()
            # A look at its node began a little before and found the VM lost, last seen a little before that; a stop
            # closed the billing meanwhile: what was billed after the last sighting is given back.
            seen_at = clock.now - timedelta(seconds=rng.randint(30, 300))
            since = seen_at - timedelta(seconds=rng.randint(1, 300))
            if instance.started_at < since:
                stop(instance)
                back = usage_give_back(instance=Instance.objects.get(pk=instance.pk), since=since, seen_at=seen_at,
                                       memo="VM lost", customer_note="given back")
                posted["given_back"] += back is not None
        elif action == "credit":  # a service credit charged to the provider, or a manual correction to earnings
            provider, renter = rng.choice(providers), rng.choice(renters)
            amount = rng.randint(1, 50_000)
            if rng.random() < 0.5:
                lines = [(user_account(user_id=renter.pk, kind=AccountKind.CUSTOMER_WALLET), amount),
                         (earnings(provider), -amount)]
                kind = TransactionKind.SERVICE_CREDIT
            else:
                sign = rng.choice([1, -1])
                lines = [(earnings(provider), sign * amount), (promotions, -sign * amount)]
                kind = TransactionKind.CREDIT
            ledger_post(idempotency_key=f"test-credit:{step}", kind=kind, lines=lines)
        elif action == "backdated":  # posted now, dated in an earlier month (a late charge, a late credit)
            at = clock.now - timedelta(days=rng.randint(20, 70))
            on = rng.choice(nodes)
            provider_account = user_account(user_id=on.provider_id, kind=AccountKind.PROVIDER_EARNINGS)
            renter = rng.choice(renters)
            wallet = user_account(user_id=renter.pk, kind=AccountKind.CUSTOMER_WALLET)
            amount = rng.randint(100, 90_000)
            if rng.random() < 0.5 and (volume := Volume.objects.filter(node=on).first()):
                fee = amount * 15 // 100
                key = f"storage:volume:{volume.pk}:{int(at.timestamp() * 1_000_000)}{step}"
                ledger_post(idempotency_key=key, kind=TransactionKind.STORAGE, at=at, lines=[
                    (wallet, -amount), (provider_account, amount - fee),
                    (platform_account(kind=AccountKind.PLATFORM_REVENUE), fee)])
            else:
                ledger_post(idempotency_key=f"test-late-credit:{step}", kind=TransactionKind.SERVICE_CREDIT, at=at,
                            lines=[(wallet, amount), (provider_account, -amount)])
            posted["backdated"] += 1
        elif action == "payout":
            provider = rng.choice(providers)
            today = timezone.now().date()
            payouts.payout_create(provider_id=provider.pk, period_start=today - timedelta(days=6), period_end=today)
        elif action == "payout_outcome" and (ids := list(Payout.objects.filter(status="pending")
                                                          .values_list("pk", flat=True))):
            payout_id = rng.choice(ids)
            if rng.random() < 0.6:
                payouts._payout_paid(payout_id, SimpleNamespace(id=f"tr_test{payout_id}"))
            else:
                payouts._payout_failed(payout_id, "The destination account was closed.")
        if step % 20 == 19:
            _assert_rollup_is_the_ledger(providers)

    usage_meter()
    storage_meter()
    clock.advance(86400)
    for provider in providers:  # one left pending (reserved, transfer not known made)
        today = timezone.now().date()
        payouts.payout_create(provider_id=provider.pk, period_start=today, period_end=today)
    _assert_rollup_is_the_ledger(providers)
    for status in ("paid", "failed", "pending"):
        posted[status] = Payout.objects.filter(status=status).count()
    # The run went through what it is meant to test.
    assert len(months) >= 4 and all(posted.values()), (months, posted)
    assert EarningsRollup.objects.exclude(node_id=0).exists() and EarningsRollup.objects.filter(node_id=0).exists()

    # The migration's backfill, over the same entries, makes the same rows as the trigger kept.
    kept = _rollup_rows()
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM billing_earningsrollup")
        cursor.execute(ROLLUP_MIGRATION._ADD.format(sums=ROLLUP_MIGRATION._SUMS.format(source="billing_entry")))
    assert _rollup_rows() == kept


def test_earnings_reads_read_neither_the_entries_nor_the_intervals(clock):
    """A provider's history is read from the rollup (a few rows a month and node), the payouts from the payouts:
    no query sums the earnings account's entries or the usage intervals, whose count grows by the minute."""
    provider, renter = UserFactory(), UserFactory()
    BillingProfile.objects.update_or_create(user=provider, defaults={"stripe_connect_account_id": "acct_testreads"})
    fund(renter, "1000")
    instance = running(renter, node("10.000000", provider=provider))
    for _ in range(5):
        clock.advance(3600)
        usage_meter()
    today = timezone.now().date()
    assert payouts.payout_create(provider_id=provider.pk, period_start=today - timedelta(days=6), period_end=today)
    with CaptureQueriesContext(connection) as queries:
        e = earnings_for(user=provider)
        per_node = earnings_by_node(user=provider)
    assert e.earned_micros > 0 and e.payout_pending_micros > 0 and e.seconds == 5 * 3600
    assert per_node == {instance.node_id: e.earned_micros}
    for query in queries.captured_queries:
        sql = query["sql"]
        assert '"billing_usageinterval"' not in sql, sql
        # Entries only as those of the provider's payouts' transactions (a few a month).
        assert '"billing_entry"' not in sql or 'FROM "billing_payout"' in sql, sql

