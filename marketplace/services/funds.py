"""The funds check: a renter's balance against an hour of everything they would be paying for (402 when short):
their instances' GPU time and their storage (volumes, stopped instances' disks), with the instance or volume being
rented. One rule for instances and volumes (marketplace.services.volumes checks a new volume with it)."""
from dataclasses import dataclass

from django.conf import settings
from django.db import connection
from django.db.models import F, Sum

from billing.services.ledger import funds_required_micros, wallet_balance
from core.errors import PaymentRequired
from core.money import usd_rate_text, usd_text, usd_text_up
from core.sql import prepared_cursor
from marketplace.models import Instance, InstanceStatus, Volume
from marketplace.models.host import SECONDS_PER_MONTH
from marketplace.models.renting import RATE_COUNTED_STATUSES
from marketplace.models.volumes import COMMITTED_VOLUME_STATES

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
# Storage counts too, by billing.selectors.storage_burn_per_hour's rule (available volumes and stopped instances'
# disks at their size and price, the sum per GB-month turned into an hour once per renter, rounded down), plus the
# volumes being created: billed once their job is done, with no other check (as a requested instance is). A
# renter carrying large volumes could otherwise rent on one hour of GPU time alone, and a volume was checked
# against nothing but a balance above zero (found by review: one cent bought any number of 64 TiB volumes).
# Starting a stopped instance leaves its own disk out: it stops being billed as storage once the instance runs.
# (COMMITTED_VOLUME_STATES, models/volumes.py: its node's disk room counts the same volumes.)


@dataclass(frozen=True)
class Funds:
    """A renter's balance against BILLING_FUNDS_REQUIRED_S of their whole burn rate with one more instance (or
    volume: `thing`)."""

    balance_micros: int
    committed_rate_micros: int  # per hour: their instances in COMMITTED_STATUSES and their storage
    added_rate_micros: int  # per hour: the instance (or volume) being rented or started
    required_micros: int  # BILLING_FUNDS_REQUIRED_S of both together
    missing_micros: int  # 0 when the balance covers it, or when funds are not required
    required_s: int
    enforced: bool  # BILLING_REQUIRE_FUNDS
    thing: str = "instance"  # what is being rented, for the words: "instance" or "volume"

    @property
    def rate_micros(self) -> int:
        return self.committed_rate_micros + self.added_rate_micros


def committed_rate_micros(*, renter_id: int, starting: int | None = None) -> int:
    """What the renter pays per hour for what they have and what is about to be billed: their instances in
    COMMITTED_STATUSES, and their storage (COMMITTED_VOLUME_STATES volumes, stopped instances' disks but the disk
    of the instance `starting`)."""
    if connection.vendor == "postgresql":  # every booking runs it: the SQL once, not an aggregate compiled each time
        with prepared_cursor() as cursor:
            if starting is None:
                cursor.execute(COMMITTED_RATE_SQL, [renter_id])
            else:
                cursor.execute(_COMMITTED_RATE_STARTING_SQL, [renter_id, starting])
            return int(cursor.fetchone()[0])
    instances = (Instance.objects.filter(renter_id=renter_id, status__in=COMMITTED_STATUSES).order_by()
                 .aggregate(rate=Sum("price_per_hour_micros"))["rate"] or 0)
    volumes = (Volume.objects.filter(owner_id=renter_id, state__in=COMMITTED_VOLUME_STATES).order_by()
               .aggregate(gb=Sum(F("size_gb") * F("price_per_gb_month_micros")))["gb"] or 0)
    stopped = Instance.objects.filter(renter_id=renter_id, status=S.STOPPED)
    if starting is not None:
        stopped = stopped.exclude(pk=starting)
    disks = stopped.order_by().aggregate(gb=Sum(F("disk_gb") * F("disk_price_per_gb_month_micros")))["gb"] or 0
    return instances + (volumes + disks) * 3600 // SECONDS_PER_MONTH


def _sql_in(values: tuple[str, ...]) -> str:
    return ", ".join(f"'{value}'" for value in values)  # the code's own constants, never input


assert set(COMMITTED_STATUSES) | {S.STOPPED} == set(RATE_COUNTED_STATUSES)  # the partial index holds what is summed


def _committed_rate_sql(*, starting: bool) -> str:
    """[renter_id(, the id of the instance starting)] -> one column: the committed rate. One pass over the renter's
    counted instances (the partial index instance_renter_live_idx: the statuses are written into the SQL, so that
    even a generic plan of the prepared statement can use it), summing their GPU time and their disks; the storage
    part sums GB × price per GB-month in numeric (no bigint overflow), as the selector does."""
    instance, volume = Instance._meta.db_table, Volume._meta.db_table
    skip = " AND i.id <> r.skip" if starting else ""
    return (f"SELECT COALESCE(SUM(i.price_per_hour_micros) FILTER (WHERE "  # noqa: S608 (our constants)
            f"i.status IN ({_sql_in(COMMITTED_STATUSES)})), 0) + FLOOR(("
            f"COALESCE((SELECT SUM(size_gb::numeric * price_per_gb_month_micros) FROM {volume} "
            f"WHERE owner_id = r.id AND state IN ({_sql_in(COMMITTED_VOLUME_STATES)})), 0) + "
            f"COALESCE(SUM(i.disk_gb::numeric * i.disk_price_per_gb_month_micros) FILTER (WHERE "
            f"i.status = '{S.STOPPED.value}'{skip}), 0)) * 3600 / {SECONDS_PER_MONTH})::bigint "
            f"FROM (SELECT %s::bigint AS id{', %s::bigint AS skip' if starting else ''}) r "
            f"LEFT JOIN {instance} i ON i.renter_id = r.id AND i.status IN ({_sql_in(RATE_COUNTED_STATUSES)}) "
            f"GROUP BY r.id{', r.skip' if starting else ''}")


# A booking's own statement reads it too (allocation.py), after the wallet's lock: [renter_id].
COMMITTED_RATE_SQL = _committed_rate_sql(starting=False)
_COMMITTED_RATE_STARTING_SQL = _committed_rate_sql(starting=True)


def funds_for(*, renter_id: int, price_per_hour_micros: int, lock: bool = False, thing: str = "instance",
              starting: int | None = None) -> Funds:
    """The funds check's figures for renting (or starting) one more instance (or volume) at this hourly price.

    The rule: the balance must hold BILLING_FUNDS_REQUIRED_S (one hour) of everything the renter would then
    be paying for, not of the new instance alone. `lock` is for the check inside a booking, start or volume
    creation transaction (_check_funds); pages read without it. `starting`: the stopped instance being started
    (its disk, billed as storage until then, is not counted with its GPU time).
    """
    # The wallet first: with `lock`, a booking or start of the same renter that held the lock has
    # committed when this returns, and the read of the instances below sees what it added.
    balance = wallet_balance(user_id=renter_id, lock=lock)
    return funds_of(balance_micros=balance,
                    committed_rate_micros=committed_rate_micros(renter_id=renter_id, starting=starting),
                    price_per_hour_micros=price_per_hour_micros, thing=thing)


def funds_of(*, balance_micros: int, committed_rate_micros: int, price_per_hour_micros: int,
             thing: str = "instance") -> Funds:
    """The rule on figures already read: the balance (under the wallet's lock, for a check) and the committed
    rate (read after that lock was granted)."""
    balance, committed = balance_micros, committed_rate_micros
    required = funds_required_micros(price_per_hour_micros=committed + price_per_hour_micros)
    enforced = settings.BILLING_REQUIRE_FUNDS
    return Funds(balance_micros=balance, committed_rate_micros=committed, added_rate_micros=price_per_hour_micros,
                 required_micros=required, missing_micros=max(required - balance, 0) if enforced else 0,
                 required_s=settings.BILLING_FUNDS_REQUIRED_S, enforced=enforced, thing=thing)


def _check_funds(renter_id: int, price_per_hour_micros: int, what: str, *, starting: int | None = None) -> None:
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
    funds_refuse_if_short(funds_for(renter_id=renter_id, price_per_hour_micros=price_per_hour_micros, lock=True,
                                    starting=starting), what)


def funds_refuse_if_short(funds: Funds, what: str) -> None:
    """InsufficientFunds (402, with the figures) when the balance does not cover the rule."""
    if funds.missing_micros:
        raise InsufficientFunds(f"{what} needs {_funds_span(funds.required_s)} of what your instances and "
                                f"storage cost in your balance. {_funds_figures(funds)} "
                                "(POST /api/v1/billing/top-ups/).", funds)


def _funds_span(seconds: int) -> str:
    hours = seconds / 3600
    return "one hour" if hours == 1 else f"{hours:g} hours"


def _funds_figures(funds: Funds) -> str:
    span = _funds_span(funds.required_s)
    # Prices per hour exact, as the offer and the pages show them (usd_rate_text); amounts in cents.
    added = f"{usd_rate_text(funds.added_rate_micros)}/h"
    if funds.committed_rate_micros:
        rate = (f"Your running and starting instances and your storage cost "
                f"{usd_rate_text(funds.committed_rate_micros)}/h; with this one {usd_rate_text(funds.rate_micros)}/h")
    else:
        rate = f"This {funds.thing} costs {added}"
    # What must be reached reads rounded up: topping up the shortfall it names is enough.
    return (f"{rate}; {span} needs {usd_text_up(funds.required_micros)}. Your balance is "
            f"{usd_text(funds.balance_micros)}; top up at least {usd_text_up(funds.missing_micros)}")


