"""Metering: charge running instances per second at their price snapshot, in balanced ledger transactions.

An instance is billed while it is `running`: from `started_at` (when it last became running) until it
leaves that state (a stop, restart or destroy request, or a failure), in whole seconds counted from
`started_at` (the last part-second of a run is not billed; a run begins no earlier than what was billed, whatever
the clock of the host that starts it says, so every interval is whole seconds). Nothing is billed while it is
requested, provisioning, starting, stopping or stopped: a failed provisioning never ran and costs nothing. A stopped
instance's disk, and volumes, are storage: billed apart (billing.services.storage).

The tick bills no further than the last moment the instance's node was seen healthy (`Node.last_seen_at`,
written by every successful health check): time after a node stopped answering is never billed (when it
answers again the meter catches up; when its instances are interrupted, their billing closes at that moment,
see marketplace.services.instances.interruptions). A check that finds a VM gone or stopped, or a card missing,
moves `last_seen_at` only once it has interrupted those instances (provisioning.services.fleet_record): moved first,
a tick between the two billed the lost instance past the check that last saw it, and the interruption, which closes
billing there, gives nothing back. A stop (restart, destroy) asked between such a check's answer and its
interruption bills up to its moment and is not interrupted: what it billed after the last sighting is given back
(usage_give_back, a partial reversal of the charges). A state change bills up to its moment, or, while the node's
latest health check failed or the platform no longer checks it, up to its last healthy moment (node_billable_until).

Each closed stretch of time is a `UsageInterval` [start, end) with one ledger transaction: the
renter's wallet pays `amount`, the provider earns `amount - fee`, the platform keeps `fee`. Rounding
is cumulative over the instance's whole life, so totals do not depend on how often the meter runs:

    cost(S seconds) = floor(price_per_hour_micros × S / 3600)
    fee(S seconds)  = floor(cost(S) × platform_fee_bps / 10000)
    an interval from S0 to S1 billed seconds charges cost(S1) - cost(S0) and keeps fee(S1) - fee(S0).

Each interval is written in one database transaction with the instance row locked (the interval, its
ledger transaction and entries, the balances, and the instance's `billed_until` / `billed_seconds` /
`cost_micros`): a crash leaves either all of it or none, and the next run starts from `billed_until`
again, so no second is lost or charged twice. The unique constraints (instance + interval start;
the ledger idempotency key `usage:<instance>:<start in µs>`) make a second writer fail rather than
double-charge.

Two ways to run the per-minute tick, with the same results:
- PostgreSQL: set-based SQL in batches of running instances locked FOR UPDATE SKIP LOCKED (instances a
  state change holds right now are billed by that change or the next tick), under an advisory lock
  (core.locks) so that one tick runs at a time;
- any other database (the SQLite first-run default): one short transaction per instance.
"""
import logging
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import F, Sum
from django.utils import timezone

from billing.models import Account, AccountKind, Entry, LedgerTransaction, TransactionKind, UsageInterval
from billing.pricing import (  # noqa: F401 (the arithmetic is imported from here too)
    EPOCH,
    MICROSECOND,
    NODE_BILLING_FIELDS,
    SECOND,
    UNSEEN_NODE_STATES,
    Charge,
    billable_until,
    cost_for,
    fee_for,
    fee_percent,
    instance_cost_at,
    instance_cost_so_far,
    next_charge,
    platform_fee_bps,
    usage_key,
)
from billing.services.ledger import LedgerError, ledger_post, platform_account, user_account
from core.locks import advisory_lock, lock_key
from marketplace.models import Instance, InstanceStatus, Node

log = logging.getLogger(__name__)

ADVISORY_LOCK_NAME = "billing.usage_meter"  # one metering tick at a time (core.locks.advisory_lock)
ADVISORY_LOCK_KEY = lock_key(ADVISORY_LOCK_NAME)


# ------------------------------------------------------------------------- one instance (services)


def node_billable_until(*, node_id: int, now: datetime) -> datetime:
    """Where a charge closed by a state change (a stop, a destroy, a failure) ends: `now`, or the node's last
    healthy moment while its latest health check failed or the platform no longer checks it (UNSEEN_NODE_STATES).
    Time after a node stopped answering is never billed, a stop asked in the checks before the interruption
    included; while the node answers, the change's moment. (Before, a stop on a quarantined node, whose checks had
    stopped without a failure, was billed up to the stop: hours of a VM nobody could see.)"""
    row = Node.objects.filter(pk=node_id).values_list("last_seen_at", "health_failures", "state").first()
    if row is None:
        return now
    last_seen, failures, state = row
    return billable_until(now=now, last_seen_at=last_seen, health_failures=failures, state=state)


def usage_close(*, instance: Instance, until: datetime | None = None) -> UsageInterval | None:
    """Charge a running instance's usage up to `until` (now): the final interval of a run, or a tick's.

    Call it inside the transaction that holds the instance's row lock (instance services do, at the
    moment the instance leaves `running`). Updates `instance` in memory and in the database.
    Returns the interval, or None when there was not a whole second to bill.
    """
    until = until or timezone.now()
    charge = next_charge(instance, until)
    if charge is None:
        return None
    with transaction.atomic():
        txn = None
        if charge.amount > 0:
            provider_id = Node.objects.values_list("provider_id", flat=True).get(pk=instance.node_id)
            lines = [(user_account(user_id=instance.renter_id, kind=AccountKind.CUSTOMER_WALLET), -charge.amount)]
            if charge.amount - charge.fee:
                lines.append((user_account(user_id=provider_id, kind=AccountKind.PROVIDER_EARNINGS),
                              charge.amount - charge.fee))
            if charge.fee:
                lines.append((platform_account(kind=AccountKind.PLATFORM_REVENUE), charge.fee))
            txn, created = ledger_post(
                idempotency_key=usage_key(instance.pk, charge.start), kind=TransactionKind.USAGE, lines=lines,
                memo=f"Instance {instance.pk}: {charge.seconds} s",
            )
            if not created:  # the instance row said otherwise: refuse rather than charge twice
                raise LedgerError(f"instance {instance.pk}: usage from {charge.start} was already posted")
        interval = UsageInterval.objects.create(
            instance_id=instance.pk, started_at=charge.start, ended_at=charge.end, seconds=charge.seconds,
            price_per_hour_micros=instance.price_per_hour_micros, platform_fee_bps=instance.platform_fee_bps,
            amount_micros=charge.amount, fee_micros=charge.fee, transaction=txn,
            created_at=txn.created_at if txn is not None else timezone.now(),
        )
        Instance.objects.filter(pk=instance.pk).update(
            billed_until=charge.end, billed_seconds=F("billed_seconds") + charge.seconds,
            cost_micros=F("cost_micros") + charge.amount,
        )
    instance.billed_until = charge.end
    instance.billed_seconds += charge.seconds
    instance.cost_micros += charge.amount
    return interval


# ------------------------------------------------------------------------ usage billed past a loss


@dataclass(frozen=True)
class GivenBack:
    amount_micros: int  # back to the renter's wallet
    fee_micros: int  # of it, taken back from the platform's revenue (the rest from the provider's earnings)
    seconds: int
    start: datetime  # the whole second of the run at or before `since`: the renter's charge for that run ends here
    end: datetime  # where the run's billing had ended
    transactions: list[int]  # the reversals posted, one per charge (usage interval) involved


def usage_give_back(*, instance: Instance, since: datetime, seen_at: datetime, memo: str,
                    customer_note: str) -> GivenBack | None:
    """Give back what a run of the instance was billed for its time after `since`: the run it was in when a look
    at its node (a health probe, the reconciler's list) began at `seen_at` and found its VM (or card) lost, last
    seen at `since`, when its billing was closed after that look began by something other than the interruption
    (a stop, restart or destroy, a failure): the interruption, which would have closed it at `since`, found it no
    longer running. None, and nothing posted, when there is nothing to give back: its run began at or after
    `seen_at`, its billing was closed before the look began (it was not running then: its VM may have been
    stopped by its own stop), it was billed nothing after `since`, or it was given back already.

    The renter's charge for the run ends where a close at `since` would have ended it (its last whole second at or
    before `since`), to the micro-dollar with the meter's cumulative rounding (cost and fee alike): each usage
    charge after that point is reversed in full, the one across it in part, each by one REVERSAL transaction
    (`reverses` it: at most once, ledger key `reversal:<id>`, as an operator's reversal), the renter's wallet
    credited, the provider's earnings and the platform's revenue debited in the proportions the charge used. The
    instance's own totals and intervals stay what was charged (as after an operator's reversal); the seconds given
    back are added to its `given_back_seconds` in the same transaction (its seconds paid for: billed_seconds less
    them, what its page and the API show; before, they showed the seconds charged). Call it under the
    instance's row lock, as every writer of its billing; the accounts are locked in id order by ledger_post.

    In the same transaction the meter is re-based at the seconds paid for (_rebase_after_give_back: the rate base,
    rate_base_*, moves on by the seconds given back and what they were charged), so that a later run of the
    instance costs what the seconds paid for cost at the cumulative rounding, cost(paid + s) - cost(paid), in the
    meter's tick (SQL or not), a state change's close and the live cost alike; before, it went on from the seconds
    charged, cost(billed + s) - cost(billed), at most one micro-dollar off. cost_micros == rate_base_cost_micros +
    cost(billed_seconds - rate_base_seconds) still holds (tests/billing/invariants.py).

    Exceptions to the micro-dollar: a charge across `since` that was made before a later price change of the
    instance (a re-check cutting or raising it in between) is split as if its own start were a base of the
    cumulative rounding (the base it had is not kept): at most one micro-dollar from the exact split; the meter then
    takes a fresh base at the seconds charged, as a price change does (no second paid for is left at the new price).
    And a run already billed past the run given back (begun after the look, metered before the give-back) keeps
    the base it was charged at: the meter is not re-based (its total can be one micro-dollar from the seconds paid
    for, as before). The platform's fee on later runs goes on from the cost charged (fee(cost_micros)), as before."""
    later = list(UsageInterval.objects.filter(instance_id=instance.pk, ended_at__gt=since).order_by("started_at"))
    if instance.started_at is not None and instance.started_at >= seen_at:
        later = [i for i in later if i.started_at < instance.started_at]  # a run begun after the look: not judged
    if not later:
        return None
    run = [later[-1]]  # the last run with time billed after `since`: its intervals follow each other exactly
    for interval in reversed(later[:-1]):
        if interval.ended_at != run[0].started_at:
            break
        run.insert(0, interval)
    if run[0].started_at >= seen_at or run[-1].created_at < seen_at:
        return None  # begun after the look, or closed before it (created_at: the moment a state change closed it)
    charged = [i for i in run if i.transaction_id is not None]
    if not charged or LedgerTransaction.objects.filter(reverses_id__in=[i.transaction_id for i in charged]).exists():
        return None  # nothing was charged, or given back (or reversed by an operator) already
    first = run[0]
    cut = first.started_at if since <= first.started_at else \
        first.started_at + ((since - first.started_at) // SECOND) * SECOND
    before = UsageInterval.objects.filter(instance_id=instance.pk, started_at__lt=first.started_at).aggregate(
        seconds=Sum("seconds"), amount=Sum("amount_micros"))
    billed_seconds, cost = before["seconds"] or 0, before["amount"] or 0  # the instance's totals where run begins
    back: list[tuple[UsageInterval, int, int]] = []  # (interval, amount back, fee back)
    for interval in run:
        if interval.ended_at > cut:
            if interval.started_at >= cut:
                back.append((interval, interval.amount_micros, interval.fee_micros))
            else:  # across it: the seconds before `cut` stay charged, by the meter's arithmetic
                kept_seconds = (cut - interval.started_at) // SECOND
                if instance.rate_base_seconds <= billed_seconds:  # no price change since this charge: exact
                    kept = instance_cost_at(instance, billed_seconds + kept_seconds) - cost
                else:
                    kept = cost_for(interval.price_per_hour_micros, kept_seconds)
                kept = min(max(kept, 0), interval.amount_micros)
                fee_kept = fee_for(cost + kept, interval.platform_fee_bps) - fee_for(cost, interval.platform_fee_bps)
                back.append((interval, interval.amount_micros - kept, interval.fee_micros - fee_kept))
        billed_seconds += interval.seconds
        cost += interval.amount_micros
    back = [(interval, amount, fee) for interval, amount, fee in back if amount > 0]
    seconds = (run[-1].ended_at - cut) // SECOND
    base = instance.rate_base_seconds, instance.rate_base_cost_micros
    try:
        with transaction.atomic():
            posted = [_reverse_in_part(instance, interval, amount, fee, memo, customer_note)
                      for interval, amount, fee in back]
            if posted:  # the seconds paid for, which pages and the API show: billed_seconds - given_back_seconds
                if run[-1].ended_at == instance.billed_until:  # nothing billed since the run given back
                    base = _rebase_after_give_back(instance, seconds)
                Instance.objects.filter(pk=instance.pk).update(
                    given_back_seconds=F("given_back_seconds") + seconds, rate_base_seconds=base[0],
                    rate_base_cost_micros=base[1])
    except (IntegrityError, _ReversedMeanwhile):  # an operator's reversal of one of them came first: all undone
        return None
    if not posted:
        return None
    instance.given_back_seconds += seconds
    instance.rate_base_seconds, instance.rate_base_cost_micros = base
    return GivenBack(amount_micros=sum(a for _, a, _ in back), fee_micros=sum(f for _, _, f in back),
                     seconds=seconds, start=cut, end=run[-1].ended_at, transactions=posted)


def _rebase_after_give_back(instance: Instance, seconds: int) -> tuple[int, int]:
    """The meter's rate base (rate_base_seconds, rate_base_cost_micros) once the last `seconds` the instance was
    billed are given back: the base moves on by them, its cost by what they were charged, so that the next seconds
    cost cost(paid + s) - cost(paid) from the seconds paid for since the base (paid = billed_seconds - base's
    seconds), where they cost cost(billed + s) - cost(billed) before; cost_micros is still the base's cost plus
    the cumulative cost of the seconds billed after it. When the seconds given back reach before the base (a price
    change during the run given back), none paid for are left at this price: a fresh base at the seconds charged,
    as a price change makes (instances.pricing)."""
    base_seconds = instance.rate_base_seconds + seconds
    if base_seconds > instance.billed_seconds:
        return instance.billed_seconds, instance.cost_micros
    return base_seconds, instance.cost_micros - cost_for(instance.price_per_hour_micros,
                                                         instance.billed_seconds - base_seconds)


# The reason of each reversal a give-back posts (what tells them from an operator's: tests/billing/invariants.py).
GIVE_BACK_REASON = "Usage billed after the last sighting of a VM found lost, given back (metering.usage_give_back)."


class _ReversedMeanwhile(Exception):
    pass


def _reverse_in_part(instance: Instance, interval: UsageInterval, amount: int, fee: int, memo: str,
                     customer_note: str) -> int:
    """Reverse `amount` of an interval's charge, `fee` of it the platform's, on the accounts the charge used."""
    assert interval.transaction_id is not None  # an amount to give back was charged
    txn = LedgerTransaction.objects.get(pk=interval.transaction_id)
    accounts = {e.account.kind: e.account for e in txn.entries.select_related("account")}
    lines = [(accounts.get(AccountKind.CUSTOMER_WALLET)
              or user_account(user_id=instance.renter_id, kind=AccountKind.CUSTOMER_WALLET), amount)]
    if amount - fee:
        provider_id = Node.objects.values_list("provider_id", flat=True).get(pk=instance.node_id)
        lines.append((accounts.get(AccountKind.PROVIDER_EARNINGS)
                      or user_account(user_id=provider_id, kind=AccountKind.PROVIDER_EARNINGS), -(amount - fee)))
    if fee:
        lines.append((accounts.get(AccountKind.PLATFORM_REVENUE)
                      or platform_account(kind=AccountKind.PLATFORM_REVENUE), -fee))
    whole = "" if amount == interval.amount_micros else f" ({amount} of its {interval.amount_micros} micro-dollars)"
    reversal, created = ledger_post(
        idempotency_key=f"reversal:{txn.pk}", kind=TransactionKind.REVERSAL, lines=lines, reverses=txn,
        memo=f"Reverses #{txn.pk}{whole}: {memo}", customer_note=customer_note,
        reason=GIVE_BACK_REASON)
    if not created:
        raise _ReversedMeanwhile(txn.pk)
    return reversal.pk


# ------------------------------------------------------------------------------------- the tick


@dataclass
class MeterResult:
    instances: int = 0  # running instances looked at
    intervals: int = 0  # intervals closed
    charged_micros: int = 0
    skipped: bool = False  # another tick was running


def usage_meter(*, now: datetime | None = None, batch_size: int | None = None,
                set_based: bool | None = None) -> MeterResult:
    """Close the usage of every running instance up to `now`: the per-minute tick."""
    now = now or timezone.now()
    if set_based is None:
        set_based = connection.vendor == "postgresql"
    if set_based:
        return _meter_postgresql(now, batch_size or settings.BILLING_METER_BATCH_SIZE)
    return _meter_each(now)


def _meter_each(now: datetime) -> MeterResult:
    result = MeterResult()
    ids = list(Instance.objects.filter(status=InstanceStatus.RUNNING, started_at__isnull=False)
               .order_by("pk").values_list("pk", flat=True))
    for instance_id in ids:
        with transaction.atomic():
            instance = (Instance.objects.select_for_update(skip_locked=True)
                        .filter(pk=instance_id, status=InstanceStatus.RUNNING).first())
            if instance is None:
                continue
            result.instances += 1
            seen = Node.objects.values_list("last_seen_at", flat=True).get(pk=instance.node_id)
            interval = usage_close(instance=instance, until=min(now, seen or now))
            if interval is not None:
                result.intervals += 1
                result.charged_micros += interval.amount_micros
    return result


def _tables() -> dict[str, str]:
    q = connection.ops.quote_name
    return {
        "instance": q(Instance._meta.db_table), "node": q(Node._meta.db_table),
        "account": q(Account._meta.db_table), "txn": q(LedgerTransaction._meta.db_table),
        "entry": q(Entry._meta.db_table), "interval": q(UsageInterval._meta.db_table),
    }


# The batch, step by step, all in one database transaction. Temp table "billing_tick" holds one row per
# running instance locked by this batch; "billing_post" one row per ledger transaction to post, with its
# accounts and its id taken from the sequence beforehand. Each is written once (no UPDATE of either: every
# UPDATE of a temp table rewrites its rows).
_LOCK_AND_COMPUTE = """
CREATE TEMP TABLE billing_tick (
    instance_id bigint PRIMARY KEY, renter_id bigint NOT NULL, provider_id bigint NOT NULL,
    price bigint NOT NULL, bps integer NOT NULL, from_ts timestamptz NOT NULL, end_ts timestamptz NOT NULL,
    seconds bigint NOT NULL, amount bigint NOT NULL, fee bigint NOT NULL, key text NOT NULL
) ON COMMIT DROP;
WITH locked AS (
    SELECT i.id, i.renter_id, n.provider_id, i.price_per_hour_micros AS price, i.platform_fee_bps AS bps,
           i.billed_seconds, i.cost_micros, i.rate_base_seconds, i.rate_base_cost_micros,
           GREATEST(COALESCE(i.billed_until, i.started_at), i.started_at) AS from_ts,
           i.started_at + floor(extract(epoch FROM (LEAST(%(now)s, COALESCE(n.last_seen_at, %(now)s))
                                                    - i.started_at)))::bigint * interval '1 second' AS end_ts
    FROM {instance} i JOIN {node} n ON n.id = i.node_id
    WHERE i.status = %(running)s AND i.started_at IS NOT NULL AND i.id > %(after)s
    ORDER BY i.id
    LIMIT %(limit)s
    FOR UPDATE OF i SKIP LOCKED
), timed AS (
    -- floor, as Python's //: a numeric's cast to bigint rounds (10.5 s charged as 11)
    SELECT *, GREATEST(floor(extract(epoch FROM (end_ts - from_ts)))::bigint, 0) AS seconds FROM locked
), costed AS (
    SELECT *, rate_base_cost_micros + price * (billed_seconds + seconds - rate_base_seconds) / 3600 AS new_cost
    FROM timed
)
INSERT INTO billing_tick (instance_id, renter_id, provider_id, price, bps, from_ts, end_ts, seconds, amount, fee, key)
SELECT id, renter_id, provider_id, price, bps, from_ts, end_ts, seconds, new_cost - cost_micros,
       new_cost * bps / 10000 - cost_micros * bps / 10000,
       'usage:' || id || ':' || (extract(epoch FROM from_ts) * 1000000)::bigint
FROM costed;
"""

_POST = """
INSERT INTO {account} (kind, user_id, balance_micros, created_at)
SELECT %(wallet)s, renter_id, 0, %(now)s FROM billing_tick t WHERE seconds > 0 AND amount > 0
AND NOT EXISTS (SELECT 1 FROM {account} a WHERE a.kind = %(wallet)s AND a.user_id = t.renter_id)
GROUP BY renter_id ON CONFLICT DO NOTHING;
INSERT INTO {account} (kind, user_id, balance_micros, created_at)
SELECT %(earnings)s, provider_id, 0, %(now)s FROM billing_tick t WHERE seconds > 0 AND amount > fee
AND NOT EXISTS (SELECT 1 FROM {account} a WHERE a.kind = %(earnings)s AND a.user_id = t.provider_id)
GROUP BY provider_id ON CONFLICT DO NOTHING;
CREATE TEMP TABLE billing_post ON COMMIT DROP AS
SELECT t.instance_id, t.key, t.seconds, t.amount, t.fee, w.id AS wallet_id, e.id AS earnings_id,
       nextval(pg_get_serial_sequence('{txn}', 'id')) AS txn_id
FROM billing_tick t
LEFT JOIN {account} w ON w.kind = %(wallet)s AND w.user_id = t.renter_id  -- never missing; if it were: NOT NULL fails
LEFT JOIN {account} e ON e.kind = %(earnings)s AND e.user_id = t.provider_id AND t.amount > t.fee
WHERE t.seconds > 0 AND t.amount > 0;
SELECT count(*) FROM (
    SELECT id FROM {account}
    WHERE id IN (SELECT wallet_id FROM billing_post UNION SELECT earnings_id FROM billing_post) OR id = %(revenue)s
    ORDER BY id FOR UPDATE
) locked_accounts;
INSERT INTO {txn} (id, idempotency_key, kind, memo, reason, created_by_id, reverses_id, created_at)
SELECT txn_id, key, %(usage)s, 'Instance ' || instance_id || ': ' || seconds || ' s', '', NULL, NULL, %(now)s
FROM billing_post;
INSERT INTO {entry} (transaction_id, account_id, amount_micros)
SELECT txn_id, wallet_id, -amount FROM billing_post
UNION ALL
SELECT txn_id, earnings_id, amount - fee FROM billing_post WHERE amount > fee
UNION ALL
SELECT txn_id, %(revenue)s, fee FROM billing_post WHERE fee > 0;
UPDATE {account} a SET balance_micros = a.balance_micros + d.delta
FROM (
    SELECT account_id, sum(delta) AS delta FROM (
        SELECT wallet_id AS account_id, -amount AS delta FROM billing_post
        UNION ALL
        SELECT earnings_id, amount - fee FROM billing_post WHERE amount > fee
        UNION ALL
        SELECT %(revenue)s, fee FROM billing_post WHERE fee > 0
    ) deltas GROUP BY account_id
) d
WHERE a.id = d.account_id;
INSERT INTO {interval} (instance_id, started_at, ended_at, seconds, price_per_hour_micros, platform_fee_bps,
                        amount_micros, fee_micros, transaction_id, created_at)
SELECT t.instance_id, t.from_ts, t.end_ts, t.seconds, t.price, t.bps, t.amount, t.fee, p.txn_id, %(now)s
FROM billing_tick t LEFT JOIN billing_post p ON p.instance_id = t.instance_id WHERE t.seconds > 0;
UPDATE {instance} i
SET billed_until = t.end_ts, billed_seconds = i.billed_seconds + t.seconds, cost_micros = i.cost_micros + t.amount
FROM billing_tick t WHERE i.id = t.instance_id AND t.seconds > 0;
DROP TABLE billing_post;
"""


def _statements(sql: str) -> list[str]:
    return [s.strip() for s in sql.format(**_tables()).split(";\n") if s.strip()]


def _meter_postgresql(now: datetime, batch_size: int) -> MeterResult:
    result = MeterResult()
    with advisory_lock(ADVISORY_LOCK_NAME) as acquired:
        if not acquired:
            result.skipped = True
            return result
        with connection.cursor() as cursor:
            revenue_id = platform_account(kind=AccountKind.PLATFORM_REVENUE).pk
            params: dict[str, datetime | str | int] = {
                "now": now, "running": InstanceStatus.RUNNING, "wallet": AccountKind.CUSTOMER_WALLET,
                "earnings": AccountKind.PROVIDER_EARNINGS, "revenue": revenue_id, "usage": TransactionKind.USAGE,
                "limit": batch_size,
            }
            after = 0
            while True:
                with transaction.atomic():
                    # Still there when the tick runs inside an outer transaction (ON COMMIT DROP acts at its COMMIT).
                    cursor.execute("DROP TABLE IF EXISTS pg_temp.billing_tick, pg_temp.billing_post")
                    for sql in _statements(_LOCK_AND_COMPUTE):
                        cursor.execute(sql, {**params, "after": after})
                    cursor.execute("SELECT count(*), max(instance_id), count(*) FILTER (WHERE seconds > 0), "
                                   "coalesce(sum(amount) FILTER (WHERE seconds > 0), 0) FROM billing_tick")
                    locked, last_id, intervals, charged = cursor.fetchone()
                    if intervals:
                        for sql in _statements(_POST):
                            cursor.execute(sql, params)
                    cursor.execute("DROP TABLE billing_tick")
                result.instances += locked
                result.intervals += intervals
                result.charged_micros += int(charged)
                if locked < batch_size:
                    break
                after = last_id
    return result
