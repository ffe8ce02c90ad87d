"""Celery entry points of the marketplace (beat's): the sweep over deactivated accounts."""
import logging

from celery import shared_task

from marketplace.services.account_status import accounts_deactivated_enforce

log = logging.getLogger(__name__)


@shared_task(acks_late=True, ignore_result=True)
def accounts_deactivated_sweep():
    """Stop what deactivated accounts run now, cancel what they booked (marketplace.services.account_status)."""
    halted = accounts_deactivated_enforce()
    if halted.stopped or halted.cancelled:
        log.info("deactivated accounts: stopped %s, cancelled %s", halted.stopped, halted.cancelled)
