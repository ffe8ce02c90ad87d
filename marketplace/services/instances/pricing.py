"""What a rented instance pays when a re-verification measures its node differently from when it was booked (the
published rule: docs/ARCHITECTURE.md, GET /api/v1/billing/terms/).

- Worse (a lower score, or a rejection about its hardware): from the check on, its price is cut in proportion to
  the score measured now against the last score of a check that listed its node (instance_price_cut); a
  rejection about its own hardware cuts it to nothing.
- Better again (a later check that lists the node): the price follows the score back up, towards the price it had
  before its first cut and never above it; where the cuts compared cards (by UUID: a re-check measures the free
  cards only), by those same cards, once a check measured the ones that caused them; a rejection's full cut ends
  when the node passes again (instance_price_follow), not while the node's health checks fail. Before, a cut was
  for good: a card fallen off the bus for a minute, or a fan replaced, left every renter of the node paying the cut
  price for the rest of their rental.

Each change bills a running instance's time so far at the old price as far as the meter's tick would: up to the
node's last sighting (`Node.last_seen_at`, the last health check that saw its VMs), never past it, and re-bases the
meter there (rate_base_*: billing.services.metering keeps cumulative rounding across it); the time from that
sighting to the change is billed at the new price by the next tick, once a check has seen the VM again (a VM found
gone is interrupted from its last sighting, with nothing billed past it). Before, it billed up to the change (the
state changes' rule, node_billable_until): a VM gone since the last check was paid for up to the change, and its
interruption and credit started there (found by review). The renter is told at once (API and email).

An interrupted instance's service credit for the time lost so far is posted at the old price first
(billing.services.credits): the new price counts only for the time lost after it (before, the whole time lost was
credited at the price of the interruption's end: a cut shrank or wiped the credit for time lost before it; found by
review).

A raise re-reads the renter's balance against what they now pay (billing.services.low_balance): when it is low, or
at zero (at $0/h nothing burned, so nothing had warned), they get the low-balance warning then, the raise's message
says so, and their instances are not stopped at zero before the warning's notice (BILLING_LOW_BALANCE_WARNING_S)
has passed. Before, the next meter tick stopped them at once (found by review).
"""
import math
from collections.abc import Collection
from datetime import datetime
from fractions import Fraction

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from billing.models import BillingEvent, EventKind
from billing.services.credits import interruption_credit_before_reprice
from billing.services.low_balance import balance_recheck_on_cost_rise, billing_profile_lock
from billing.services.metering import usage_close
from billing.services.notify import event_create
from marketplace.models import Instance, Node
from marketplace.models.renting import FINAL_STATUSES
from marketplace.money import micros_to_usd, usd_rate_text
from marketplace.services.funds import COMMITTED_STATUSES

from .common import S, _locked
from .interruptions import _at

_PRICE_FIELDS = ["rate_base_seconds", "rate_base_cost_micros", "price_per_gpu_hour_micros", "price_per_hour_micros",
                 "price_before_cut_per_gpu_hour_micros", "score_before_cut", "updated_at"]


def score_share(score: float, basis: float) -> Fraction:
    """score / basis, exactly as the two scores are written (a check's score is a decimal figure): the published
    rule's "price × new score / last score". A float quotient is a hair low as often as not (41 / 80 is
    0.51249999…), and truncating the price by it took a micro-dollar off the rule's price (found by review)."""
    return Fraction(str(score)) / Fraction(str(basis))


def _exact(share: Fraction | float) -> Fraction:
    return share if isinstance(share, Fraction) else Fraction(str(share))


# A cut's cards, by UUID: [the score the listed check gave the card, what this check measured], each as a node's
# score counts it (times its check's verdict factor).
CutCards = dict[str, list[float]]


def node_instances_price_cut(*, node_id: int, ratio: Fraction | float, reason: str, score_before: float,
                             only: Collection[int] | None = None, cards: CutCards | None = None) -> list[int]:
    """Cut the price of the node's instances that are not over yet (of those in `only`, when given) to `ratio`
    (0..1) of what they pay now. `score_before`: the node's score before this check (what a later one is compared
    with to raise the price back). `cards`: the cards the cut compared, by UUID (instance_price_cut)."""
    still_open = Instance.objects.filter(node_id=node_id).exclude(status__in=FINAL_STATUSES)
    if only is not None:
        still_open = still_open.filter(pk__in=only)
    return [pk for pk in still_open.order_by("pk").values_list("pk", flat=True)
            if instance_price_cut(instance_id=pk, ratio=ratio, reason=reason, score_before=score_before,
                                  cards=cards) is not None]


def instance_price_cut(*, instance_id: int, ratio: Fraction | float, reason: str,
                       score_before: float = 0.0, cards: CutCards | None = None) -> Instance | None:
    """From now on the instance pays `ratio` of its price (rounded down once, to the micro-dollar; score_share
    gives it exactly); what ran until now is billed at the old price. None when nothing changed (over already, or
    not cheaper). Its first cut keeps the price and score before it. `cards`: the cards whose measure the cut
    compared (CutCards; None where it was not by card): kept with the cut's event, for the raise back to compare
    the same cards (instance_price_follow)."""
    ratio = min(max(_exact(ratio), Fraction(0)), Fraction(1))
    with transaction.atomic():
        instance = _locked(instance_id)
        if instance is None or instance.status in FINAL_STATUSES:
            return None
        per_gpu = math.floor(instance.price_per_gpu_hour_micros * ratio)
        if per_gpu * instance.num_gpus >= instance.price_per_hour_micros:
            return None
        if instance.price_before_cut_per_gpu_hour_micros is None:
            instance.price_before_cut_per_gpu_hour_micros = instance.price_per_gpu_hour_micros
            instance.score_before_cut = score_before
        _reprice(instance, per_gpu, kind=EventKind.PRICE_CUT,
                 measured=f"worse in its latest benchmark check ({reason})",
                 share=f"{float(ratio):.0%} of the price, in proportion to the performance measured", ratio=ratio,
                 then=" You can keep it, or destroy it and rent another server.",
                 extra={"cards": cards} if cards else None)
    return instance


def node_instances_price_follow(*, node_id: int, score: float | None, last_score: float | None = None,
                                measured: dict[str, float] | None = None) -> list[int]:
    """A check that lists the node again (verified or degraded, `score` its measure, None when every GPU was
    rented and nothing was measured; `last_score`: the last listed check's score before it; `measured`: its score
    of each card it measured, by UUID, times its verdict's factor): each of its instances whose price was cut pays
    again what the score earns, up to the price before its first cut. The ids of those whose price rose."""
    cut = (Instance.objects.filter(node_id=node_id, price_before_cut_per_gpu_hour_micros__isnull=False)
           .exclude(status__in=FINAL_STATUSES).order_by("pk").values_list("pk", flat=True))
    return [pk for pk in cut
            if instance_price_follow(instance_id=pk, score=score, last_score=last_score, measured=measured)
            is not None]


def _cut_cards(instance: Instance) -> CutCards | None:
    """The cards the instance's cuts compared since its price was last in full (its price events, newest first, up
    to the raise that put it back in full), each with the score it had before its first cut then and its latest
    cut's measure. None where a cut of that time was not by card (a rejection's, a check without UUIDs, one from
    before cuts named their cards): the raise then compares scores, as before."""
    events = (BillingEvent.objects.filter(user_id=instance.renter_id, data__instance=instance.pk,
                                          kind__in=[EventKind.PRICE_CUT, EventKind.PRICE_RAISED_BACK])
              .order_by("-created_at", "-pk").values_list("kind", "data"))
    cards: CutCards = {}
    for kind, data in events:
        if kind == EventKind.PRICE_RAISED_BACK:
            if (data or {}).get("ratio") == 1:
                break  # back in full there: the cuts before it are over
            continue
        got = (data or {}).get("cards")
        if not isinstance(got, dict) or not got:
            return None
        for uuid, (before, now) in got.items():
            # An older cut's basis is the card's score before the first cut; the newest cut's measure its latest.
            cards[uuid] = [before, cards[uuid][1] if uuid in cards else now]
    return cards or None


def _cards_share(cards: CutCards, measured: dict[str, float] | None) -> Fraction | None:
    """What the cut cards earn now against their score before the cut: their mean, each as this check measured it or,
    for one it did not measure, as its latest cut did. None (no raise) unless this check measured every card that
    caused a cut (measured below its score before by more than the tolerance) and at least one of the cards: a
    check of other cards says nothing of those (a re-check measures the free cards only). Before, a re-check that
    measured only the node's fast free cards raised the price back though the slow one was never measured again,
    and one that measured the repaired card with slower others kept part of the cut."""
    tolerance = 1 - Fraction(settings.HARDWARE_PRICE_CUT_TOLERANCE)
    measured = measured or {}
    causes = [u for u, (before, now) in cards.items() if score_share(now, before) < tolerance]
    if not any(u in measured for u in cards) or not all(u in measured for u in causes):
        return None
    now_mean = round(sum(measured.get(u, now) for u, (_, now) in cards.items()) / len(cards), 2)
    before_mean = round(sum(before for before, _ in cards.values()) / len(cards), 2)
    return min(score_share(now_mean, before_mean), Fraction(1)) if before_mean > 0 else None


def instance_price_follow(*, instance_id: int, score: float | None, last_score: float | None = None,
                          measured: dict[str, float] | None = None) -> Instance | None:
    """Raise a cut instance's price to what `score` earns against the score before its first cut (in full once it
    is within the published tolerance of it); where its cuts compared cards (_cut_cards), to what those same cards
    earn now against their scores before the cut, and only once this check measured the cards that caused them
    (_cards_share; `measured`: its score of each card, by UUID). With no score, only a rejection's full cut ends
    (the node passed again), to what `last_score` earns: what a score cut measured stays until a score says
    otherwise. Within the tolerance of what it pays now, nothing changes (noise). Never above its price before the
    cut. None when nothing changed."""
    tolerance = Fraction(settings.HARDWARE_PRICE_CUT_TOLERANCE)
    with transaction.atomic():
        renter_id = Instance.objects.filter(pk=instance_id).values_list("renter_id", flat=True).first()
        if renter_id is None:
            return None
        # A raise may warn and hold the renter's billing profile: locked first, as enforcement does before it
        # stops their instances (profile, then instance: no lock-order cycle with the meter tick).
        billing_profile_lock(user_id=renter_id)
        instance = _locked(instance_id)
        if instance is None or instance.status in FINAL_STATUSES:
            return None
        before = instance.price_before_cut_per_gpu_hour_micros
        if before is None:
            return None
        basis = instance.score_before_cut or 0.0
        cards = _cut_cards(instance) if score is not None else None
        if score is None:
            if instance.price_per_gpu_hour_micros:
                return None
            score = last_score
        if cards is not None:
            by_cards = _cards_share(cards, measured)
            if by_cards is None:
                return None
            share = by_cards
        else:
            share = Fraction(1) if basis <= 0 or score is None else min(score_share(score, basis), Fraction(1))
        if share >= 1 - tolerance:
            share = Fraction(1)
        per_gpu = math.floor(before * share)
        now_per_gpu = instance.price_per_gpu_hour_micros
        if per_gpu <= now_per_gpu or (share < 1.0 and per_gpu - now_per_gpu < before * tolerance):
            return None
        if share == 1:  # back where it was booked: a later cut starts afresh
            instance.price_before_cut_per_gpu_hour_micros, instance.score_before_cut = None, None
        full = ", its full price again" if share == 1 else ""
        _reprice(instance, per_gpu, kind=EventKind.PRICE_RAISED_BACK, measured="better in its latest benchmark check",
                 share=f"{float(share):.0%} of its price before the cut{full}", ratio=share)
    return instance


def _meter_bound(*, node_id: int, now: datetime) -> datetime:
    """How far the meter's tick bills a running instance of the node now: `now`, or the node's `last_seen_at` (the
    last sighting of its VMs) when earlier, as usage_meter does (LEAST(now, COALESCE(last_seen_at, now))). A price
    change closes a running instance's usage there, never further: billed up to the change instead (the rule for
    state changes, node_billable_until), a VM gone since the last health check was billed up to the change, and
    the check that then found it gone interrupted it there (instance_interrupt keeps what was billed: the renter
    paid for a dead VM's time and lost its credit; found by review)."""
    seen = Node.objects.filter(pk=node_id).values_list("last_seen_at", flat=True).first()
    return min(now, seen or now)


def _reprice(instance: Instance, per_gpu: int, *, kind: str, measured: str, share: str, ratio: Fraction,
             then: str = "", extra: dict[str, object] | None = None) -> None:
    """Bill the time so far at the old price (a running instance's up to the node's last sighting, as the meter's
    tick: _meter_bound), re-base the meter there, charge `per_gpu` from then, and tell the renter
    (`measured`: how the check found its server; `share`: the new price against the old). Under the instance's
    lock; a raise, under the renter's billing profile lock taken before it (instance_price_follow)."""
    now = timezone.now()
    since = now
    if instance.status == S.RUNNING:  # the time so far, at the price it ran at: as far as the meter's tick bills
        usage_close(instance=instance, until=_meter_bound(node_id=instance.node_id, now=now))
        started = instance.started_at
        if started is not None:  # billed at the new price from there: where the meter resumes (its from_ts)
            since = max(instance.billed_until or started, started)
    elif instance.status == S.INTERRUPTED:  # the time lost so far, credited at the price it had
        interruption_credit_before_reprice(instance_id=instance.pk, until=now)
    old = instance.price_per_hour_micros
    instance.rate_base_seconds, instance.rate_base_cost_micros = instance.billed_seconds, instance.cost_micros
    instance.price_per_gpu_hour_micros, instance.price_per_hour_micros = per_gpu, per_gpu * instance.num_gpus
    instance.save(update_fields=_PRICE_FIELDS)
    data = {"instance": instance.pk, "old_per_hour": str(micros_to_usd(old)),
            "new_per_hour": str(micros_to_usd(instance.price_per_hour_micros)), "ratio": round(float(ratio), 4),
            **(extra or {})}
    if instance.price_per_hour_micros > old and instance.status in COMMITTED_STATUSES:  # billed now, or once it runs
        pending = 0 if instance.status == S.RUNNING else instance.price_per_hour_micros
        low = balance_recheck_on_cost_rise(renter_id=instance.renter_id, now=now, pending_micros=pending)
        if low is not None:
            then += low.note()
            data.update(low.as_data())
    event_create(
        user=instance.renter, kind=kind, email=True,
        message=(f"Instance {instance.pk}'s server measured {measured}. From {_at(since)} it costs "
                 f"{usd_rate_text(instance.price_per_hour_micros)}/h instead of {usd_rate_text(old)}/h "
                 f"({share}).{then}"),
        data=data,
    )

