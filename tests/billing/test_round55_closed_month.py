"""A month that is over keeps its statement (renter) and its earnings (provider): a posting is dated when it is
made, and its memo (the statement's line) names the span it charges for (review r55 MEDIUM-1). Before, the storage
meter dated each charge at its node's last health check, so the first tick of every month posted the last seconds
of storage into the month that had just ended; the same for an outage's catch-up (node_storage_outage_end), for
GPU time closed at the node's last sighting (usage_close: the per-instance meter, a stop during a silence) and for
an interruption's credit up to an earlier moment."""
from datetime import UTC, date, datetime

import pytest

from billing import selectors
from billing.models import LedgerTransaction, TransactionKind
from billing.services.credits import interruption_credit
from billing.services.metering import usage_meter
from billing.services.storage import node_storage_outage_end, storage_meter
from marketplace.models import Instance, Interruption, InterruptionCause, Volume
from marketplace.services import volumes as volume_svc
from tests.billing.helpers import fund, node, running, stop

pytestmark = pytest.mark.django_db

MARCH, APRIL = date(2026, 3, 1), date(2026, 4, 1)


def _march_earned(provider) -> int:
    return next((m["earned_micros"] for m in selectors.earnings_for(user=provider).months if m["month"] == MARCH), 0)


def _seen(on, at, failures=0):
    on.last_seen_at, on.health_failures = at, failures
    on.save(update_fields=["last_seen_at", "health_failures"])


def _storage_node():
    on = node("1.000000")
    on.disk_price_per_gb_month_micros = 300_000
    on.save()
    return on


def test_the_first_storage_tick_of_a_month_leaves_the_month_before_as_it_was(clock, user):
    """The review's reproduction: read on 1 April at 00:00:05, March closed at $10; the tick just after moved it."""
    clock.now = datetime(2026, 3, 31, 23, 0, tzinfo=UTC)
    fund(user, "10")
    on = _storage_node()
    volume = volume_svc.volume_create(owner=user, node_id=on.pk, size_gb=500)
    volume_svc.volume_mark_available(volume_id=volume.pk)
    _seen(on, datetime(2026, 3, 31, 23, 59, 50, tzinfo=UTC))  # its last health check, ten seconds before midnight
    clock.now = datetime(2026, 4, 1, 0, 0, 5, tzinfo=UTC)  # April: the renter reads March
    march, earned = selectors.statement_for(user=user, month=MARCH), _march_earned(on.provider)
    assert storage_meter().charged_micros > 0  # the tick just after midnight
    again = selectors.statement_for(user=user, month=MARCH)
    assert (again.closing_micros, again.storage) == (march.closing_micros, march.storage)
    assert _march_earned(on.provider) == earned
    april = selectors.statement_for(user=user, month=APRIL)
    assert april.opening_micros == march.closing_micros
    [line] = april.storage
    assert line["at"] == clock.now and line["charged_micros"] == april.storage_micros > 0
    # The line still says what it charged for: the seconds of March it covers.
    assert line["memo"] == f"Volume {volume.pk} (500 GB): 3590 s from 2026-03-31 23:00:00 to 23:59:50 UTC"
    assert Volume.objects.get(pk=volume.pk).billed_until == datetime(2026, 3, 31, 23, 59, 50, tzinfo=UTC)


def test_an_outage_across_the_month_end_bills_its_catch_up_in_the_month_it_ends(clock, user):
    """A volume billed up to its node's last healthy moment when the node answers again after an outage: that
    catch-up is posted when the node answers (April), not at the last healthy moment (March), and the outage itself
    is not billed."""
    clock.now = datetime(2026, 3, 31, 22, 0, tzinfo=UTC)
    fund(user, "10")
    on = _storage_node()
    volume = volume_svc.volume_create(owner=user, node_id=on.pk, size_gb=500)
    volume_svc.volume_mark_available(volume_id=volume.pk)
    _seen(on, datetime(2026, 3, 31, 23, 0, tzinfo=UTC), failures=60)  # last healthy at 23:00, then silent
    clock.now = datetime(2026, 4, 1, 3, 0, tzinfo=UTC)
    march, earned = selectors.statement_for(user=user, month=MARCH), _march_earned(on.provider)
    assert node_storage_outage_end(node_id=on.pk) == 1  # the node answers: its reconciler, first
    again = selectors.statement_for(user=user, month=MARCH)
    assert (again.closing_micros, again.storage) == (march.closing_micros, march.storage)
    assert _march_earned(on.provider) == earned
    [line] = selectors.statement_for(user=user, month=APRIL).storage
    assert line["at"] == clock.now
    assert line["memo"] == f"Volume {volume.pk} (500 GB): 3600 s from 2026-03-31 22:00:00 to 23:00:00 UTC"
    assert Volume.objects.get(pk=volume.pk).billed_until == clock.now  # the outage is not billed


def test_a_stopped_disk_billed_across_days_names_both_dates(clock, user):
    """A stopped instance's disk, its node last seen on 31 March, billed by the tick of 1 April: dated then, its
    memo naming the span's two days."""
    clock.now = datetime(2026, 3, 30, 23, 0, tzinfo=UTC)
    fund(user, "100")
    on = _storage_node()
    instance = running(user, on)
    clock.now = datetime(2026, 3, 30, 23, 30, tzinfo=UTC)
    instance = Instance.objects.get(pk=instance.pk)
    stop(instance)
    stopped_at = Instance.objects.get(pk=instance.pk).stopped_at
    _seen(on, datetime(2026, 3, 31, 23, 59, 50, tzinfo=UTC))
    clock.now = datetime(2026, 4, 1, 0, 1, tzinfo=UTC)
    march = selectors.statement_for(user=user, month=MARCH)
    assert storage_meter().disks == 1
    assert selectors.statement_for(user=user, month=MARCH).closing_micros == march.closing_micros
    [line] = selectors.statement_for(user=user, month=APRIL).storage
    assert line["at"] == clock.now
    assert line["memo"].endswith(f"from {stopped_at:%Y-%m-%d %H:%M:%S} to 2026-03-31 23:59:50 UTC")


@pytest.mark.parametrize("set_based", [False, True], ids=["each", "set_based"])
def test_gpu_time_up_to_a_sighting_in_the_month_before_is_posted_in_the_month_it_is_billed(clock, user, set_based):
    """GPU time closed at the node's last sighting, in March, by the first tick of April: both meters date it at
    the tick (the set-based one did; the per-instance one, usage_close, dated it at the sighting), and the
    statement's usage line names the span."""
    clock.now = datetime(2026, 3, 31, 23, 0, tzinfo=UTC)
    fund(user, "100")
    on = node("1.000000")
    instance = running(user, on)
    _seen(on, datetime(2026, 3, 31, 23, 59, 50, tzinfo=UTC))
    clock.now = datetime(2026, 4, 1, 0, 0, 5, tzinfo=UTC)
    march, earned = selectors.statement_for(user=user, month=MARCH), _march_earned(on.provider)
    assert usage_meter(set_based=set_based).charged_micros > 0
    again = selectors.statement_for(user=user, month=MARCH)
    assert (again.closing_micros, again.usage_lines) == (march.closing_micros, march.usage_lines)
    assert _march_earned(on.provider) == earned
    april = selectors.statement_for(user=user, month=APRIL)
    [line] = april.usage_lines
    assert line["instance"] == instance.pk and line["seconds"] == 3590 and line["amount_micros"] == april.usage_micros
    assert (line["from"], line["to"]) == (datetime(2026, 3, 31, 23, 0, tzinfo=UTC),
                                          datetime(2026, 3, 31, 23, 59, 50, tzinfo=UTC))
    assert LedgerTransaction.objects.get(kind=TransactionKind.USAGE).created_at == clock.now


def test_an_interruption_credit_up_to_an_earlier_moment_is_dated_when_it_is_posted(clock, user):
    """interruption_credit(until=...) before the month it is posted in: dated now, its memo naming the span."""
    clock.now = datetime(2026, 3, 31, 23, 0, tzinfo=UTC)
    fund(user, "100")
    on = node("1.500000")
    instance = running(user, on)
    interruption = Interruption.objects.create(instance=instance, cause=InterruptionCause.NODE_LOST, detail="gone",
                                               started_at=clock.now, detected_at=clock.now)
    clock.now = datetime(2026, 4, 1, 0, 0, 5, tzinfo=UTC)
    march, earned = selectors.statement_for(user=user, month=MARCH), _march_earned(on.provider)
    credit = interruption_credit(interruption_id=interruption.pk, until=datetime(2026, 3, 31, 23, 30, tzinfo=UTC))
    assert credit.amount_micros > 0
    assert selectors.statement_for(user=user, month=MARCH).closing_micros == march.closing_micros
    assert _march_earned(on.provider) == earned
    [line] = selectors.statement_for(user=user, month=APRIL).adjustments
    assert line["at"] == clock.now and line["amount_micros"] == credit.amount_micros
    assert line["memo"] == (f"Instance {instance.pk} interrupted: 1800 s lost "
                            "from 2026-03-31 23:00:00 to 23:30:00 UTC")
