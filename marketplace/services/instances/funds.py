"""The funds check: a renter's balance against an hour of everything they would be paying for (402 when short)."""
from dataclasses import dataclass

from django.conf import settings
from django.db import connection
from django.db.models import Sum

from billing.services.ledger import funds_required_micros, wallet_balance
from core.errors import PaymentRequired
from core.sql import prepared_cursor
from marketplace.models import Instance, InstanceStatus
from marketplace.money import usd_text

S = InstanceStatus


class InsufficientFunds(PaymentRequired):
    """The renter's balance does not cover the first hour of their instances with this one (HTTP 402).

    `funds` holds the figures, so that a page can say it in its own words (the message names the API).
    """

    def __init__(self, message: str, funds: "Funds"):
        super().__init__(message)
        self.funds = funds


# The instances that count towards a renter's burn rate when they rent or start one more: those billed now
# (running) and those that will be billed without another check once a worker is done (booked, starting,
# restarting). Stopping, stopped, failed and destroy* ones are not billed, and anything else counts only
# when it is added here. Interrupted ones are not billed and do not count: a renter whose server died must
# be able to rent a replacement; if it comes back, the low-balance warning and the stop at zero apply.
COMMITTED_STATUSES = (S.REQUESTED, S.PROVISIONING, S.STARTING, S.RUNNING)


@dataclass(frozen=True)
class Funds:
    """A renter's balance against BILLING_FUNDS_REQUIRED_S of their whole burn rate with one more instance."""

    balance_micros: int
    committed_rate_micros: int  # per hour: their instances in COMMITTED_STATUSES
    added_rate_micros: int  # per hour: the instance being rented or started
    required_micros: int  # BILLING_FUNDS_REQUIRED_S of both together
    missing_micros: int  # 0 when the balance covers it, or when funds are not required
    required_s: int
    enforced: bool  # BILLING_REQUIRE_FUNDS

    @property
    def rate_micros(self) -> int:
        return self.committed_rate_micros + self.added_rate_micros


def committed_rate_micros(*, renter_id: int) -> int:
    """What the renter's running and about-to-run instances (COMMITTED_STATUSES) cost per hour."""
    if connection.vendor == "postgresql":  # every booking runs it: the SQL once, not an aggregate compiled each time
        with prepared_cursor() as cursor:
            cursor.execute(COMMITTED_RATE_SQL, [renter_id, list(COMMITTED_STATUSES)])
            return int(cursor.fetchone()[0])
    return (Instance.objects.filter(renter_id=renter_id, status__in=COMMITTED_STATUSES).order_by()
            .aggregate(rate=Sum("price_per_hour_micros"))["rate"] or 0)


# A booking's own statement reads it too (allocation.py), after the wallet's lock: [renter_id, COMMITTED_STATUSES].
COMMITTED_RATE_SQL = (f"SELECT COALESCE(SUM(price_per_hour_micros), 0) FROM {Instance._meta.db_table} "  # noqa: S608
                      "WHERE renter_id = %s AND status = ANY(%s)")


def funds_for(*, renter_id: int, price_per_hour_micros: int, lock: bool = False) -> Funds:
    """The funds check's figures for renting (or starting) one more instance at this hourly price.

    The rule: the balance must hold BILLING_FUNDS_REQUIRED_S (one hour) of everything the renter would then
    be paying for, not of the new instance alone. `lock` is for the check inside a booking or start
    transaction (_check_funds); pages read without it.
    """
    # The wallet first: with `lock`, a booking or start of the same renter that held the lock has
    # committed when this returns, and the read of the instances below sees what it added.
    balance = wallet_balance(user_id=renter_id, lock=lock)
    return funds_of(balance_micros=balance, committed_rate_micros=committed_rate_micros(renter_id=renter_id),
                    price_per_hour_micros=price_per_hour_micros)


def funds_of(*, balance_micros: int, committed_rate_micros: int, price_per_hour_micros: int) -> Funds:
    """The rule on figures already read: the balance (under the wallet's lock, for a check) and the committed
    rate (read after that lock was granted)."""
    balance, committed = balance_micros, committed_rate_micros
    required = funds_required_micros(price_per_hour_micros=committed + price_per_hour_micros)
    enforced = settings.BILLING_REQUIRE_FUNDS
    return Funds(balance_micros=balance, committed_rate_micros=committed, added_rate_micros=price_per_hour_micros,
                 required_micros=required, missing_micros=max(required - balance, 0) if enforced else 0,
                 required_s=settings.BILLING_FUNDS_REQUIRED_S, enforced=enforced)


def _check_funds(renter_id: int, price_per_hour_micros: int, what: str) -> None:
    """Renting or starting needs BILLING_FUNDS_REQUIRED_S (one hour) of the renter's whole burn rate with it.

    Race safety: the check runs inside the booking's (or start's) transaction and first locks the renter's
    wallet row, so two bookings of one renter run it one after the other and the second counts the first's
    instance. The wallet row, not the user or billing profile: it is the row every charge to this renter
    locks already (ledger_post, the meter), it is locked last and alone here (after the node's share lock
    or the instance's lock; a start bills the stopped disk before, which takes it in id order with the other
    accounts), so it adds no lock-order cycle, and other renters never wait for it.
    """
    if not settings.BILLING_REQUIRE_FUNDS:
        return
    funds_refuse_if_short(funds_for(renter_id=renter_id, price_per_hour_micros=price_per_hour_micros, lock=True),
                          what)


def funds_refuse_if_short(funds: Funds, what: str) -> None:
    """InsufficientFunds (402, with the figures) when the balance does not cover the rule."""
    if funds.missing_micros:
        raise InsufficientFunds(f"{what} needs {_funds_span(funds.required_s)} of what your instances cost "
                                f"in your balance. {_funds_figures(funds)} (POST /api/v1/billing/top-ups/).",
                                funds)


def _funds_span(seconds: int) -> str:
    hours = seconds / 3600
    return "one hour" if hours == 1 else f"{hours:g} hours"


def _funds_figures(funds: Funds) -> str:
    span = _funds_span(funds.required_s)
    added = f"{usd_text(funds.added_rate_micros)}/h"
    if funds.committed_rate_micros:
        rate = (f"Your running and starting instances cost {usd_text(funds.committed_rate_micros)}/h; "
                f"with this one {usd_text(funds.rate_micros)}/h")
    else:
        rate = f"This instance costs {added}"
    return (f"{rate}; {span} needs {usd_text(funds.required_micros)}. Your balance is "
            f"{usd_text(funds.balance_micros)}; top up at least {usd_text(funds.missing_micros)}")


