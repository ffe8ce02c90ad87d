"""An operator deactivates an account (marketplace.services.account_status), found last session: nothing else
happened. The renter, who could no longer log in nor use an API key, kept running and paying for instances nobody
could stop; a deactivated provider's servers stayed on the offers and kept taking bookings.

Now, as a renter: its running instances are stopped through the stop job (GPU billing ends at the stop, the disk is
kept), its bookings not running yet are cancelled, and it is told; an instance that comes to run later is stopped by
the sweep. As a provider: its servers leave the offers and refuse bookings (409, saying why), and what renters run on
them is left alone. Reactivating restarts nothing and brings the offers back.

Real parts: a simulated server over SSH with the real agent (tests/marketplace/sim_renting.py) for the stop, the
platform's services and jobs, PostgreSQL."""
import re
import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test import Client
from django.utils import timezone

from billing.models import LedgerTransaction
from billing.services.metering import usage_meter
from core.errors import Conflict, ValidationFailed
from marketplace.models import AccountStatusChange, Gpu, Instance, InstanceStatus, User
from marketplace.services import instances as instance_svc
from marketplace.services.account_status import (
    account_deactivate,
    account_reactivate,
    accounts_deactivated_enforce,
)
from marketplace.services.volumes import volume_create
from notifications.models import Notification
from provisioning import tasks
from provisioning.models import Job, JobKind
from tests.billing.helpers import fund
from tests.billing.invariants import assert_billing_invariants
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book, run, snapshot

from .sim_renting import (  # noqa: F401 (fixtures)
    backdate,
    deliver_until_closed,
    job_of,
    sent_jobs_fixture,
    sim_node_fixture,
    simbase_fixture,
    simnode_fixture,
    vm_state,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _status(instance: Instance) -> str:
    return Instance.objects.values_list("status", flat=True).get(pk=instance.pk)


def _told(user, kind: str) -> list[Notification]:
    return list(Notification.objects.filter(user=user, kind=kind))


def _provisioned(renter, node) -> Instance:
    instance = book(renter, node)
    deliver_until_closed(tasks.instance_provision, job_of(instance, JobKind.INSTANCE_PROVISION))
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.RUNNING, instance.status_message
    return instance


# ------------------------------------------------------------------------------------------------ the renter

def test_a_deactivated_renters_running_instance_is_stopped_with_its_disk_and_its_booking_cancelled(sim_node):
    operator, renter = UserFactory(is_staff=True), UserFactory()
    running = backdate(_provisioned(renter, sim_node), minutes=10)
    queued = book(renter, sim_node)  # its provisioning not run yet
    assert queued.status == InstanceStatus.REQUESTED

    change = account_deactivate(user=renter, by=operator, reason="Card reported stolen")

    assert not User.objects.get(pk=renter.pk).is_active
    assert (change.active, change.by_id, change.reason) == (False, operator.pk, "Card reported stolen")
    # Before: both left as they were, the first billed every minute with nobody able to stop it.
    running.refresh_from_db()
    assert running.status == InstanceStatus.STOPPING
    billed = running.billed_seconds
    assert billed >= 600  # its time up to the stop was charged at the stop, as any renter's stop
    assert _status(queued) == InstanceStatus.DESTROYING
    # The stop and the cancellation are the renter's own verbs' jobs, run as a worker runs them.
    deliver_until_closed(tasks.instance_stop, job_of(running, JobKind.INSTANCE_STOP))
    deliver_until_closed(tasks.instance_provision, job_of(queued, JobKind.INSTANCE_PROVISION))  # sees it cancelled
    deliver_until_closed(tasks.instance_destroy, job_of(queued, JobKind.INSTANCE_DESTROY))
    running.refresh_from_db()
    assert running.status == InstanceStatus.STOPPED, running.status_message
    assert vm_state(running) == "stopped"  # the disk is kept: a mistaken deactivation loses nothing
    assert _status(queued) == InstanceStatus.DESTROYED
    assert not Gpu.objects.filter(node=sim_node).exclude(status="free").exists()
    usage_meter()
    assert Instance.objects.get(pk=running.pk).billed_seconds == billed  # no GPU time after the stop
    assert_billing_invariants()

    [notice] = _told(renter, "account_deactivated")
    assert notice.payload["instances_stopped"] == [running.pk]
    assert notice.payload["bookings_cancelled"] == [queued.pk]
    assert "Card reported stolen" in notice.body and "disks are kept" in notice.body
    assert notice.email_status == "pending"  # e-mailed whatever the preferences: the owner cannot log in


def test_deactivating_twice_does_nothing_more(sim_node):
    renter = UserFactory()
    running = _provisioned(renter, sim_node)
    account_deactivate(user=renter, reason="first")
    assert account_deactivate(user=renter, reason="again") is None
    assert AccountStatusChange.objects.filter(user=renter).count() == 1
    assert len(_told(renter, "account_deactivated")) == 1
    assert Instance.objects.get(pk=running.pk).status == InstanceStatus.STOPPING
    assert Job.objects.filter(instance=running, kind=JobKind.INSTANCE_STOP).count() == 1


def test_an_operator_cannot_deactivate_their_own_account():
    operator = UserFactory(is_staff=True)
    with pytest.raises(ValidationFailed):
        account_deactivate(user=operator, by=operator)
    assert User.objects.get(pk=operator.pk).is_active


def test_an_instance_that_comes_to_run_after_the_deactivation_is_stopped_by_the_sweep():
    """A start under way at the deactivation (nothing to stop yet), and an account turned off without the service
    (a script): the sweep stops what they run and cancels what they booked."""
    node = make_listed_node(gpu_count=4)
    renter, other = UserFactory(), UserFactory()
    starting = run(book(renter, node))
    instance_svc.instance_restart(instance=starting)  # starting: no verb stops it now
    account_deactivate(user=renter)
    assert _status(starting) == InstanceStatus.STARTING
    run(starting)  # the restart's job brings it up
    assert _status(starting) == InstanceStatus.RUNNING
    elsewhere = run(book(other, node))
    queued = book(other, node)
    User.objects.filter(pk=other.pk).update(is_active=False)  # not through the service

    halted = accounts_deactivated_enforce()

    assert sorted(halted.stopped) == sorted([starting.pk, elsewhere.pk]) and halted.cancelled == [queued.pk]
    assert _status(starting) == _status(elsewhere) == InstanceStatus.STOPPING
    assert _status(queued) == InstanceStatus.DESTROYING
    assert accounts_deactivated_enforce().stopped == []  # nothing more the next minute


# ---------------------------------------------------------------------------------------------- the provider

def _offered(api, node) -> dict[str, bool]:
    """Whether the node is on the offers of the API, the web page (and its rent page) and the Vast-compatible API."""
    vast = api.post("/compat/vast/api/v0/bundles/", {"rentable": {"eq": True}}, format="json").json()["offers"]
    web = Client()
    web.force_login(api.user)
    page = web.get("/offers/").content.decode()
    return {"api": node.pk in [o["id"] for o in api.get("/api/v1/offers/").json()["results"]],
            "web": node.pk in [int(i) for i in re.findall(r'href="/offers/(\d+)/rent/"', page)],
            "rent page": web.get(f"/offers/{node.pk}/rent/").status_code == 200,
            "vast": any(o["id"] // 100 == node.pk for o in vast)}


def test_a_deactivated_providers_nodes_leave_the_offers_and_refuse_bookings_but_keep_their_renters(
        api, client_for):
    provider = UserFactory()
    node = make_listed_node(provider, gpu_count=4)
    renter = UserFactory()
    theirs = run(book(renter, node))
    everywhere = {"api": True, "web": True, "rent page": True, "vast": True}
    assert _offered(api, node) == everywhere

    account_deactivate(user=provider, reason="Fraud review")

    # Before: still listed, and booked.
    assert _offered(api, node) == dict.fromkeys(everywhere, False)
    r = client_for(renter).post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "pytorch-2-5",
                                                       "ssh_public_key": theirs.ssh_public_keys[0]}, format="json")
    assert r.status_code == 409, r.content
    assert "provider's account was deactivated" in r.json()["detail"]
    with pytest.raises(Conflict, match="takes no new rentals"):
        volume_create(owner=renter, node_id=node.pk, size_gb=10, label="data")
    # What renters have there is theirs: still running, and billed.
    assert _status(theirs) == InstanceStatus.RUNNING
    backdate(theirs, minutes=10)
    usage_meter()
    assert Instance.objects.get(pk=theirs.pk).billed_seconds >= 600
    assert _status(theirs) == InstanceStatus.RUNNING
    assert accounts_deactivated_enforce().stopped == []

    account_reactivate(user=provider, reason="Cleared")
    assert _offered(api, node) == everywhere
    assert _told(provider, "account_reactivated")


def test_reactivation_restarts_nothing():
    renter = UserFactory()
    instance = run(book(renter, make_listed_node(gpu_count=2)))
    account_deactivate(user=renter)
    instance_svc.instance_mark_stopped(instance_id=instance.pk)
    assert account_reactivate(user=renter).active
    assert User.objects.get(pk=renter.pk).is_active
    assert _status(instance) == InstanceStatus.STOPPED
    assert accounts_deactivated_enforce().stopped == []
    [notice] = _told(renter, "account_reactivated")
    assert f"({instance.pk}) stay stopped" in notice.body
    assert account_reactivate(user=renter) is None  # on already


def test_a_booking_waits_for_a_deactivation_under_way_and_is_refused():
    """The booking reads the provider's account under its row lock: a deactivation not committed yet holds it, and
    the booking that waited reads it as committed (a plain read would have kept its snapshot: active)."""
    provider, renter = UserFactory(), UserFactory()
    node = make_listed_node(provider, gpu_count=2)
    deactivated, release, outcome = threading.Event(), threading.Event(), {}

    def deactivate():
        try:
            with transaction.atomic():
                account_deactivate(user=User.objects.get(pk=provider.pk))
                deactivated.set()
                release.wait(10)
        finally:
            connection.close()

    def booking():
        try:
            book(renter, node)
            outcome["booked"] = True
        except Conflict as exc:
            outcome["refused"] = str(exc)
        finally:
            connection.close()

    first = threading.Thread(target=deactivate)
    first.start()
    assert deactivated.wait(10)
    second = threading.Thread(target=booking)
    second.start()
    time.sleep(0.5)
    assert not outcome, "the booking did not wait for the deactivation"
    release.set()
    first.join(10)
    second.join(10)
    assert "provider's account was deactivated" in outcome.get("refused", ""), outcome
    assert not Instance.objects.filter(node=node).exists()


# ------------------------------------------------------- new load on a deactivated provider's node: a stopped one

def _stopped(renter, node, *, hours: float = 1) -> Instance:
    """A stopped instance whose disk has `hours` of storage not billed yet (a start would bill it first)."""
    instance = run(book(renter, node))
    instance_svc.instance_stop(instance=instance)
    instance_svc.instance_mark_stopped(instance_id=instance.pk)
    Instance.objects.filter(pk=instance.pk).update(stopped_at=timezone.now() - timedelta(hours=hours))
    return Instance.objects.get(pk=instance.pk)


def _kept(instance: Instance) -> dict:
    """What a refused start must leave as it was: the GPUs, allocations, instances and jobs, the disk's billing."""
    return {**snapshot(), "ledger": LedgerTransaction.objects.count(),
            "disk": Instance.objects.values_list("disk_billed_until", "disk_billed_seconds", "disk_cost_micros",
                                                 "vm_cleanup_pending").get(pk=instance.pk)}


def test_a_stopped_instance_on_a_deactivated_providers_node_does_not_start(client_for, settings):
    """Found last session: the renter's stopped instance started on a deactivated provider's server, taking its
    GPUs again, although the server takes no booking. A start is new load: now refused as a booking is (409 saying
    why, from the API, the Vast-compatible API and the page's button), nothing written, the disk kept and billed as
    before; a short balance is not asked to top up for a start that cannot happen."""
    provider, renter = UserFactory(), UserFactory()
    node = make_listed_node(provider, gpu_count=2)
    stopped = _stopped(renter, node)
    account_deactivate(user=provider, reason="Fraud review")
    settings.BILLING_REQUIRE_FUNDS = True  # the renter has no funds: the refusal that no top-up mends comes first
    before = _kept(stopped)
    api = client_for(renter)

    r = api.post(f"/api/v1/instances/{stopped.pk}/start/")

    # Before: a 402 asking for a top-up, and once topped up a 202, the instance taking the node's GPUs again.
    assert r.status_code == 409, r.content
    detail = r.json()["detail"]
    assert "provider account was deactivated" in detail and "stays stopped with its disk kept" in detail, detail
    assert _kept(stopped) == before  # still stopped, no GPU taken, no job, its disk's billing where it was
    assert _status(stopped) == InstanceStatus.STOPPED
    vast = api.put(f"/compat/vast/api/v0/instances/{stopped.pk}/", {"state": "running"}, format="json")
    assert vast.status_code == 409 and "provider account was deactivated" in vast.json()["msg"], vast.content
    web = Client()
    web.force_login(renter)
    page = web.post(f"/instances/{stopped.pk}/start/", follow=True).content.decode()
    assert "provider account was deactivated" in page
    # Its other new load is refused too: a volume there (the booking's refusal is the first test's).
    volume = api.post("/api/v1/volumes/", {"offer": node.pk, "size_gb": 10}, format="json")
    assert volume.status_code == 409, volume.content
    assert "takes no new rentals now: its provider's account was deactivated" in volume.json()["detail"]
    assert _kept(stopped) == before

    account_reactivate(user=provider)
    r = api.post(f"/api/v1/instances/{stopped.pk}/start/")
    assert r.status_code == 402, r.content  # the funds check still holds, after the node's refusals
    fund(renter, "100")
    r = api.post(f"/api/v1/instances/{stopped.pk}/start/")
    assert r.status_code == 202 and r.json()["status"] == InstanceStatus.STARTING, r.content
    assert Job.objects.filter(instance=stopped, kind=JobKind.INSTANCE_START).count() == 1
    assert Instance.objects.get(pk=stopped.pk).disk_billed_seconds > before["disk"][1]  # billed up to the start
    assert_billing_invariants()


def test_a_start_waits_for_a_deactivation_under_way_and_is_refused():
    """The start reads the provider's account under its row lock, as a booking does: a deactivation not committed
    yet holds it, and the start that waited reads it as committed."""
    provider, renter = UserFactory(), UserFactory()
    node = make_listed_node(provider, gpu_count=2)
    stopped = _stopped(renter, node)
    deactivated, release, outcome = threading.Event(), threading.Event(), {}

    def deactivate():
        try:
            with transaction.atomic():
                account_deactivate(user=User.objects.get(pk=provider.pk))
                deactivated.set()
                release.wait(10)
        finally:
            connection.close()

    def start():
        try:
            instance_svc.instance_start(instance=Instance.objects.get(pk=stopped.pk))
            outcome["started"] = True
        except Conflict as exc:
            outcome["refused"] = str(exc)
        finally:
            connection.close()

    first = threading.Thread(target=deactivate)
    first.start()
    assert deactivated.wait(10)
    second = threading.Thread(target=start)
    second.start()
    time.sleep(0.5)
    assert not outcome, "the start did not wait for the deactivation"
    release.set()
    first.join(10)
    second.join(10)
    assert "provider account was deactivated" in outcome.get("refused", ""), outcome
    assert _status(stopped) == InstanceStatus.STOPPED
    assert not Job.objects.filter(instance=stopped, kind=JobKind.INSTANCE_START).exists()
