"""The platform names the cards it allocated by UUID as well as by index when it asks a node to create or start a VM:
when a card falls off the bus, nvidia-smi numbers the others anew, and a VM named by index alone could land on
another renter's card. The node's refusal reaches the renter as the job's failure, with the card named.

Real parts: a simulated server over SSH with the real agent (tests/marketplace/sim_renting.py), PostgreSQL; the
jobs run in this process as a worker's delivery runs them. A card falls off when the server's profile stops listing
it and lists the cards after it one index lower, as nvidia-smi does; the platform has not run an inventory since."""
import json
from pathlib import Path

import pytest

from core import dispatch
from marketplace.models import Gpu, Instance, InstanceStatus
from marketplace.services import instances as instance_svc
from provisioning import tasks
from provisioning.agent import gpumarket_agent as agent
from provisioning.models import JobKind, JobStatus
from provisioning.services.vms import create_request
from tests.factories import UserFactory
from tests.marketplace.renting_helpers import book

from .sim_renting import (  # noqa: F401 (fixtures)
    deliver_until_closed,
    job_of,
    running_instance,
    sent_jobs_fixture,
    sim_node_fixture,
    simbase_fixture,
    simnode_fixture,
    stopped_instance,
    vm_state,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture(name="cards")
def cards_fixture(sim_node, simnode):
    """The server's card UUIDs by index, recorded on the node's GPU rows (as its inventory records them); the
    profile is put back after the test."""
    profile = Path(simnode["node_dir"]) / "profile.json"
    original = profile.read_text()
    uuids = [g["uuid"] for g in agent.load_profile(str(profile))[1]]
    for index, uuid in enumerate(uuids):
        Gpu.objects.filter(node=sim_node, index=index).update(uuid=uuid)
    try:
        yield uuids
    finally:
        profile.write_text(original)


def fall_off(simnode, index: int) -> None:
    profile = Path(simnode["node_dir"]) / "profile.json"
    data = json.loads(profile.read_text())
    kept = [line.split(",", 1)[1] for n, line in enumerate(data["nvidia_smi"]) if n != index]
    data["nvidia_smi"] = [f"{n},{rest}" for n, rest in enumerate(kept)]
    profile.write_text(json.dumps(data))


def node_record(simnode, instance: Instance) -> dict:
    return json.loads((Path(simnode["node_dir"]) / "vms" / instance.vm_id / "vm.json").read_text())


def test_the_create_and_start_requests_name_each_card_by_uuid_in_the_order_of_its_index(sim_node, cards):
    instance = book(UserFactory(), sim_node, num_gpus=2)
    request = create_request(instance)
    assert (request["gpu_indices"], request["gpu_uuids"]) == ([0, 1], cards)
    Gpu.objects.filter(node=sim_node, index=0).update(uuid="")  # older data: no UUID recorded for that card
    assert create_request(instance)["gpu_uuids"] == [None, cards[1]]
    listed = instance_svc.instances_for_user(user=instance.renter).get(pk=instance.pk)  # prefetched allocations
    assert instance_svc.instance_gpu_uuids(instance=listed) == [None, cards[1]]


def test_a_vm_is_created_stopped_and_started_on_the_cards_it_was_given(sim_node, simnode, cards):
    instance = stopped_instance(sim_node)  # (a stopped instance holds no GPU: the node's record says which)
    spec = node_record(simnode, instance)["spec"]
    assert spec["gpu_uuids"] == [cards[spec["gpu_indices"][0]]]
    instance_svc.instance_start(instance=instance)
    deliver_until_closed(tasks.instance_start, job_of(instance, JobKind.INSTANCE_START))
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.RUNNING and vm_state(instance) == "running", instance.status_message


def test_a_start_after_its_card_fell_off_is_refused_and_the_renter_told_which_card(sim_node, simnode, cards):
    """Before: the card at its index now (another card, maybe another renter's) was started as the VM's."""
    instance = stopped_instance(sim_node)
    index = node_record(simnode, instance)["spec"]["gpu_indices"][0]  # the card it takes back at its start
    fall_off(simnode, index)  # the card after it, if any, takes its index
    instance_svc.instance_start(instance=instance)
    job = job_of(instance, JobKind.INSTANCE_START)
    deliver_until_closed(tasks.instance_start, job)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.STOPPED
    # In the platform's words, not the node's (review r55); the job keeps the agent's, naming the card.
    assert instance.status_message == (
        "The start did not go through: A GPU it was given is no longer on its server (fallen off the bus?). It is "
        "stopped, its disk kept; start it again.")
    assert vm_state(instance) == "stopped"
    job.refresh_from_db()
    assert job.status == JobStatus.FAILED and cards[index] in job.error


def test_a_create_on_a_card_that_fell_off_fails_the_instance_and_bills_nothing(sim_node, simnode, cards,
                                                                              monkeypatch):
    queued = []
    monkeypatch.setattr(dispatch, "send", lambda name, *args, **kw: queued.append((name, *args)))
    instance = book(UserFactory(), sim_node)
    index = instance_svc.instance_gpu_indices(instance=instance)[0]
    fall_off(simnode, index)
    deliver_until_closed(tasks.instance_provision, job_of(instance, JobKind.INSTANCE_PROVISION))
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.FAILED
    assert "A GPU it was given is no longer on its server (fallen off the bus?)." in instance.status_message, \
        instance.status_message
    error = job_of(instance, JobKind.INSTANCE_PROVISION).error
    assert f"GPU {cards[index]} (index {index} when it was allocated) is not on this node now (fallen off the bus?)" \
        in error, error
    assert vm_state(instance) is None  # no VM on the card at that index now
    assert instance.billed_seconds == 0 and not instance.usage_intervals.exists()
    assert Gpu.objects.get(node=sim_node, index=index).status == "free"  # released: its health check finds it lost
    # ... queued at once, not at the next beat, so that no other booking lands on it meanwhile.
    assert ("provisioning.tasks.fleet_health_batch", [sim_node.pk]) in queued
    tasks.fleet_health_batch([sim_node.pk])  # as a worker runs it
    lost = Gpu.objects.get(node=sim_node, uuid=cards[index])
    assert lost.lost_at is not None and lost.status == "unavailable"
