"""The usage readers' SQL writes each give-back subquery once (billing.selectors.usage_net, usage_totals).

usage_net annotated what an operator's reversal gave back (a correlated subquery per account: the renter's wallet,
the platform's fee) and then the nets on top of them; Django writes an annotation that another one references into
that one's SQL again, so the list's SELECT held six copies of the subquery (given back, fee given back, net amount,
net fee, and two in the provider's net) and PostgreSQL ran each, for each row. The usage page's totals held the six
too. Now the SELECT carries the two give-backs once each and the nets are worked out from them as the rows are read;
the totals read the wallet's alone. The figures are the same: checked here against the ledger, with a charge
reversed by an operator beside charges that were not.
"""
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from billing import selectors
from billing.models import AccountKind, Entry, UsageInterval
from billing.services.ledger import ledger_reverse
from billing.services.metering import usage_meter
from marketplace.money import micros_to_usd
from tests.billing.helpers import fund, node, running
from tests.conftest import _client_for
from tests.factories import UserFactory
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db

SUBQUERY = 'FROM "billing_entry"'  # each give-back subquery reads the entries; nothing else in these SELECTs does


@pytest.fixture
def reversed_charge(clock):
    """A renter's instance metered three times; an operator reversed the second charge. (renter, instance, the
    reversed interval)."""
    renter = UserFactory()
    fund(renter, "100")
    instance = running(renter, node("2.000000"))
    for _ in range(3):
        clock.advance(600)
        usage_meter()
    intervals = list(UsageInterval.objects.filter(instance=instance).order_by("started_at"))
    assert len(intervals) == 3 and all(i.transaction_id for i in intervals)
    ledger_reverse(txn=intervals[1].transaction, reason="charged by mistake")
    return renter, instance, intervals[1]


def _wallet_paid(instance) -> int:
    """What the renter's wallet paid for the instance's GPU time, from the ledger: its usage charges and their
    reversals."""
    charges = list(UsageInterval.objects.filter(instance=instance).values_list("transaction_id", flat=True))
    wallet = Entry.objects.filter(account__kind=AccountKind.CUSTOMER_WALLET)
    entries = wallet.filter(transaction_id__in=charges) | wallet.filter(transaction__reverses_id__in=charges)
    return -sum(entries.values_list("amount_micros", flat=True))


def _selects(queries, table="billing_usageinterval"):
    return [q["sql"] for q in queries.captured_queries if f'FROM "{table}"' in q["sql"] and SUBQUERY in q["sql"]]


def test_the_usage_api_s_list_writes_each_give_back_once(reversed_charge):
    renter, instance, back = reversed_charge
    with CaptureQueriesContext(connection) as queries:
        answer = _client_for(renter).get("/api/v1/billing/usage/")
    assert answer.status_code == 200, answer.content
    [sql] = _selects(queries)
    assert sql.count(SUBQUERY) == 2, sql  # the wallet's and the fee's; was 6
    rows = {r["id"]: r for r in answer.json()["results"]}
    assert set(rows) == set(UsageInterval.objects.filter(instance=instance).values_list("pk", flat=True))
    for interval in UsageInterval.objects.filter(instance=instance):
        row, paid = rows[interval.pk], interval.pk != back.pk
        amount, fee = (interval.amount_micros, interval.fee_micros) if paid else (0, 0)
        assert Decimal(row["amount"]) == micros_to_usd(amount)
        assert Decimal(row["platform_fee"]) == micros_to_usd(fee)
        assert Decimal(row["provider_earnings"]) == micros_to_usd(amount - fee)
    assert sum(Decimal(r["amount"]) for r in rows.values()) == micros_to_usd(_wallet_paid(instance))


def test_the_usage_page_s_rows_and_totals_write_each_give_back_once(reversed_charge):
    renter, instance, back = reversed_charge
    with CaptureQueriesContext(connection) as queries:
        page = logged_in(renter).get("/account/usage/")
    assert page.status_code == 200
    totals_sql, rows_sql = sorted(_selects(queries), key=lambda s: s.count(SUBQUERY))
    assert totals_sql.startswith("SELECT SUM(") and totals_sql.count(SUBQUERY) == 1, totals_sql  # the wallet's; was 6
    assert rows_sql.count(SUBQUERY) == 2, rows_sql  # was 6
    totals = page.context["totals"]
    charged = sum(UsageInterval.objects.filter(instance=instance).values_list("amount_micros", flat=True))
    assert totals == {"amount": charged - back.amount_micros, "given_back": back.amount_micros, "seconds": 1800,
                      "count": 3}
    assert totals["amount"] == _wallet_paid(instance)
    shown = {r.pk: r for r in page.context["page"].object_list}
    assert shown[back.pk].net_amount_micros == 0 and shown[back.pk].given_back_micros == back.amount_micros
    assert 'class="sub given-back"' in page.content.decode()


def test_the_nets_come_with_the_rows_however_the_list_is_read(reversed_charge):
    """filter(), slicing, get(), iterator(), an empty list: each row carries its give-backs and nets, as before."""
    renter, instance, back = reversed_charge
    listed = selectors.usage_for_user(user=renter)
    expected = {}
    for interval in UsageInterval.objects.filter(instance=instance):
        reversed_ = interval.pk == back.pk
        given, fee_given = (interval.amount_micros, interval.fee_micros) if reversed_ else (0, 0)
        expected[interval.pk] = (given, fee_given, interval.amount_micros - given, interval.fee_micros - fee_given,
                                 interval.amount_micros - given - interval.fee_micros + fee_given)

    def figures(row):
        return (row.given_back_micros, row.fee_given_back_micros, row.net_amount_micros, row.net_fee_micros,
                row.net_provider_micros)

    assert {r.pk: figures(r) for r in listed} == expected
    assert {r.pk: figures(r) for r in listed.iterator()} == expected
    assert figures(listed.get(pk=back.pk)) == expected[back.pk] == (back.amount_micros, back.fee_micros, 0, 0, 0)
    [first] = listed.filter(instance=instance).order_by("started_at")[:1]
    assert figures(first) == expected[first.pk] and first.net_amount_micros == first.amount_micros > 0
    assert list(listed.none()) == []
    assert selectors.usage_totals(listed.none()) == {"amount": None, "given_back": None, "seconds": None, "count": 0}
    assert selectors.usage_totals(listed.filter(pk=back.pk)) == {"amount": 0, "given_back": back.amount_micros,
                                                                 "seconds": 600, "count": 1}
