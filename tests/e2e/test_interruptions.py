"""A rented node dies, end to end: a real worker, a simulated server over SSH, PostgreSQL and Redis.

The node's sshd is cut (its VMs keep running, as in a network cut) and the fleet health check runs as beat
runs it: the instance is interrupted within two checks, billing stops at the last healthy probe, the renter is
told and credited; when the node answers again the instance resumes, or is cleaned up when the renter
destroyed it meanwhile, or fails with a reason when its VM is gone.
"""
import json
import shutil
import time
from pathlib import Path

import pytest

from billing.models import BillingEvent, EventKind, LedgerTransaction, TransactionKind
from billing.services.metering import usage_meter
from marketplace.models import Gpu, Instance, Interruption, Node
from provisioning import sim
from provisioning.agent.gpumarket_agent import procs
from provisioning.models import OPEN_JOB_STATUSES, Job
from provisioning.services.maintenance import nodes_health_check
from provisioning.services.nodes import node_session
from tests.billing.invariants import assert_billing_invariants
from tests.e2e.test_instances import _renter_key, _ssh, _status, _verified_node
from tests.live import wait_until

pytestmark = pytest.mark.slow


def _rent(node, renter_api, tmp_path, num_gpus=1):
    key_path, public = _renter_key(tmp_path)
    r = renter_api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": num_gpus, "image": "cuda-12-4",
                                               "ssh_public_key": public}, format="json")
    assert r.status_code == 201, r.content
    return _status(r.json()["id"], "running"), key_path


def _cut_until_interrupted(instance, info, simnodes_dir, checks=2):
    """Cut the node's network and run the health check `checks` times, as beat would."""
    nodes_health_check()
    sim.node_cut(info["ssh_port"], simnodes_dir)
    for _ in range(checks):
        nodes_health_check()
    assert Instance.objects.get(pk=instance.pk).status == "interrupted"


def _vms(node):
    with node_session(Node.objects.get(pk=node.pk)) as session:
        return {vm["vm_id"]: vm["state"] for vm in session.agent("vm", "list", {"runtime": "sim"})["vms"]}


def test_a_dead_node_interrupts_then_resumes_its_instance(worker, sim_node_factory, api, other_api, tmp_path,
                                                         simnodes_dir):
    node, info = _verified_node(api, sim_node_factory)
    instance, key_path = _rent(node, other_api, tmp_path)
    assert nodes_health_check()["failed"] == 0
    last_healthy = Node.objects.get(pk=node.pk).last_seen_at

    sim.node_cut(info["ssh_port"], simnodes_dir)
    time.sleep(1.5)  # some time lost, so that there is something to credit
    first = nodes_health_check()
    assert first["failed"] == 1 and Instance.objects.get(pk=instance.pk).status == "running"
    usage_meter()  # a tick while the node is silent bills nothing past its last healthy probe
    second = nodes_health_check()
    assert second["interrupted"] == 1
    instance.refresh_from_db()
    assert instance.status == "interrupted", instance.status_message
    assert instance.billed_until is None or instance.billed_until <= last_healthy
    assert not instance.usage_intervals.filter(ended_at__gt=last_healthy).exists()
    interruption = Interruption.objects.get(instance=instance)
    assert interruption.started_at == last_healthy and interruption.cause == "node_lost"
    assert BillingEvent.objects.filter(user=instance.renter, kind=EventKind.INSTANCE_INTERRUPTED).exists()
    assert LedgerTransaction.objects.filter(kind=TransactionKind.SERVICE_CREDIT).exists()
    body = other_api.get(f"/api/v1/instances/{instance.pk}/").json()
    assert body["status"] == "interrupted"

    sim.node_restore(info["ssh_port"], simnodes_dir)
    back = nodes_health_check()
    assert back["failed"] == 0 and back["recovered"] == 1
    instance.refresh_from_db()
    assert instance.status == "running", instance.status_message
    assert Interruption.objects.get(instance=instance).outcome == "resumed"
    assert BillingEvent.objects.filter(user=instance.renter, kind=EventKind.INSTANCE_RESUMED).exists()
    # The renter's VM lived through it: the ssh command still works.
    body = other_api.get(f"/api/v1/instances/{instance.pk}/").json()
    seen = _ssh(body["ssh_command"], key_path, "echo alive")
    assert seen.returncode == 0 and "alive" in seen.stdout, seen.stderr
    assert_billing_invariants()


def test_destroy_while_unreachable_ends_billing_at_once_and_the_vm_goes_when_the_node_returns(
        worker, sim_node_factory, api, other_api, tmp_path, simnodes_dir):
    node, info = _verified_node(api, sim_node_factory)
    instance, _ = _rent(node, other_api, tmp_path)
    _cut_until_interrupted(instance, info, simnodes_dir)

    r = other_api.delete(f"/api/v1/instances/{instance.pk}/")
    assert r.status_code == 202 and r.json()["status"] == "destroyed", r.content
    billed = Instance.objects.get(pk=instance.pk).billed_seconds
    usage_meter()
    assert Instance.objects.get(pk=instance.pk).billed_seconds == billed
    assert Gpu.objects.filter(node=node, status="rented").count() == 1  # until the VM is really gone

    sim.node_restore(info["ssh_port"], simnodes_dir)
    assert nodes_health_check()["failed"] == 0
    assert instance.vm_id not in _vms(node)
    assert Gpu.objects.filter(node=node, status="rented").count() == 0
    assert Node.objects.get(pk=node.pk).state == "active"
    assert_billing_invariants()


def test_a_node_that_returns_without_the_vm_fails_the_instance_with_a_reason(
        worker, sim_node_factory, api, other_api, tmp_path, simnodes_dir):
    node, info = _verified_node(api, sim_node_factory)
    instance, _ = _rent(node, other_api, tmp_path)
    _cut_until_interrupted(instance, info, simnodes_dir, checks=3)
    assert Node.objects.get(pk=node.pk).state == "offline"
    # The server rebooted and lost the VM while it was away.
    vm_dir = Path(info["node_dir"]) / "vms" / instance.vm_id
    procs.kill_trees(procs.pids_matching(f"{vm_dir}/"))
    shutil.rmtree(vm_dir)

    sim.node_restore(info["ssh_port"], simnodes_dir)
    nodes_health_check()
    instance.refresh_from_db()
    assert instance.status == "failed" and "VM was gone" in instance.status_message
    assert Interruption.objects.get(instance=instance).outcome == "failed"
    assert BillingEvent.objects.filter(user=instance.renter, kind=EventKind.INSTANCE_LOST).exists()
    assert Gpu.objects.filter(node=node, status="rented").count() == 0
    assert_billing_invariants()


def test_a_vm_that_stops_on_a_healthy_node_is_started_again(worker, sim_node_factory, api, other_api, tmp_path):
    node, info = _verified_node(api, sim_node_factory)
    instance, key_path = _rent(node, other_api, tmp_path)
    vm_dir = Path(info["node_dir"]) / "vms" / instance.vm_id
    procs.kill_trees(procs.pids_matching(f"{vm_dir}/"))  # the VM dies; the node is fine
    summary = nodes_health_check()
    assert summary["interrupted"] == 1 and summary["recovered"] == 1
    assert Interruption.objects.get(instance=instance).cause == "vm_lost"
    instance = _status(instance.pk, "running")  # the worker started it again
    body = other_api.get(f"/api/v1/instances/{instance.pk}/").json()
    seen = _ssh(body["ssh_command"], key_path, "echo alive")
    assert seen.returncode == 0 and "alive" in seen.stdout, seen.stderr


def test_a_card_that_falls_off_the_bus_interrupts_its_instance_until_it_answers_again(
        worker, sim_node_factory, api, other_api, tmp_path):
    """The server answers and the VM runs, but nvidia-smi no longer lists the instance's card: interrupted at the
    last check that saw it, left waiting (not resumed while its VM runs), resumed once the card is back. The
    other card stays free; the changed inventory has the node verified again (rejected while a card is missing)."""
    node, info = _verified_node(api, sim_node_factory)
    instance, _ = _rent(node, other_api, tmp_path)
    booked = instance.price_per_hour_micros
    gpu = Gpu.objects.get(allocations__instance=instance, allocations__released_at__isnull=True)
    assert nodes_health_check()["failed"] == 0
    seen = Node.objects.get(pk=node.pk).last_seen_at
    profile = Path(info["node_dir"]) / "profile.json"
    whole = profile.read_text()
    data = json.loads(whole)
    data["nvidia_smi"] = [line for line in data["nvidia_smi"] if not line.startswith(f"{gpu.index},")]
    profile.write_text(json.dumps(data))

    summary = nodes_health_check()
    assert summary["failed"] == 0 and summary["interrupted"] == 1, summary
    instance.refresh_from_db()
    assert instance.status == "interrupted", instance.status_message
    interruption = Interruption.objects.get(instance=instance)
    assert interruption.cause == "gpu_lost" and interruption.started_at == seen
    assert Gpu.objects.get(pk=gpu.pk).lost_at is not None
    assert Gpu.objects.filter(node=node, status="free").exclude(pk=gpu.pk).exists()
    wait_until(lambda: not Job.objects.filter(node=node, kind="node_verify", status__in=OPEN_JOB_STATUSES).exists(),
               90, what="the re-verification of the changed inventory")
    assert nodes_health_check()["failed"] == 0
    assert Instance.objects.get(pk=instance.pk).status == "interrupted"  # its VM runs, its card does not

    profile.write_text(whole)  # the card answers again (after the provider's restart, say)
    nodes_health_check()
    wait_until(lambda: not Job.objects.filter(node=node, kind="node_verify", status__in=OPEN_JOB_STATUSES).exists(),
               90, what="the re-verification of the restored inventory")
    assert Gpu.objects.get(pk=gpu.pk).lost_at is None
    nodes_health_check()
    instance = _status(instance.pk, "running")
    assert Interruption.objects.get(instance=instance).outcome == "resumed"
    assert booked > 0 and instance.price_per_hour_micros == booked  # the loss cut no price: it was not billed
