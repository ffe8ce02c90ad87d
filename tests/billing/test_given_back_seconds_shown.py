"""The instance page's "N metered" after usage was given back: the seconds paid for, as its cost.

A VM found lost just as its renter stopped it (tests/billing/test_vm_lost_stop_race.py) has what its run was billed
after the VM's last sighting given back (billing.services.metering.usage_give_back): here 129 s were billed, 69 s of
them given back, and the ledger says the renter paid for 60 s (cost_for(PRICE, 60) = 50,000 µ$). The page's cost
(billing.selectors.instance_cost: charged less given back) said 50,000 µ$, as the ledger does; its seconds
("(2 min 09 s metered)") were Instance.billed_seconds, which counts the 69 s given back. The row's totals stay what
was charged by design (the meter's cumulative arithmetic reads them, tests/billing/invariants.py checks them against
the usage intervals), so the seconds given back have their own record now: Instance.given_back_seconds, written by
usage_give_back in its transaction, and instance_cost's seconds are billed_seconds less them. (Was a strict xfail.)
Its other readers: tests/billing/test_given_back_seconds_readers.py.
"""
import pytest

from billing.selectors import instance_cost
from billing.services.metering import cost_for
from tests.billing.test_round45_given_back_usage_readers import _ledger_paid, given_back  # noqa: F401 (a fixture)
from tests.billing.test_vm_lost_stop_race import KEPT, PRICE, SEEN_S, TOTAL_S, rented  # noqa: F401 (a fixture)

pytestmark = pytest.mark.django_db


def test_the_instance_pages_metered_seconds_are_the_ones_the_ledger_charged_for(given_back):  # noqa: F811
    renter, host, lost, kept = given_back
    lost.refresh_from_db()
    shown = instance_cost(instance=lost)
    assert shown["amount_micros"] == KEPT == _ledger_paid(lost) == cost_for(PRICE, SEEN_S)  # the money agrees
    assert lost.billed_seconds == TOTAL_S  # what was charged (the row's own total, by design)
    assert shown["billed_seconds"] == SEEN_S, f"shown {shown['billed_seconds']} s metered, paid for {SEEN_S} s"
    assert lost.given_back_seconds == TOTAL_S - SEEN_S == shown["given_back_seconds"]
