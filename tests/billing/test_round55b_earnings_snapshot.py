"""earnings_for reads every figure from one snapshot (review r55 LOW-1).

Before, the earnings account's balance, the rollup and the payouts were read in separate READ COMMITTED queries: a
posting (a meter tick) committed by another connection between the balance's read and the rollup's had one page
load show `earned - paid - pending != balance`. The posting here commits on a thread and a connection of its own,
right after the balance was read (the point where the old code read it); the figures must still add up.
"""
import threading

import pytest
from django.db import connection, transaction

from billing import selectors
from billing.models import AccountKind, TransactionKind
from billing.services.ledger import ledger_post, platform_account, user_account
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)
WAIT_S = 30  # reached only when something is wrong (the thread blocked)


def _credit(provider, key: str, amount: int) -> None:
    ledger_post(idempotency_key=key, kind=TransactionKind.CREDIT,
                lines=[(user_account(user_id=provider.pk, kind=AccountKind.PROVIDER_EARNINGS), amount),
                       (platform_account(kind=AccountKind.PROMOTIONS), -amount)])


def _committed_elsewhere(provider, key: str, amount: int) -> None:
    """The posting, committed by another connection (another worker's meter tick), before this returns."""
    errors: list[str] = []

    def work():
        try:
            with transaction.atomic():
                _credit(provider, key, amount)
        except BaseException as exc:  # noqa: BLE001 (asserted below)
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            connection.close()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(WAIT_S)
    assert not thread.is_alive(), "the posting is still running: blocked?"
    assert not errors, errors


def test_a_posting_committed_between_the_reads_does_not_make_the_figures_disagree(monkeypatch):
    provider = UserFactory()
    _credit(provider, "r55b-first", 5_000_000)
    real = selectors._account
    posted = []

    def account_then_a_tick(user, kind):
        found = real(user, kind)  # the balance, as read for the page
        if kind == AccountKind.PROVIDER_EARNINGS and not posted:
            posted.append(True)
            _committed_elsewhere(provider, "r55b-tick", 1_000_000)
        return found

    monkeypatch.setattr(selectors, "_account", account_then_a_tick)
    assert not connection.in_atomic_block  # as the web page and the API call it
    seen = selectors.earnings_for(user=provider)
    assert posted
    assert seen.earned_micros - seen.paid_out_micros - seen.payout_pending_micros == seen.balance_micros, (
        seen.earned_micros, seen.balance_micros)
    assert seen.balance_micros in (5_000_000, 6_000_000)

    # Afterwards the connection is back in autocommit and may write (the snapshot's transaction was read-only and
    # is over), and the next read sees the tick.
    assert connection.get_autocommit()
    _credit(provider, "r55b-after", 500_000)
    again = selectors.earnings_for(user=provider)
    assert again.balance_micros == again.earned_micros == 6_500_000


def test_in_a_callers_transaction_it_reads_in_that_one():
    provider = UserFactory()
    _credit(provider, "r55b-outer", 2_000_000)
    with transaction.atomic():
        _credit(provider, "r55b-inner", 1_000_000)  # written in the transaction: a new one would not see it
        seen = selectors.earnings_for(user=provider)
        assert seen.balance_micros == seen.earned_micros == 3_000_000
        _credit(provider, "r55b-still-writable", 1)  # not made read-only
    assert selectors.earnings_for(user=provider).balance_micros == 3_000_001
