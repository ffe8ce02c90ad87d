"""Zero balance: renting needs an hour of funds; warnings once per crossing; stopped at zero within one tick;
destroyed only after the grace period, warned before."""
from decimal import Decimal

import pytest
from django.core import mail

from billing.models import BillingEvent, BillingProfile
from billing.services.enforcement import balances_enforce
from billing.services.storage import storage_cost
from billing.tasks import usage_meter_tick
from marketplace.models import Instance
from marketplace.services import instances as svc
from marketplace.services import volumes as volume_svc
from tests.billing.helpers import ED25519, balance, fund, node, run, running, stop
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def tick(django_capture_on_commit_callbacks):
    """One meter tick; emails go out when its transactions commit, so run those callbacks too."""
    def run_tick():
        with django_capture_on_commit_callbacks(execute=True):
            usage_meter_tick()
    return run_tick


def _kinds(user) -> list[str]:
    return list(BillingEvent.objects.filter(user=user).order_by("pk").values_list("kind", flat=True))


def test_renting_needs_one_hour_of_the_price_and_the_api_says_how_much_is_missing(api):
    on = node("2.500000", gpu_count=4)
    body = {"offer": on.pk, "num_gpus": 2, "image": "pytorch-2-5", "ssh_public_key": ED25519}
    fund(api.user, "4.00")
    response = api.post("/api/v1/instances/", body, format="json")
    assert response.status_code == 402
    detail = response.json()["detail"]
    assert "$5.00" in detail and "$4.00" in detail and "top up at least $1.00" in detail
    assert not Instance.objects.exists()
    fund(api.user, "1.00")
    assert api.post("/api/v1/instances/", body, format="json").status_code == 201


def test_starting_a_stopped_instance_needs_funds_too(clock):
    renter = UserFactory()
    fund(renter, "1.50")
    instance = running(renter, node("1.000000"))
    clock.advance(3600)
    stop(instance)
    assert balance(renter) == 500_000
    with pytest.raises(svc.InsufficientFunds) as refused:
        svc.instance_start(instance=instance)
    assert refused.value.status_code == 402 and "top up at least $0.50" in refused.value.message
    instance.refresh_from_db()
    assert instance.status == "stopped"
    fund(renter, "0.50")
    assert svc.instance_start(instance=instance).status == "starting"


def test_a_low_balance_warns_once_per_crossing_by_event_and_email(clock, api, settings, tick):
    settings.BILLING_LOW_BALANCE_WARNING_S = 3600
    fund(api.user, "1.50")
    instance = running(api.user, node("1.000000"))  # $1.50 lasts 90 minutes
    tick()
    assert _kinds(api.user) == ["credit"]
    clock.advance(31 * 60)  # under an hour left
    tick()
    clock.advance(60)
    tick()
    assert _kinds(api.user) == ["credit", "low_balance"]
    assert len(mail.outbox) == 1 and api.user.email in mail.outbox[0].to
    assert "running low" in mail.outbox[0].subject
    events = api.get("/api/v1/billing/events/?kind=low_balance").json()["results"]
    assert len(events) == 1 and "minutes" in events[0]["message"]
    fund(api.user, "5")  # back above the threshold: the next low balance is a new crossing
    tick()
    assert BillingProfile.objects.get(user=api.user).low_balance_warned_at is None
    clock.advance(5 * 3600 + 60 * 10)
    tick()
    assert _kinds(api.user).count("low_balance") == 2
    instance.refresh_from_db()
    assert instance.status == "running"


def test_at_zero_running_instances_are_stopped_within_one_tick_and_disks_kept(clock, api, sent_jobs, tick):
    fund(api.user, "1.20")  # renting the second needs an hour of both
    on = node("0.600000", gpu_count=4)
    a, b = running(api.user, on), running(api.user, on)  # $1.20 an hour together: one hour
    clock.advance(60 * 60 + 1)
    tick()
    for instance in (a, b):
        instance.refresh_from_db()
        assert instance.status == "stopping"  # a stop job was queued; the disk is kept
    assert {kind for _, kind in sent_jobs} >= {"instance_stop"}
    assert -1_000 < balance(api.user) <= 0
    assert "balance_depleted" in _kinds(api.user)
    assert any("reached zero" in m.subject for m in mail.outbox)
    charged = balance(api.user)
    for instance in (a, b):
        svc.instance_mark_stopped(instance_id=instance.pk)
    clock.advance(3600)
    tick()
    # Stopped: no GPU time, only their disks at the node's published disk price (billing.services.storage).
    disks = sum(storage_cost(size_gb=i.disk_gb, price_per_gb_month_micros=i.disk_price_per_gb_month_micros,
                             seconds=3600) for i in (a, b))
    assert disks > 0 and balance(api.user) == charged - disks


def test_stopped_instances_are_destroyed_after_the_grace_period_with_a_warning_before(clock, api, settings, tick):
    settings.BILLING_GRACE_PERIOD_S = 3 * 86400
    settings.BILLING_DESTROY_WARNING_S = 86400
    fund(api.user, "1.00")
    instance = running(api.user, node("1.000000"))
    clock.advance(3601)
    tick()
    svc.instance_mark_stopped(instance_id=instance.pk)
    clock.advance(86400)
    tick()
    assert "destroy_warning" not in _kinds(api.user)
    clock.advance(86400 + 60)
    tick()
    tick()
    assert _kinds(api.user).count("destroy_warning") == 1
    instance.refresh_from_db()
    assert instance.status == "stopped"
    clock.advance(86400)
    tick()
    instance.refresh_from_db()
    assert instance.status == "destroying"
    assert _kinds(api.user)[-1] == "instances_destroyed"
    subjects = [m.subject for m in mail.outbox]
    assert any("destroyed soon" in s for s in subjects) and any("were destroyed" in s for s in subjects)


def test_a_top_up_during_the_grace_period_saves_the_stopped_instances(clock, api, tick):
    fund(api.user, "1.00")
    instance = running(api.user, node("1.000000"))
    clock.advance(3601)
    tick()
    svc.instance_mark_stopped(instance_id=instance.pk)
    assert BillingProfile.objects.get(user=api.user).depleted_at is not None
    fund(api.user, "10")
    tick()
    profile = BillingProfile.objects.get(user=api.user)
    assert profile.depleted_at is None and profile.destroy_warned_at is None
    clock.advance(30 * 86400)
    tick()
    instance.refresh_from_db()
    assert instance.status == "stopped"
    instance = svc.instance_start(instance=instance)
    run(instance)


def test_enforcement_ignores_users_with_nothing_running(clock):
    idle = UserFactory()
    fund(idle, "0.01")
    result = balances_enforce()
    assert (result.warned, result.stopped, result.destroyed) == (0, 0, 0)
    assert _kinds(idle) == ["credit"]


def test_the_balance_endpoint_says_how_long_the_money_lasts(clock, api, other_api):
    assert api.get("/api/v1/billing/balance/").json()["balance"] == "0.000000"
    fund(api.user, "3.00")
    running(api.user, node("1.500000"))
    body = api.get("/api/v1/billing/balance/").json()
    assert body == {
        "balance": "3.000000", "currency": "usd", "running_cost_per_hour": "1.500000",
        "storage_cost_per_hour": "0.000000", "cost_per_hour": "1.500000", "seconds_left": 7200,
        "low_balance_warning_seconds": 3600, "funds_required_seconds": 3600,
        "auto_top_up": {"enabled": False, "threshold": None, "amount": None, "card": None},
        "stop_not_before": None,  # no cost rise's notice holds (tests/billing/test_resume_balance.py)
        "destroy_deadlines": [],  # above zero nothing is destroyed (tests/web/test_destroy_deadlines_shown.py)
    }
    assert other_api.get("/api/v1/billing/balance/").json()["balance"] == "0.000000"
    assert other_api.get("/api/v1/billing/balance/").json()["seconds_left"] is None


def _storage_node(price: str = "1.500000"):
    """A node whose disks cost $0.72 per GB-month: 1,000 micro-dollars per GB-hour."""
    on = node(price)
    on.disk_price_per_gb_month_micros = 720_000
    on.save()
    return on


def _volume(owner, on, size_gb: int):
    volume = volume_svc.volume_create(owner=owner, node_id=on.pk, size_gb=size_gb)
    return volume_svc.volume_mark_available(volume_id=volume.pk)


def test_the_balance_endpoint_counts_volumes_and_stopped_disks_in_the_burn_rate_and_the_time_left(clock, api):
    """Storage is billed per second as GPU time is: a renter with only a volume and a stopped instance's disk is
    told what they cost and how long the balance lasts (before: seconds_left null, as if nothing were billed,
    while enforcement warned and then deleted their storage)."""
    on = _storage_node()
    fund(api.user, "3.00")
    _volume(api.user, on, size_gb=500)  # at its size: 500 × 1,000 µ$ an hour
    disk = stop(running(api.user, on))  # at the size booked and the price snapshotted at booking
    storage = (500 + disk.disk_gb) * 1_000
    body = api.get("/api/v1/billing/balance/").json()
    assert (body["running_cost_per_hour"], body["storage_cost_per_hour"], body["cost_per_hour"]) == (
        "0.000000", f"{storage / 1e6:.6f}", f"{storage / 1e6:.6f}")
    assert body["seconds_left"] == balance(api.user) * 3600 // storage
    running(api.user, node("1.500000"))  # GPU time on top: the total, and the time left at it
    body = api.get("/api/v1/billing/balance/").json()
    assert (body["running_cost_per_hour"], body["storage_cost_per_hour"], body["cost_per_hour"]) == (
        "1.500000", f"{storage / 1e6:.6f}", f"{(1_500_000 + storage) / 1e6:.6f}")
    assert body["seconds_left"] == balance(api.user) * 3600 // (1_500_000 + storage)


def test_the_balance_endpoint_says_the_time_left_the_low_balance_warning_says(clock, api, settings):
    """One figure: what the API answers for a renter billed for storage alone is what the warning e-mail said."""
    settings.BILLING_LOW_BALANCE_WARNING_S = 30 * 86400
    on = _storage_node()
    fund(api.user, "2.00")
    _volume(api.user, on, size_gb=250)
    stop(running(api.user, on))
    assert balances_enforce().warned == 1
    [warning] = BillingEvent.objects.filter(user=api.user, kind="low_balance")
    body = api.get("/api/v1/billing/balance/").json()
    assert body["seconds_left"] == warning.data["seconds_left"] > 0
    assert Decimal(body["cost_per_hour"]) == Decimal(warning.data["per_hour"])
