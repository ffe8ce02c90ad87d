"""What the platform and the providers are told they earned, from the ledger: the operators' revenue (the
dashboard's billing.selectors.revenue_between) and a provider's earnings (earnings_for, earnings_by_node, the
earnings API), GPU time and storage alike, net of reversals."""
from datetime import timedelta

import pytest

from billing.models import AccountKind, LedgerTransaction, TransactionKind
from billing.selectors import earnings_by_node, earnings_for, revenue_between
from billing.services.ledger import earnings_balance, ledger_post, ledger_reverse, platform_account, user_account
from billing.services.metering import usage_meter
from billing.services.storage import storage_meter
from marketplace.models import Volume
from marketplace.services import volumes as volume_svc
from tests.billing.helpers import fund, node, running, stop
from tests.factories import UserFactory, api_key_for

pytestmark = pytest.mark.django_db


def _volume(owner, on, size_gb=100) -> Volume:
    volume = volume_svc.volume_create(owner=owner, node_id=on.pk, size_gb=size_gb)
    return volume_svc.volume_mark_available(volume_id=volume.pk)


def _with_disk_price(on, micros=1_000_000):
    on.disk_price_per_gb_month_micros = micros
    on.save()
    return on


def _revenue() -> int:
    return platform_account(kind=AccountKind.PLATFORM_REVENUE).balance_micros


def test_operator_revenue_counts_the_platform_fee_on_storage_and_its_reversals(clock, user):
    """The dashboard counted GPU time only: the platform's fee on volumes and disks never showed (found by review:
    the revenue account held 208,333 µ$, the dashboard said 0)."""
    on = _with_disk_price(node(provider=UserFactory()))
    fund(user, "50")
    start = clock.now
    _volume(user, on, size_gb=1000)
    clock.advance(3600)
    storage_meter()
    charged = -sum(LedgerTransaction.objects.get(kind=TransactionKind.STORAGE).entries
                   .filter(account__kind=AccountKind.CUSTOMER_WALLET).values_list("amount_micros", flat=True))
    assert _revenue() > 0 and charged > 0
    assert revenue_between(start=start, end=clock.now + timedelta(seconds=1)) == {
        "charged_micros": charged, "fee_micros": _revenue()}
    clock.advance(60)
    ledger_reverse(txn=LedgerTransaction.objects.get(kind=TransactionKind.STORAGE), reason="charged by mistake")
    assert revenue_between(start=start, end=clock.now + timedelta(seconds=1)) == {"charged_micros": 0,
                                                                                  "fee_micros": 0}
    assert _revenue() == 0


def test_provider_earnings_gross_and_fees_agree_with_what_was_earned(clock, user):
    """Renters paid − platform fees was built from GPU-time intervals only, while 'earned' came from the ledger and
    held storage too (found by review: 0 − 0 against 1,180,555 µ$ earned); per node, volumes and disks were left
    out. Now: renters paid − platform fees + service credits and corrections = earned, and each node earns what
    its GPU time, volumes and disks earned."""
    provider = UserFactory()
    gpus = _with_disk_price(node("2.000000", provider=provider))
    disks = _with_disk_price(node("1.000000", provider=provider), 2_000_000)
    fund(user, "100")
    instance = running(user, gpus)
    _volume(user, disks, size_gb=1000)
    stopped = running(user, disks)
    clock.advance(3600)
    usage_meter()
    stop(stopped)
    clock.advance(3600)
    usage_meter()
    storage_meter()
    assert LedgerTransaction.objects.filter(kind=TransactionKind.STORAGE).count() == 2  # the volume, the disk
    ledger_post(idempotency_key="test-service-credit", kind=TransactionKind.SERVICE_CREDIT, lines=[
        (user_account(user_id=user.pk, kind=AccountKind.CUSTOMER_WALLET), 5_000),
        (user_account(user_id=provider.pk, kind=AccountKind.PROVIDER_EARNINGS), -5_000)])
    earned = earnings_balance(user_id=provider.pk)
    e = earnings_for(user=provider)
    assert e.earned_micros == e.balance_micros == earned > 0
    assert e.fees_micros == _revenue() > 0  # every charge here was for this provider
    assert e.gross_micros == 100_000_000 + 5_000 - user.billing_accounts.get(
        kind=AccountKind.CUSTOMER_WALLET).balance_micros  # what the wallet paid (it got the credit)
    assert e.adjustments_micros == -5_000
    assert e.gross_micros - e.fees_micros + e.adjustments_micros == earned
    assert e.seconds == 2 * 3600 + 3600  # GPU time sold: two instances' first hour, one's second

    per_node = earnings_by_node(user=provider)
    assert sum(per_node.values()) == earned + 5_000  # the service credit is the provider's, not a node's
    gpu_time = sum(i.provider_micros for i in instance.usage_intervals.all())
    assert per_node[gpus.pk] == gpu_time
    assert per_node[disks.pk] > sum(i.provider_micros for i in stopped.usage_intervals.all())  # + volume, disk
    ledger_reverse(txn=LedgerTransaction.objects.filter(kind=TransactionKind.STORAGE).first(), reason="wrong")
    assert sum(earnings_by_node(user=provider).values()) == earnings_balance(user_id=provider.pk) + 5_000
    e = earnings_for(user=provider)
    assert e.gross_micros - e.fees_micros + e.adjustments_micros == e.earned_micros


def test_the_earnings_api_and_page_add_up_with_storage(clock, user, client):
    from rest_framework.test import APIClient

    provider = UserFactory()
    on = _with_disk_price(node(provider=provider))
    fund(user, "50")
    _volume(user, on, size_gb=1000)
    clock.advance(3600)
    storage_meter()
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key_for(provider)}")
    body = api.get("/api/v1/billing/earnings/").json()
    from decimal import Decimal

    assert Decimal(body["renters_paid"]) > 0 and body["adjustments"] == "0.000000"
    assert Decimal(body["renters_paid"]) - Decimal(body["platform_fees"]) == Decimal(body["earned"]) > 0
    client.force_login(provider)
    page = client.get("/earnings/").content.decode()
    assert "Service credits and corrections" not in page  # none: not shown
