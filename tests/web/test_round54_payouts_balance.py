"""Review r54 (earn #1, the payouts page's part): /payouts/ showed the earnings not paid out yet through
selectors.earnings_for, which aggregates the provider's whole earnings history (a query over every entry, and
one joined to every entry of the same transactions), only to read the balance that the earnings account's row
already holds. The page reads that row now: no query of the ledger's entries, whatever the history."""
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from billing.models import AccountKind, Entry
from billing.services.ledger import ledger_post, platform_account, user_account
from tests.factories import UserFactory
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db


def _earn(provider, amount: int, n: int) -> None:
    ledger_post(idempotency_key=f"r54-earn-{provider.pk}-{n}", kind="credit", lines=[
        (user_account(user_id=provider.pk, kind=AccountKind.PROVIDER_EARNINGS), amount),
        (platform_account(kind=AccountKind.PROMOTIONS), -amount)])


def test_the_payouts_page_reads_the_balance_from_the_account_row_not_the_ledger():
    provider = UserFactory()
    for n in range(5):
        _earn(provider, 2_500_000, n)  # $12.50 earned, none paid out
    web = logged_in(provider)
    web.get("/payouts/")
    with CaptureQueriesContext(connection) as captured:
        page = web.get("/payouts/").content.decode()
    assert '<strong id="earnings-balance">$12.50</strong>' in page
    entries = Entry._meta.db_table
    reading_entries = [q["sql"] for q in captured.captured_queries if f'"{entries}"' in q["sql"]]
    assert not reading_entries, reading_entries


def test_a_provider_with_no_earnings_account_reads_zero():
    page = logged_in(UserFactory()).get("/payouts/").content.decode()
    assert '<strong id="earnings-balance">$0.00</strong>' in page
