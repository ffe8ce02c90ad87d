"""Celery entry points of billing: the per-minute meter tick, weekly payouts, automatic top-ups."""
import logging

from celery import shared_task

from billing.services import enforcement, metering, payments, payouts

log = logging.getLogger(__name__)


@shared_task(acks_late=True, ignore_result=True)
def usage_meter_tick():
    """Close usage of running instances, then act on low and empty balances (one tick at a time)."""
    metered = metering.usage_meter()
    if metered.skipped:
        log.info("meter: another tick is running; skipped")
        return
    enforced = enforcement.balances_enforce()
    log.info("meter: %s instances, %s intervals, %s µ$ charged; %s", metered.instances, metered.intervals,
             metered.charged_micros, enforced)


@shared_task(acks_late=True, ignore_result=True)
def payouts_run():
    done = payouts.payouts_run()
    log.info("payouts: %s", [(p.pk, p.status) for p in done])


@shared_task(acks_late=True, ignore_result=True)
def top_up_charge(top_up_id: int):
    payments.top_up_charge_by_id(top_up_id=top_up_id)
