"""The arithmetic of usage charges: the platform fee, cumulative cost and fee per billed second, and what
closing an instance's usage now would charge. Pure computations on an instance row (no writes): the metering
service posts them, selectors and pages show them. The rules are in billing/services/metering.py's docstring.
"""
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db.models import F
from django.utils import timezone

from marketplace.models import Instance, InstanceStatus, Node, NodeState

SECOND = timedelta(seconds=1)
MICROSECOND = timedelta(microseconds=1)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


# ------------------------------------------------------------------------------------------ fees


def platform_fee_bps() -> int:
    """PLATFORM_FEE_PERCENT in basis points (15 → 1500): what new bookings snapshot."""
    percent = Decimal(settings.PLATFORM_FEE_PERCENT)
    bps = percent * 100
    if bps != bps.to_integral_value() or not 0 <= bps < 10_000:
        raise ImproperlyConfigured(f"PLATFORM_FEE_PERCENT must be 0 to 99.99 with at most two decimals, not {percent}")
    return int(bps)


def fee_percent(bps: int) -> Decimal:
    return (Decimal(bps) / 100).quantize(Decimal("0.01"))


# ------------------------------------------------------------------------------------ arithmetic


def cost_for(price_per_hour_micros: int, seconds: int) -> int:
    return price_per_hour_micros * seconds // 3600


def instance_cost_at(instance: Instance, billed_seconds: int) -> int:
    """What the instance has cost after `billed_seconds` in all: cumulative rounding from its last price change."""
    return instance.rate_base_cost_micros + cost_for(instance.price_per_hour_micros,
                                                     billed_seconds - instance.rate_base_seconds)


def fee_for(cost_micros: int, bps: int) -> int:
    return cost_micros * bps // 10_000


def usage_key(instance_id: int, start: datetime) -> str:
    """The ledger idempotency key of the interval that starts at `start` (the same in SQL below)."""
    return f"usage:{instance_id}:{(start - EPOCH) // MICROSECOND}"


@dataclass(frozen=True)
class Charge:
    start: datetime
    end: datetime
    seconds: int
    amount: int
    fee: int


def next_charge(instance: Instance, until: datetime) -> Charge | None:
    """What closing the instance's usage up to `until` would charge; None when there is no whole second."""
    if instance.status != InstanceStatus.RUNNING or instance.started_at is None:
        return None
    start = max(instance.billed_until or instance.started_at, instance.started_at)
    end = instance.started_at + ((until - instance.started_at) // SECOND) * SECOND
    if end <= start:
        return None
    seconds = (end - start) // SECOND
    cost = instance_cost_at(instance, instance.billed_seconds + seconds)
    amount = cost - instance.cost_micros
    fee = fee_for(cost, instance.platform_fee_bps) - fee_for(instance.cost_micros, instance.platform_fee_bps)
    return Charge(start=start, end=end, seconds=seconds, amount=amount, fee=fee)


# Nodes the platform no longer checks: quarantined (its host key changed: neither a health check nor a job talks to
# it until an operator decides) or retired. Nothing after their last health check is known of their VMs.
UNSEEN_NODE_STATES = (NodeState.QUARANTINED, NodeState.RETIRED)

# The node's fields that say how far its instances are billable, as a queryset of instances annotates them
# (.annotate(**NODE_BILLING_FIELDS)) for instance_cost_so_far: a list reads them in its own query.
NODE_BILLING_FIELDS = {"node_last_seen_at": F("node__last_seen_at"),
                       "node_health_failures": F("node__health_failures"), "node_state": F("node__state")}


def billable_until(*, now: datetime, last_seen_at: datetime | None, health_failures: int, state: str) -> datetime:
    """How far a node's instances are billable at `now` (metering.node_billable_until's rule): `now`, or its last
    healthy moment while its latest health check failed or the platform no longer checks it."""
    if last_seen_at is None or (not health_failures and state not in UNSEEN_NODE_STATES):
        return now
    return min(now, last_seen_at)


def instance_cost_so_far(*, instance: Instance, now: datetime | None = None,
                         node: tuple[datetime | None, int, str] | None = None) -> int:
    """What the instance has cost: what was charged, plus the whole seconds of this run not metered yet, as far as
    a state change now would bill them (billable_until). Before, every second up to now, while the node was silent
    too: time never billed (the interruption closes billing at the last sighting), so the shown cost rose during an
    outage and then fell. The node's (last_seen_at, health_failures, state): `node`, or the instance's annotations
    (NODE_BILLING_FIELDS) when its queryset carried them; else one query, for a running instance only."""
    now = now or timezone.now()
    charge = next_charge(instance, now)
    if charge is None:
        return instance.cost_micros
    if node is None and hasattr(instance, "node_health_failures"):
        node = (getattr(instance, "node_last_seen_at", None), instance.node_health_failures,
                getattr(instance, "node_state", ""))
    if node is None:
        node = Node.objects.filter(pk=instance.node_id).values_list(
            "last_seen_at", "health_failures", "state").first() or (None, 0, "")
    last_seen, failures, state = node
    until = billable_until(now=now, last_seen_at=last_seen, health_failures=failures, state=state)
    if until < now:
        charge = next_charge(instance, until)
    return instance.cost_micros + (charge.amount if charge else 0)
