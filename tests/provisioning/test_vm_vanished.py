"""A renter's VM whose container was removed on its node (`docker rm`, `docker container prune`), end to end: the
platform's jobs, health record and reconciler against the real agent, called in-process with the stand-in `docker`
CLI of test_agent_docker.py (found by review; each test failed before its fix). At the end, a libvirt node whose
virsh fails a lookup for a while (libvirtd restarting), with the stand-in virsh of test_agent_libvirt_cards.py: no
VM of it is missing then.

Before: the agent kept the record holding its GPU, answered `vm start` with command_failed ("No such container")
and `vm stop` with ok, so the start job's failure marked the instance "stopped, start it again" at every start,
its absent disk billed for good, and every later booking on that GPU failed gpu_busy."""
import json
import os
import sys
from datetime import timedelta

import pytest
from django.utils import timezone

from billing.services.storage import storage_meter
from core.errors import Conflict
from marketplace.models import Gpu, Instance, InstanceStatus, Volume, VolumeState
from marketplace.services import instances as instance_svc
from marketplace.services import volumes as volume_svc
from provisioning import tasks
from provisioning.agent import gpumarket_agent as agent
from provisioning.models import Job, JobKind, JobStatus, NodeEvent
from provisioning.services.fleet_record import node_record_health
from provisioning.services.reconcile import node_reconcile
from provisioning.ssh_errors import AgentFailed
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book
from tests.provisioning.test_agent_docker import FAKE_DOCKER, SAMPLES
from tests.provisioning.test_agent_gpu_uuids import A, B
from tests.provisioning.test_agent_libvirt_cards import FAKE_NVIDIA_SMI, FAKE_VIRSH, TOUCH_OUTPUT, TOUCH_OVERLAY

pytestmark = pytest.mark.django_db


class AgentNode:
    """A node: the agent in-process behind the platform's session, its engine a stand-in CLI."""

    def __init__(self, tmp_path, env):
        self.tmp_path, self.env = tmp_path, env

    def session(self, node, *args, **kwargs):
        env = self.env

        class Session:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def agent(self, cmd, sub=None, request=None, timeout=None):
                answer, _ = agent.handle([cmd] + ([sub] if sub else []), json.dumps(request or {}), env)
                if not answer["ok"]:
                    raise AgentFailed(answer["error"])
                return answer

        return Session()


class DockerNode(AgentNode):
    def containers(self):
        path = self.tmp_path / "containers.json"
        state = json.loads(path.read_text()) if path.exists() else {}
        return {k: v for k, v in state.items() if k.startswith("gpumarket-")}

    def prune(self, vm_id):
        """The provider removes the container behind the platform's back."""
        path = self.tmp_path / "containers.json"
        state = json.loads(path.read_text())
        del state["gpumarket-" + vm_id]
        path.write_text(json.dumps(state))


@pytest.fixture
def docker_node(tmp_path, monkeypatch):
    fakebin = tmp_path / "bin"
    fakebin.mkdir()
    (fakebin / "docker").write_text(FAKE_DOCKER)
    (fakebin / "nvidia-smi").write_text(
        f"#!/bin/sh\ncase \"$1\" in --query-gpu=*) cat {SAMPLES / 'a100_sxm4_80gb_x4.csv'};; "
        f"*) cat {SAMPLES / 'h100_sxm_x1_table.txt'};; esac\n")
    for script in fakebin.iterdir():
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fakebin}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DOCKER_STATE", str(tmp_path / "containers.json"))
    monkeypatch.setenv("FAKE_DOCKER_LOG", str(tmp_path / "docker.log"))
    fake = DockerNode(tmp_path, {"GPUMARKET_RUNTIME": "docker", "GPUMARKET_STATE_DIR": str(tmp_path / "state"),
                                 "GPUMARKET_PORT_RANGE": "41000-41999", "GPUMARKET_PUBLIC_HOST": "10.0.0.9"})
    for module in ("vms", "reconcile", "volumes"):
        monkeypatch.setattr(f"provisioning.services.{module}.node_session", fake.session)
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: None)
    monkeypatch.setattr("provisioning.services.vms.wait_for_ssh", lambda host, port, timeout=0: None)
    return fake


def run_job(task, instance, kind, **which):
    job = Job.objects.get(**(which or {"instance": instance}), kind=kind,
                          status__in=(JobStatus.QUEUED, JobStatus.RUNNING))
    task.push_request(id=f"task-{job.pk}", args=[job.pk], kwargs={}, retries=tasks.JOB_TASK_OPTIONS["max_retries"],
                      called_directly=False, delivery_info={"exchange": "", "routing_key": "celery"})
    try:
        tasks.run_job(task, job.pk)
    finally:
        task.pop_request()
    if instance is not None:
        instance.refresh_from_db()
    return instance


def node_with_one_gpu():
    """A docker node whose one GPU is the stand-in nvidia-smi's card A at index 0."""
    node = make_listed_node(gpu_count=1, runtime="docker")
    Gpu.objects.filter(node=node, index=0).update(uuid=A)
    return node


def rented(node):
    instance = run_job(tasks.instance_provision, book(UserFactory(), node), JobKind.INSTANCE_PROVISION)
    assert instance.status == InstanceStatus.RUNNING, instance.status_message
    return instance


def gpu0(node) -> str:
    return Gpu.objects.get(node=node, index=0).status


def test_a_stopped_instance_whose_container_was_removed_fails_at_its_start_and_frees_its_gpu(docker_node):
    node = node_with_one_gpu()
    instance = rented(node)
    instance_svc.instance_stop(instance=instance)
    assert run_job(tasks.instance_stop, instance, JobKind.INSTANCE_STOP).status == InstanceStatus.STOPPED
    docker_node.prune(instance.vm_id)

    instance_svc.instance_start(instance=instance)
    instance = run_job(tasks.instance_start, instance, JobKind.INSTANCE_START)
    assert instance.status == InstanceStatus.FAILED, instance.status_message  # before: stopped, "start it again"
    assert "no longer on the server" in instance.status_message and "Destroy it" in instance.status_message
    assert gpu0(node) == "free" and not instance.vm_cleanup_pending
    billed = (instance.disk_billed_seconds, instance.disk_cost_micros)
    storage_meter(now=timezone.now() + timedelta(hours=5))
    instance.refresh_from_db()
    assert (instance.disk_billed_seconds, instance.disk_cost_micros) == billed  # its absent disk: billed no more

    second = rented(node)  # the next renter gets the GPU (before: gpu_busy on the node)
    assert docker_node.containers() == {f"gpumarket-{second.vm_id}": "running"}

    instance_svc.instance_destroy(instance=instance)
    instance = run_job(tasks.instance_destroy, instance, JobKind.INSTANCE_DESTROY)
    assert instance.status == InstanceStatus.DESTROYED
    assert not (docker_node.tmp_path / "state" / "vms" / instance.vm_id).exists()  # its record removed


def test_a_stopped_instance_whose_container_was_removed_fails_at_the_reconcilers_pass(docker_node):
    node = node_with_one_gpu()
    instance = rented(node)
    instance_svc.instance_stop(instance=instance)
    run_job(tasks.instance_stop, instance, JobKind.INSTANCE_STOP)
    docker_node.prune(instance.vm_id)
    counts = node_reconcile(node)  # the node lists it `missing` (before: taken as stopped, left stopped)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.FAILED and counts["instances_failed"] == 1, instance.status_message
    assert NodeEvent.objects.filter(node=node, kind="vm_vanished", message__contains=f"instance {instance.pk}")
    assert gpu0(node) == "free"
    assert rented(node).status == InstanceStatus.RUNNING


def test_a_running_instance_whose_container_was_removed_fails_at_the_health_check(docker_node):
    """The health answer lists it `missing`: interrupted as gone (before: as stopped, then started again by the
    reconciler, whose start failed and stopped it for good)."""
    node = node_with_one_gpu()
    instance = rented(node)
    Instance.objects.filter(pk=instance.pk).update(started_at=timezone.now() - timedelta(minutes=5))
    docker_node.prune(instance.vm_id)
    health = docker_node.session(node).agent("health", None, {})
    assert health["vms"] == {instance.vm_id: "missing"}
    assert node_record_health(node_id=node.pk, ok=True, vms=health["vms"], probed_at=timezone.now()) == [instance.pk]
    assert "no longer on it" in instance.interruptions.get().detail
    node_reconcile(node)  # as the health batch does after lost VMs
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.FAILED, instance.status_message
    assert not Job.objects.filter(instance=instance, kind=JobKind.INSTANCE_START).exists()  # not started again
    assert gpu0(node) == "free"
    assert rented(node).status == InstanceStatus.RUNNING


@pytest.mark.parametrize("found_by", ["start", "reconcile"])
def test_the_volume_of_an_instance_failed_for_its_removed_container_can_be_deleted(docker_node, found_by):
    """The agent kept the record of a VM whose container was removed until the renter destroyed the instance, and
    the record counted as mounting its volumes: the renter's volume delete was refused by the node (volume_in_use:
    the volume available again, and billed again; found by review). Failing the instance for its gone VM, the
    platform has the node remove that record (only if its container is still gone), and the volume goes."""
    node = node_with_one_gpu()
    renter = UserFactory()
    volume = volume_svc.volume_create(owner=renter, node_id=node.pk, size_gb=1)
    run_job(tasks.volume_create, None, JobKind.VOLUME_CREATE, volume=volume)
    assert Volume.objects.get(pk=volume.pk).state == VolumeState.AVAILABLE
    instance = run_job(tasks.instance_provision, book(renter, node, volumes=[{"volume": volume.pk, "mount": "/data"}]),
                       JobKind.INSTANCE_PROVISION)
    assert instance.status == InstanceStatus.RUNNING, instance.status_message
    instance_svc.instance_stop(instance=instance)
    run_job(tasks.instance_stop, instance, JobKind.INSTANCE_STOP)
    docker_node.prune(instance.vm_id)
    if found_by == "start":
        instance_svc.instance_start(instance=instance)
        instance = run_job(tasks.instance_start, instance, JobKind.INSTANCE_START)
    else:
        node_reconcile(node)
        instance.refresh_from_db()
    assert instance.status == InstanceStatus.FAILED, instance.status_message
    with pytest.raises(Conflict, match="destroy the instance first"):  # the node's record of its VM mounts it
        volume_svc.volume_delete(volume=Volume.objects.get(pk=volume.pk), confirm=volume.name)
    failed_long_ago(instance)  # the record is removed only a while after the failure (an outage may end)
    node_reconcile(node)
    assert not (docker_node.tmp_path / "state" / "vms" / instance.vm_id).exists()  # before: kept until destroyed

    # Until then a failed instance that ran holds its volumes (r46c: its VM, or the node's record of it, may be
    # there): the delete is refused up front, never taken and then refused by the node, billed again. Once the node
    # removed that record nothing of the VM is left (Instance.vm_gone): the volume is free without a destroy (before,
    # it stayed held until its renter destroyed the failed instance; found by review).
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.FAILED and instance.vm_gone
    volume_svc.volume_delete(volume=Volume.objects.get(pk=volume.pk), confirm=volume.name)
    run_job(tasks.volume_delete, None, JobKind.VOLUME_DELETE, volume=volume)
    assert Volume.objects.get(pk=volume.pk).state == VolumeState.DELETED  # before: refused, available again


def test_the_record_of_a_failed_instances_vm_that_is_there_is_kept(docker_node):
    """Only a VM the node lists as missing loses its record: a failed instance's VM whose container is there
    (stopped) is left as it is by the reconciler."""
    node = node_with_one_gpu()
    instance = rented(node)
    instance_svc.instance_stop(instance=instance)
    run_job(tasks.instance_stop, instance, JobKind.INSTANCE_STOP)
    instance_svc.instance_mark_failed(instance_id=instance.pk, message="failed for another reason")
    node_reconcile(node)
    assert docker_node.containers() == {f"gpumarket-{instance.vm_id}": "exited"}
    assert (docker_node.tmp_path / "state" / "vms" / instance.vm_id / "vm.json").exists()


def failed_long_ago(instance, hours=2):
    """As if the instance had been failed (its row last changed) `hours` ago."""
    Instance.objects.filter(pk=instance.pk).update(updated_at=timezone.now() - timedelta(hours=hours))


def test_a_container_back_after_its_record_was_removed_is_removed_and_the_pass_goes_on(docker_node, settings):
    """The reviewer's scenario (found by review): the container pruned (or dockerd on another data root), the health
    check and the reconciler fail the instance; the node's record of its VM is removed; dockerd comes back on its
    data root and `--restart unless-stopped` brings the container back running, on a GPU given to another renter.
    The reconciler sent `vm stop` of it, the agent answered not_found (no record), and that ended every pass (and
    every health check that reconciles: the node offline for good). Now the unrecorded container is removed, said
    once, and the pass goes on; the record is not removed in the pass that failed the instance, only a while
    after."""
    node = node_with_one_gpu()
    instance = rented(node)
    Instance.objects.filter(pk=instance.pk).update(started_at=timezone.now() - timedelta(minutes=5))
    containers = docker_node.tmp_path / "containers.json"
    saved = containers.read_text()
    docker_node.prune(instance.vm_id)
    health = docker_node.session(node).agent("health", None, {})
    node_record_health(node_id=node.pk, ok=True, vms=health["vms"], probed_at=timezone.now())
    node_reconcile(node)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.FAILED, instance.status_message
    record = docker_node.tmp_path / "state" / "vms" / instance.vm_id / "vm.json"
    assert record.exists()  # before: removed in the pass that failed it
    node_reconcile(node)
    assert record.exists()  # not yet: an engine outage has time to end

    failed_long_ago(instance)
    node_reconcile(node)
    assert not record.exists()
    second = rented(node)
    # dockerd back on its real data root: the container runs again, no record of it on the node
    state = json.loads(containers.read_text())
    state["gpumarket-" + instance.vm_id] = json.loads(saved)["gpumarket-" + instance.vm_id]
    containers.write_text(json.dumps(state))
    assert docker_node.containers()[f"gpumarket-{instance.vm_id}"] == "running"
    counts = node_reconcile(node)  # before: AgentFailed not_found, the pass ended
    assert isinstance(counts, dict)
    assert docker_node.containers() == {f"gpumarket-{second.vm_id}": "running"}
    events = NodeEvent.objects.filter(node=node, kind="unrecorded_vm_removed")
    assert events.count() == 1 and instance.vm_id in events.get().message
    node_reconcile(node)
    assert events.count() == 1


def test_a_refused_stop_of_a_failed_instances_vm_is_reported_once_and_the_pass_goes_on(docker_node, monkeypatch):
    """Any other refusal of the stop of a VM that must not run: one event, the rest of the pass done."""
    node = node_with_one_gpu()
    instance = rented(node)
    instance_svc.instance_mark_failed(instance_id=instance.pk, message="failed for another reason",
                                      cleanup_pending=True)
    real = docker_node.session

    def session(node, *args, **kwargs):
        inner = real(node)

        class Refusing:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def agent(self, cmd, sub=None, request=None, timeout=None):
                if (cmd, sub) == ("vm", "stop"):
                    raise AgentFailed({"code": "command_failed", "message": "docker stop: device busy"})
                return inner.agent(cmd, sub, request, timeout)

        return Refusing()

    monkeypatch.setattr("provisioning.services.reconcile.node_session", session)
    for _ in range(2):
        counts = node_reconcile(node)  # before: AgentFailed ended the pass
        assert isinstance(counts, dict)
    events = NodeEvent.objects.filter(node=node, kind="vm_stop_failed")
    assert events.count() == 1 and instance.vm_id in events.get().message
    assert docker_node.containers() == {f"gpumarket-{instance.vm_id}": "running"}


# ------------------------------------------------------------------- libvirt: a lookup that fails for a while

class LibvirtNode(AgentNode):
    def domains(self) -> dict[str, str]:
        return {name: d["state"] for name, d in json.loads((self.tmp_path / "domains.json").read_text()).items()}

    def glitch(self, on=True):
        """virsh's lookups fail with "error: failed to get domain '<name>'", as while libvirtd restarts."""
        flag = self.tmp_path / "virsh-glitch"
        flag.touch() if on else flag.unlink()


@pytest.fixture
def libvirt_node(tmp_path, monkeypatch):
    fakebin, images = tmp_path / "bin", tmp_path / "images"
    fakebin.mkdir()
    images.mkdir()
    (images / "ubuntu-22.04-cuda-12.4-pytorch-2.5.1.qcow2").write_text("")  # the pytorch-2-5 image's
    python = "#!" + sys.executable
    (fakebin / "virsh").write_text(FAKE_VIRSH.replace("#!PYTHON", python))
    (fakebin / "nvidia-smi").write_text(FAKE_NVIDIA_SMI.replace("#!PYTHON", python))
    (fakebin / "qemu-img").write_text(TOUCH_OVERLAY)
    (fakebin / "genisoimage").write_text(TOUCH_OUTPUT)
    for script in fakebin.iterdir():
        script.chmod(0o755)
    csv = tmp_path / "gpus.csv"
    csv.write_text((SAMPLES / "a100_sxm4_80gb_x4.csv").read_text())
    monkeypatch.setenv("PATH", f"{fakebin}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_VIRSH_STATE", str(tmp_path / "domains.json"))
    monkeypatch.setenv("FAKE_VIRSH_GLITCH", str(tmp_path / "virsh-glitch"))
    monkeypatch.setenv("FAKE_SMI_CSV", str(csv))
    monkeypatch.setenv("FAKE_SMI_TABLE", str(SAMPLES / "h100_sxm_x1_table.txt"))
    monkeypatch.setenv("GPUMARKET_DISK_TEST_MIB", "1")
    fake = LibvirtNode(tmp_path, {"GPUMARKET_RUNTIME": "libvirt", "GPUMARKET_STATE_DIR": str(tmp_path / "state"),
                                  "GPUMARKET_PORT_RANGE": "42000-42999", "GPUMARKET_PUBLIC_HOST": "10.0.0.9",
                                  "GPUMARKET_LIBVIRT_DIR": str(tmp_path / "domains"),
                                  "GPUMARKET_LIBVIRT_IMAGES": str(images)})
    for module in ("vms", "reconcile"):
        monkeypatch.setattr(f"provisioning.services.{module}.node_session", fake.session)
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: None)
    monkeypatch.setattr("provisioning.services.vms.wait_for_ssh", lambda host, port, timeout=0: None)
    return fake


def health_and_reconcile(fake, node):
    """A health check of the node, then the reconciler's pass, as the fleet runs them; the pass's counts, or the
    node's error that ended it (the fleet counts that node unreachable for this pass)."""
    health = fake.session(node).agent("health", None, {})
    node_record_health(node_id=node.pk, ok=True, vms=health["vms"], probed_at=timezone.now())
    try:
        return node_reconcile(node)
    except AgentFailed as exc:
        return exc


def test_a_failed_virsh_lookup_leaves_a_running_instance_and_its_vm_alone(libvirt_node):
    """The reviewer's case: virsh prints "error: failed to get domain '<name>'" for any lookup that fails (libvirtd
    restarting, a keepalive timeout), and the agent took it as the domain gone. One glitch: the health check
    interrupted the renter's running instance as gone, the reconciler failed it and freed its GPU, and once virsh
    answered again the next pass found a failed instance whose VM runs, and stopped it. Now the VM's state is
    unknown while virsh cannot say: nothing is judged, nothing stopped, its GPU held; then it is running as before."""
    node = make_listed_node(gpu_count=1, runtime="libvirt")
    Gpu.objects.filter(node=node, index=0).update(uuid=A)
    instance = rented(node)
    Instance.objects.filter(pk=instance.pk).update(started_at=timezone.now() - timedelta(minutes=5))
    domain = f"gpumarket-{instance.vm_id}"
    assert libvirt_node.domains() == {domain: "running"}

    libvirt_node.glitch()
    for _ in range(2):
        answer = health_and_reconcile(libvirt_node, node)
        assert not isinstance(answer, AgentFailed) and answer["instances_failed"] == 0, answer  # its VM unknown
        instance.refresh_from_db()
        assert instance.status == InstanceStatus.RUNNING, instance.status_message  # before: failed
        assert not instance.interruptions.exists() and gpu0(node) == "rented"
        assert libvirt_node.domains() == {domain: "running"}

    libvirt_node.glitch(on=False)
    for _ in range(2):
        counts = health_and_reconcile(libvirt_node, node)
        assert counts["instances_failed"] == 0 and counts["stopped_vms_stopped"] == 0, counts
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.RUNNING and gpu0(node) == "rented"
    assert libvirt_node.domains() == {domain: "running"}  # before: stopped, as a failed instance's VM
    assert not NodeEvent.objects.filter(node=node, kind__in=("vm_vanished", "vm_not_running")).exists()


def test_one_domain_whose_state_cannot_be_read_leaves_the_other_renters_and_the_node_alone(libvirt_node):
    """One domain whose domstate fails made `vm list` and the health answer fail as a whole (`vms: null`): every
    check failed, after two every running instance on the node was interrupted, after three the node was offline,
    and nobody was told which domain (found by review). Now that VM is "unknown": left unjudged, its renter running,
    the healthy renter beside it running, the node active, and one event names the domain."""
    node = make_listed_node(gpu_count=2, runtime="libvirt")
    Gpu.objects.filter(node=node, index=0).update(uuid=A)
    Gpu.objects.filter(node=node, index=1).update(uuid=B)
    sick, healthy = rented(node), rented(node)
    Instance.objects.filter(pk__in=(sick.pk, healthy.pk)).update(started_at=timezone.now() - timedelta(minutes=5))
    assert set(libvirt_node.domains().values()) == {"running"} and len(libvirt_node.domains()) == 2
    (libvirt_node.tmp_path / "virsh-glitch").write_text(f"only=gpumarket-{sick.vm_id}")
    for _ in range(4):
        health = libvirt_node.session(node).agent("health", None, {})
        assert health["vms"] == {sick.vm_id: "unknown", healthy.vm_id: "running"}, health  # before: None
        ok = health["vms"] is not None
        node_record_health(node_id=node.pk, ok=ok, vms=health["vms"], probed_at=timezone.now())
        counts = node_reconcile(node)  # before: AgentFailed command_failed, the pass ended
        assert counts["instances_failed"] == counts["restarted"] == counts["resumed"] == 0, counts
    for instance in (sick, healthy):
        instance.refresh_from_db()
        assert instance.status == InstanceStatus.RUNNING and not instance.interruptions.exists()
    node.refresh_from_db()
    assert node.state == "active" and node.health_failures == 0
    assert set(libvirt_node.domains().values()) == {"running"}
    events = NodeEvent.objects.filter(node=node, kind="vm_state_unknown")
    assert events.count() == 1 and sick.vm_id in events.get().message, list(events.values_list("message"))
    assert not Gpu.objects.filter(node=node).exclude(status="rented").exists()
