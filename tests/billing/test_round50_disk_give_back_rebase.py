"""A stopped instance's disk billed again after a give-back (billing.services.storage.disk_give_back) costs what the
seconds paid for cost, to the micro-dollar, as GPU time does after usage_give_back (metering._rebase_after_give_back).

The race of tests/billing/test_disk_lost_request_race.py: a look finds the stopped instance's VM and disk gone, its
renter's start comes before the check that fails it, and the disk's 67 s billed after the last sighting are given
back (300 s of 500 GB paid for, 367 s charged). The start's job then gives up before it reached the node (the VM was
never touched): the instance is stopped again, its disk kept and billed again (the look may have been an engine's
outage that listed a VM missing which is still there). Before, the disk's meter went on from disk_billed_seconds
(367), which counts the seconds given back: the next 10 s cost cost(377) - cost(367) = 579 µ$ where the seconds paid
for and those cost cost(310) - cost(300) = 578 µ$. The give-back now re-bases the disk's meter
(disk_rate_base_*), and tests/billing/invariants.py allows exactly that re-base. Real services on PostgreSQL."""

import importlib

import pytest
from django.apps import apps

from billing.services.storage import storage_meter
from marketplace.models import Instance, InstanceStatus
from marketplace.services import instances as svc
from marketplace.services.instances.interruptions import lost_disk_give_back
from provisioning.models import OPEN_JOB_STATUSES, Job, JobKind
from provisioning.services import vms
from tests.billing.invariants import assert_billing_invariants
from tests.billing.test_disk_lost_request_race import ACTED_S, DETAIL, SEEN_S, _cost, _disk_paid, _race, _stopped

pytestmark = pytest.mark.django_db

AGAIN_S = 10  # 57.87 µ$/s: cost(367 + 10) - cost(367) = 579, cost(300 + 10) - cost(300) = 578


def _given_back_and_stopped_again(clock):
    renter, host, instance = _stopped(clock)
    sighting, probed = _race(clock, renter, host, instance, "start", ticked=False)
    lost_disk_give_back(instance_id=instance.pk, since=sighting, looked_at=probed, detail=DETAIL)  # 0: done already
    assert _disk_paid(renter, instance) == _cost(SEEN_S)  # given back, to the micro-dollar
    instance = Instance.objects.get(pk=instance.pk)
    assert instance.status == InstanceStatus.STARTING
    assert instance.disk_billed_seconds == SEEN_S + ACTED_S  # the row's own total: as charged
    # Its start's job gives up before it reached the node: stopped again, its disk kept.
    job = Job.objects.get(instance_id=instance.pk, kind=JobKind.INSTANCE_START, status__in=OPEN_JOB_STATUSES)
    vms.vm_failed(job=job, error="The node did not answer.", fault="node")
    instance = Instance.objects.get(pk=instance.pk)
    assert instance.status == InstanceStatus.STOPPED
    return renter, instance


def test_a_disk_billed_again_after_a_give_back_costs_what_the_seconds_paid_for_cost(clock):
    renter, instance = _given_back_and_stopped_again(clock)
    assert _cost(SEEN_S + ACTED_S + AGAIN_S) - _cost(SEEN_S + ACTED_S) != _cost(SEEN_S + AGAIN_S) - _cost(SEEN_S)
    clock.advance(AGAIN_S - 5 + 0.5)
    storage_meter()  # the tick bills part of it, the destroy's close the rest
    clock.advance(5)
    svc.instance_destroy(instance=Instance.objects.get(pk=instance.pk))
    instance = Instance.objects.get(pk=instance.pk)
    assert instance.disk_billed_seconds == SEEN_S + ACTED_S + AGAIN_S
    assert _disk_paid(renter, instance) == _cost(SEEN_S + AGAIN_S)  # was 1 µ$ more


def _assert_refused(instance: Instance, **fields) -> None:
    kept = {name: getattr(instance, name) for name in fields}
    Instance.objects.filter(pk=instance.pk).update(**fields)
    with pytest.raises(AssertionError):
        assert_billing_invariants()
    Instance.objects.filter(pk=instance.pk).update(**kept)
    assert_billing_invariants()


def test_the_invariants_allow_the_disks_re_base_and_no_other(clock):
    _, instance = _given_back_and_stopped_again(clock)
    assert (instance.disk_rate_base_seconds, instance.disk_rate_base_cost_micros) == (
        ACTED_S,
        _cost(SEEN_S + ACTED_S) - _cost(SEEN_S),
    )  # moved on by the seconds given back and what they were charged
    assert_billing_invariants()
    billed, total = instance.disk_billed_seconds, instance.disk_cost_micros

    def base(seconds: int, moved_cost: int = 0) -> dict[str, int]:  # disk_cost == base + cost(billed - base) kept
        return {
            "disk_rate_base_seconds": seconds,
            "disk_rate_base_cost_micros": total - _cost(billed - seconds) + moved_cost,
        }

    _assert_refused(instance, **base(ACTED_S + 1))  # moved further than the seconds given back
    _assert_refused(instance, **base(ACTED_S - 1))  # not as far: its cost is not what was given back
    _assert_refused(instance, **base(0))  # not moved at all: a give-back leaves it moved
    _assert_refused(instance, disk_rate_base_cost_micros=instance.disk_rate_base_cost_micros + 1)  # the total broken


def test_the_migration_bases_the_disks_given_back_before_it(clock):
    _, instance = _given_back_and_stopped_again(clock)
    moved = instance.disk_rate_base_seconds, instance.disk_rate_base_cost_micros
    Instance.objects.filter(pk=instance.pk).update(disk_rate_base_seconds=0, disk_rate_base_cost_micros=0)
    migration = importlib.import_module("marketplace.migrations.0041_instance_disk_rate_base")
    migration.disk_rate_base_from_give_backs(apps, None)
    instance = Instance.objects.get(pk=instance.pk)
    assert (instance.disk_rate_base_seconds, instance.disk_rate_base_cost_micros) == moved
