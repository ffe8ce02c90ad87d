"""The verification end to end (provisioning.services.verification.node_verify_run against a simulated server over
real SSH): its inventory finds two rented cards gone, the renter of one stops it between the look and the inventory's
judging, and Celery's soft time limit lands in the other holder's interruption. Before, the give-back of what the stop
billed past the cards' last sighting came in the loop with the interruptions, after that one: the verification ended
with nothing given back, and its retry (whose look begins after the stop) could not give it. Now it is given back
right after the look, once; the retried verification and a health check give nothing more. Only the moments of the
renter's stop and of the limit are chosen here."""
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from celery.exceptions import SoftTimeLimitExceeded

from billing.models import BillingEvent, EventKind, LedgerTransaction, UsageInterval
from billing.services.metering import cost_for
from marketplace.models import Gpu, Instance, InstanceStatus, Node
from marketplace.services import instances as svc
from provisioning import sim
from provisioning.models import OPEN_JOB_STATUSES, Job
from provisioning.services import verification
from provisioning.services.fleet_record import nodes_record_health
from provisioning.services.nodes import HealthResult, running_vm_ids_by_node
from provisioning.services.runner import job_begin
from provisioning.sim import PROFILES_DIR
from tests.billing.conftest import Clock
from tests.billing.helpers import balance, fund, running
from tests.factories import UserFactory, make_listed_node

pytestmark = [pytest.mark.django_db, pytest.mark.slow]

PROFILE = "a100-80gb-sxm-x4"
FUNDS = 50_000_000
SEEN_S = 60  # whole seconds of the runs up to the last health check (0.4 s after that)


@pytest.fixture(scope="module")
def simbase(tmp_path_factory):
    base = tmp_path_factory.mktemp("r47-simnodes")
    yield base
    sim.nodes_down(base)


@pytest.fixture(scope="module")
def simnode(simbase):
    return sim.node_up(PROFILE, simbase)


@pytest.fixture
def clock(monkeypatch):
    c = Clock(datetime(2026, 3, 2, 12, 0, 0, 250_000, tzinfo=UTC))
    monkeypatch.setattr("django.utils.timezone.now", c)
    return c


def _profile() -> dict:
    return json.loads((PROFILES_DIR / f"{PROFILE}.json").read_text())


def _cards_listed(simnode, lines: list[str]) -> None:
    """What the sim server's nvidia-smi lists from now on (the agent reads its profile at every call)."""
    data = _profile()
    data["nvidia_smi"] = lines
    (Path(simnode["node_dir"]) / "profile.json").write_text(json.dumps(data))


@pytest.fixture
def rented(simnode, simbase, clock):
    """The sim server as a listed node whose GPU rows carry its cards' UUIDs; every card rented: another renter's
    1-GPU instance first (judged first), the renter's 2-GPU one, a third renter's 1-GPU one on the card that stays.
    A health check 60.4 s after they started lists every card and VM; a minute on, the verification looks."""
    _cards_listed(simnode, _profile()["nvidia_smi"])
    host = make_listed_node(UserFactory(), gpu_model=_profile()["declared"]["gpu_model"], gpu_count=4,
                            address=simnode["address"], ssh_port=simnode["ssh_port"], ssh_user=simnode["ssh_user"],
                            host_key_fingerprint=simnode["host_key_fingerprint"])
    sim.node_authorize(simnode["ssh_port"], host.ssh_public_key, simbase)
    lines = _profile()["nvidia_smi"]
    for line in lines:
        index, uuid = (part.strip() for part in line.split(",")[:2])
        Gpu.objects.filter(node=host, index=int(index)).update(uuid=uuid)
    renter, other, third = UserFactory(), UserFactory(), UserFactory()
    for user in (renter, other, third):
        fund(user, "50")
    held = running(other, host, num_gpus=1)
    lost = running(renter, host, num_gpus=2)
    stays = running(third, host, num_gpus=1)
    assert held.pk < lost.pk
    clock.advance(SEEN_S + 0.4)
    _check(host, clock, lines, [held, lost, stays])
    gone = set(Gpu.objects.filter(allocations__instance__in=[held, lost]).values_list("uuid", flat=True))
    kept_lines = [line for line in lines if line.split(",")[1].strip() not in gone]
    assert len(gone) == 3 and len(kept_lines) == 1
    clock.advance(59)
    _cards_listed(simnode, kept_lines)
    return renter, Node.objects.get(pk=host.pk), held, lost, stays, kept_lines


def _check(host, clock, lines, instances):
    uuids = [line.split(",")[1].strip() for line in lines]
    result = HealthResult(host.pk, True, vms={i.vm_id: "running" for i in instances}, probed_at=clock.now,
                          seconds=0.5, gpu_uuids=uuids)
    clock.advance(1)
    nodes_record_health([result], running_vm_ids=running_vm_ids_by_node(node_ids=[host.pk],
                                                                        probed_before=result.probed_at))


def _verify(host):
    verification.node_verify_run(job=job_begin(job_id=verification.node_verify_request(node=host).pk))


def _given_back(instance) -> list[LedgerTransaction]:
    charges = UsageInterval.objects.filter(instance=instance).values_list("transaction_id", flat=True)
    return list(LedgerTransaction.objects.filter(reverses_id__in=charges))


def test_a_verification_stopped_in_its_interruptions_has_given_back_the_stop_racing_it(
        rented, clock, monkeypatch):
    renter, host, held, lost, stays, kept_lines = rented
    price = Instance.objects.get(pk=lost.pk).price_per_hour_micros
    kept = cost_for(price, SEEN_S)
    credits = BillingEvent.objects.filter(user=renter, kind=EventKind.CREDIT).count()
    read_holders, stopped = verification.gpu_holders_by_uuid, []

    def holders_then_stop(node):  # after the inventory's answer, before it is judged: the renter's stop lands
        clock.advance(8)
        stopped.append(svc.instance_stop(instance=Instance.objects.get(pk=lost.pk)))
        return read_holders(node)

    monkeypatch.setattr(verification, "gpu_holders_by_uuid", holders_then_stop)
    real = svc.instance_interrupt

    def interrupt(*, instance_id, **kwargs):
        if instance_id == held.pk:
            raise SoftTimeLimitExceeded()
        return real(instance_id=instance_id, **kwargs)

    monkeypatch.setattr(svc, "instance_interrupt", interrupt)
    with pytest.raises(SoftTimeLimitExceeded):
        _verify(host)
    assert stopped
    charged = cost_for(price, SEEN_S + 60 + 8)
    assert FUNDS - balance(renter) == kept, f"charged {FUNDS - balance(renter)} ({charged} by the stop), {kept} " \
                                            "up to the cards' last sighting"
    assert len(_given_back(lost)) == 1
    assert BillingEvent.objects.filter(user=renter, kind=EventKind.CREDIT).count() == credits + 1
    assert Instance.objects.get(pk=held.pk).status == InstanceStatus.RUNNING  # the limit came first

    # Its retry (the worker's, its look after the stop) and a health check: the other holder interrupted at the
    # sighting, the renter given nothing more.
    monkeypatch.setattr(verification, "gpu_holders_by_uuid", read_holders)
    monkeypatch.setattr(svc, "instance_interrupt", real)
    Job.objects.filter(node=host, status__in=OPEN_JOB_STATUSES).update(status="failed", finished_at=clock.now)
    clock.advance(30)
    _verify(host)
    assert Instance.objects.get(pk=held.pk).status == InstanceStatus.INTERRUPTED
    clock.advance(30)
    _check(host, clock, kept_lines, [stays])
    assert FUNDS - balance(renter) == kept and len(_given_back(lost)) == 1
    assert BillingEvent.objects.filter(user=renter, kind=EventKind.CREDIT).count() == credits + 1
