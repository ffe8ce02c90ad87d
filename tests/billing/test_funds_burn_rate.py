"""The funds check counts what already runs: renting or starting needs one hour of the renter's whole burn rate
(running, booked and starting instances, their storage, plus the new one), checked under the wallet's lock."""
import pytest
from django.db import connection

from billing.services.storage import storage_rate_per_hour_micros
from marketplace.models import GpuAllocation, GpuStatus, Instance
from marketplace.services import instances as svc
from provisioning.models import Job
from tests.billing.helpers import ED25519, book, fund, node, run, running, stop
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

URL = "/api/v1/instances/"


def _body(on, num_gpus):
    return {"offer": on.pk, "num_gpus": num_gpus, "image": "pytorch-2-5", "ssh_public_key": ED25519}


@pytest.fixture
def a100():
    return node("1.500000", gpu_count=4, gpu_model="a100-80gb-sxm")


@pytest.fixture
def h100():
    return node("2.250000", gpu_count=2, gpu_model="h100-sxm")


def test_a_second_booking_needs_an_hour_of_both(a100, h100):
    renter = UserFactory()
    fund(renter, "5.00")
    first = book(renter, a100, num_gpus=2)  # $3.00/h: one hour is $3.00, the balance is $5.00
    with pytest.raises(svc.InsufficientFunds) as refused:
        book(renter, h100, num_gpus=1)  # $3.00 + $2.25 = $5.25/h: the $5.00 last 57 minutes
    message = refused.value.message
    assert refused.value.status_code == 402
    assert "$3.00/h" in message and "with this one $5.25/h" in message
    assert "one hour needs $5.25" in message and "top up at least $0.25" in message
    funds = refused.value.funds
    assert (funds.committed_rate_micros, funds.added_rate_micros, funds.required_micros, funds.balance_micros) \
        == (3_000_000, 2_250_000, 5_250_000, 5_000_000)
    assert list(Instance.objects.values_list("pk", flat=True)) == [first.pk]
    assert not h100.gpus.exclude(status=GpuStatus.FREE).exists()
    fund(renter, "0.25")
    book(renter, h100, num_gpus=1)


def test_the_api_refuses_the_h100_with_402_and_writes_nothing(api, a100, h100, sent_jobs):
    fund(api.user, "5.00")
    assert api.post(URL, _body(a100, 2), format="json").status_code == 201
    before = (Instance.objects.count(), Job.objects.count(), GpuAllocation.objects.count(), len(sent_jobs))
    response = api.post(URL, _body(h100, 1), format="json")
    assert response.status_code == 402
    detail = response.json()["detail"]
    assert "$3.00/h" in detail and "$5.25/h" in detail and "$5.25" in detail
    assert "Your balance is $5.00" in detail and "POST /api/v1/billing/top-ups/" in detail
    assert (Instance.objects.count(), Job.objects.count(), GpuAllocation.objects.count(), len(sent_jobs)) == before
    assert not Instance.objects.filter(node=h100).exists()


@pytest.mark.parametrize(("status", "counted"), [
    ("requested", True), ("provisioning", True), ("starting", True), ("running", True),
    ("stopping", False), ("stopped", False), ("failed", False), ("destroying", False), ("destroyed", False),
])
def test_which_instances_count(a100, status, counted):
    renter = UserFactory()
    fund(renter, "10.00")
    instance = book(renter, a100, num_gpus=2)
    Instance.objects.filter(pk=instance.pk).update(status=status)
    # A stopped one's disk is billed as storage, and counts as such (not its GPU time).
    disk = storage_rate_per_hour_micros(size_gb=instance.disk_gb,
                                        price_per_gb_month_micros=instance.disk_price_per_gb_month_micros)
    committed = 3_000_000 if counted else disk if status == "stopped" else 0
    assert svc.committed_rate_micros(renter_id=renter.pk) == committed
    funds = svc.funds_for(renter_id=renter.pk, price_per_hour_micros=1_000_000)
    assert funds.rate_micros == committed + 1_000_000


def test_starting_a_stopped_instance_counts_the_others(clock, a100):
    renter = UserFactory()
    fund(renter, "4.00")
    keeps = running(renter, a100, num_gpus=1)  # $1.50/h
    stopped = running(renter, a100, num_gpus=1)
    stop(stopped)
    # $1.50 + $1.50 = $3.00 of $4.00: fine; a booked one too ($4.50 > $4.00): refused.
    svc.instance_start(instance=stopped)
    run(stopped)
    stop(stopped)
    book(renter, a100, num_gpus=1)  # requested: it will be billed, so it counts
    with pytest.raises(svc.InsufficientFunds) as refused:
        svc.instance_start(instance=stopped)
    assert "Your running and starting instances and your storage cost $3.00/h; with this one $4.50/h" \
        in refused.value.message
    stopped.refresh_from_db()
    assert stopped.status == "stopped" and not stopped.allocations.filter(released_at=None).exists()
    stop(keeps)
    assert svc.instance_start(instance=stopped).status == "starting"


def test_the_rule_is_not_applied_when_funds_are_not_required(settings, a100, h100):
    settings.BILLING_REQUIRE_FUNDS = False
    renter = UserFactory()
    book(renter, a100, num_gpus=4)
    book(renter, h100, num_gpus=2)
    assert svc.funds_for(renter_id=renter.pk, price_per_hour_micros=1).missing_micros == 0


@pytest.mark.django_db(transaction=True)
def test_concurrent_bookings_of_one_renter_count_each_other(a100, h100):
    """Two bookings at once, each alone affordable, together not: the wallet lock lets exactly one through."""
    from tests.marketplace.test_renting_concurrency import in_parallel

    renter = UserFactory()
    fund(renter, "4.00")

    def book_on(on):
        def call():
            try:
                return book(renter, on, num_gpus=1)
            except svc.InsufficientFunds as exc:
                return exc.message
        return call

    outcomes = in_parallel([book_on(a100), book_on(h100), book_on(a100)])  # $1.50, $2.25, $1.50
    booked = [o for o in outcomes if isinstance(o, Instance)]
    # Any two fit in $4.00 ($3.75 at most), all three do not ($5.25): without the lock all three could pass.
    assert len(booked) == 2 and sum(i.price_per_hour_micros for i in booked) <= 4_000_000
    assert [o for o in outcomes if isinstance(o, str)][0].startswith("Renting this instance needs one hour")
    assert svc.committed_rate_micros(renter_id=renter.pk) == sum(i.price_per_hour_micros for i in booked)
    assert Instance.objects.count() == len(booked)
    connection.close()
