"""The instances API's `cost_so_far` agrees with the ledger once a charge of the instance's GPU time was given back.

A VM found lost just as its renter stopped it (tests/billing/test_vm_lost_stop_race.py) has what it was billed after
its last sighting given back: a REVERSAL of its usage charge (billing.services.metering.usage_give_back), credited to
the renter's wallet. An operator's reversal of a usage charge does the same. The instance's own cost_micros stays
what was charged (the meter's cumulative arithmetic reads it). f54b7e1 made the usage API and the pages read the
ledger net; GET /api/v1/instances/ and /api/v1/instances/{id}/ (and a verb's answer) still said `cost_so_far` was
what was charged. Now they subtract what was given back, carried in the list's own query (no query per instance:
tests/test_query_counts.py). The Vast-compatible instance rows carry no cost so far (only prices): nothing to agree.
Real services on PostgreSQL."""
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from billing.models import UsageInterval
from billing.pricing import instance_cost_so_far
from billing.services.ledger import ledger_reverse
from billing.services.metering import usage_meter
from marketplace.money import micros_to_usd
from tests.billing.conftest import (  # noqa: F401 (fixtures: the billing tests' settings, clock and invariants)
    billing_settings,
    clock,
    ledger_invariants,
    no_task_queue,
    sent_jobs_fixture,
)
from tests.billing.helpers import fund, node, running, stop
from tests.billing.test_round45_given_back_usage_readers import _ledger_paid, given_back  # noqa: F401 (a fixture)
from tests.billing.test_vm_lost_stop_race import BACK, KEPT, rented  # noqa: F401 (rented: a fixture)
from tests.conftest import _client_for
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def lost_and_given_back(given_back, clock, monkeypatch):  # noqa: F811
    """given_back (its fixture's monkeypatch.undo() also undid the clock's patch: put back)."""
    monkeypatch.setattr("django.utils.timezone.now", clock)
    return given_back


def _reads(captured) -> int:
    return sum(1 for q in captured.captured_queries if q["sql"].startswith("SELECT"))


def _listed(user) -> dict[int, dict]:
    answer = _client_for(user).get("/api/v1/instances/", {"page_size": 100})
    assert answer.status_code == 200, answer.content
    return {row["id"]: row for row in answer.json()["results"]}


def _detail(user, instance) -> dict:
    answer = _client_for(user).get(f"/api/v1/instances/{instance.pk}/")
    assert answer.status_code == 200, answer.content
    return answer.json()


def test_cost_so_far_is_net_of_what_was_given_back_after_a_vm_lost_stop(lost_and_given_back):
    renter, host, lost, kept = lost_and_given_back
    lost.refresh_from_db()
    assert lost.cost_micros == KEPT + BACK  # the instance's own total: as charged
    assert _ledger_paid(lost) == KEPT
    assert Decimal(_detail(renter, lost)["cost_so_far"]) == micros_to_usd(KEPT)  # was KEPT + BACK
    assert Decimal(_listed(renter)[lost.pk]["cost_so_far"]) == micros_to_usd(KEPT)  # was KEPT + BACK
    # The instance beside it (another renter's, running on, nothing given back): what was charged, and this run's
    # seconds not metered yet.
    kept.refresh_from_db()
    charged = instance_cost_so_far(instance=kept)
    assert charged >= kept.cost_micros == _ledger_paid(kept)
    assert Decimal(_detail(kept.renter, kept)["cost_so_far"]) == micros_to_usd(charged)
    assert Decimal(_listed(kept.renter)[kept.pk]["cost_so_far"]) == micros_to_usd(charged)


def test_an_operators_reversal_reads_as_given_back_in_list_detail_and_a_verbs_answer(clock):  # noqa: F811
    renter = UserFactory()
    fund(renter, "50")
    host = node(price="1.500000", gpu_count=4)
    instance = running(renter, host, num_gpus=2)
    other = running(renter, host, num_gpus=1)
    clock.advance(120)
    usage_meter()
    [first] = UsageInterval.objects.filter(instance=instance)
    assert first.transaction is not None and first.amount_micros > 0
    ledger_reverse(txn=first.transaction, reason="test: charged in error")
    clock.advance(30)  # 30 s of the running instance not metered yet: part of its cost so far, not given back
    unmetered = 1_500_000 * 2 * 30 // 3600  # $1.50/GPU-hour, 2 GPUs, 30 s: whole micro-dollars
    assert Decimal(_detail(renter, instance)["cost_so_far"]) == micros_to_usd(unmetered)  # was first + unmetered
    rows = _listed(renter)
    assert Decimal(rows[instance.pk]["cost_so_far"]) == micros_to_usd(unmetered)
    other.refresh_from_db()
    assert Decimal(rows[other.pk]["cost_so_far"]) == micros_to_usd(other.cost_micros + 1_500_000 * 30 // 3600)
    # A verb's answer (the viewset renders the instance through the same queryset).
    answer = _client_for(renter).post(f"/api/v1/instances/{instance.pk}/stop/")
    assert answer.status_code == 202, answer.content
    stopped = stop(instance)
    assert stopped.cost_micros == first.amount_micros + unmetered
    assert Decimal(answer.json()["cost_so_far"]) == micros_to_usd(unmetered)
    assert Decimal(_detail(renter, stopped)["cost_so_far"]) == micros_to_usd(_ledger_paid(stopped)) \
        == micros_to_usd(unmetered)


def test_the_serializer_alone_reads_the_give_back_too(lost_and_given_back):
    """An instance serialized without the viewset's annotation (any other caller) asks once."""
    from marketplace.api.instance_serializers import InstanceSerializer
    from marketplace.models import Instance

    renter, host, lost, kept = lost_and_given_back
    plain = Instance.objects.get(pk=lost.pk)
    assert not hasattr(plain, "usage_given_back_micros")
    assert Decimal(InstanceSerializer(plain).data["cost_so_far"]) == micros_to_usd(KEPT)


def test_the_list_reads_the_give_backs_in_its_own_query(lost_and_given_back, clock):  # noqa: F811
    """No query per instance: the list's query count does not grow with the instances given back to."""
    renter, host, lost, kept = lost_and_given_back
    client = _client_for(renter)
    client.get("/api/v1/instances/")
    with CaptureQueriesContext(connection) as one:
        assert client.get("/api/v1/instances/").status_code == 200
    more = running(renter, node(price="1.500000", gpu_count=2))
    clock.advance(60)
    usage_meter()
    [interval] = UsageInterval.objects.filter(instance=more)
    ledger_reverse(txn=interval.transaction, reason="test: charged in error")
    with CaptureQueriesContext(connection) as two:
        rows = client.get("/api/v1/instances/").json()["results"]
    # One instance given back to, then two: as many reads (a query per instance would add one). (An API key's last
    # use is written when the clock moves: not a read.)
    assert len(rows) == 2 and _reads(two) == _reads(one)
    assert Decimal({r["id"]: r for r in rows}[more.pk]["cost_so_far"]) == 0  # its one charge reversed in full
