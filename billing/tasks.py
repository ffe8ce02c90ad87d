"""Celery entry points of billing: the per-minute meter tick, weekly payouts, automatic top-ups, and the
follow-up of top-ups whose webhook never came. Services queue these by name (core.dispatch), never by importing
this module: a task queued by a service is registered under the name the service declares."""
import logging

from celery import shared_task

from billing.services import enforcement, metering, payments, payouts, reconcile, storage
from billing.services.top_ups import TOP_UP_CHARGE
from core import metrics

log = logging.getLogger(__name__)


@shared_task(acks_late=True, ignore_result=True)
def usage_meter_tick():
    """Close usage of running instances and storage (volumes, stopped disks), then act on low and empty balances
    (one tick at a time)."""
    metered = metering.usage_meter()
    if metered.skipped:
        log.info("meter: another tick is running; skipped")
        return
    stored = storage.storage_meter()
    enforced = enforcement.balances_enforce()
    metrics.record_meter_tick()
    log.info("meter: %s instances, %s intervals, %s µ$ charged; storage %s; %s", metered.instances,
             metered.intervals, metered.charged_micros, stored, enforced)


@shared_task(acks_late=True, ignore_result=True)
def payouts_run():
    done = payouts.payouts_run()
    log.info("payouts: %s", [(p.pk, p.status) for p in done])


@shared_task(name=TOP_UP_CHARGE, acks_late=True, ignore_result=True)
def top_up_charge(top_up_id: int):
    payments.top_up_charge_by_id(top_up_id=top_up_id)


@shared_task(acks_late=True, ignore_result=True, soft_time_limit=240, time_limit=300)
def top_ups_reconcile():
    """Settle top-ups still processing after a few minutes with what Stripe says (their webhook never came), and
    charges, refunds and payouts whose Stripe answer was lost."""
    done = reconcile.top_ups_reconcile()
    if done:
        log.info("top-ups reconcile: %s", done)
    # Top-ups whose charge answer was lost: found among the customer's payments, or known not charged.
    lost = reconcile.top_ups_find_lost()
    if lost:
        log.info("lost charges: %s", lost)
    # Refunds whose Stripe answer was lost (still pending, their amount held from the wallet).
    refunds = reconcile.refunds_reconcile()
    if refunds:
        log.info("refunds reconcile: %s", refunds)
    # Payouts whose transfer's answer was lost (or never sent): looked up, then sent if not made.
    sent = payouts.payouts_send_pending()
    if sent:
        log.info("payouts: %s pending payout(s) tried again", sent)
    # Automatic top-ups whose charge task was never queued (the broker was down) or was lost.
    charged = reconcile.top_ups_charge_pending()
    if charged:
        log.info("top-ups reconcile: %s pending automatic top-up(s) charged", charged)
