"""Review r54 own MEDIUM-1 (on 72bf76c): a renter could lower a node's reliability through a pull, with no control
over docker's words: a decompression-bomb image on Docker Hub fills /var/lib/docker ("no space left on device"), a
layer that is not a tar gives "failed to register layer: Error processing tar file ... invalid tar header", and the
renter's own registry cutting the blob stream gives a bare "unexpected EOF"; each was pull_node_failed. Now the
image's content and a cut stream from the renter's own registry are the renter's (pull_failed), and a full disk is
pull_failed too: the platform counts it against the node for a catalogue image only, and for a renter's own image
records a `pull_no_space` node event instead."""
import subprocess

import pytest

from marketplace.models import Instance
from provisioning import tasks
from provisioning.agent import gpumarket_agent as agent
from provisioning.agent.gpumarket_agent.runtimes import dockerpull
from provisioning.agent.gpumarket_agent.runtimes.dockerpull import PULL_NODE_FAILED, PULL_REFUSED, pull_fault
from provisioning.models import JobFault, NodeEvent
from provisioning.ssh_errors import AgentFailed
from tests.provisioning.test_job_fault import (  # noqa: F401 - fixtures
    checked_node,
    failed,
    fake_node,
    provision,
    reliability,
    run_in_worker,
    sent_jobs,
)

BOMB = "failed to register layer: write /var/lib/docker/overlay2/x/diff/zero: no space left on device"


@pytest.mark.parametrize("text,ref", [
    (BOMB, "renter/bomb:latest"),
    ("failed to register layer: Error processing tar file(exit status 1): archive/tar: invalid tar header",
     "renter/garbage:latest"),
    ("unexpected EOF", "registry.renter.example/img:1"),
], ids=["enospc-hub", "bad-tar-hub", "eof-own-registry"])
def test_renter_caused_failures_are_not_node_faults(text, ref):
    assert pull_fault(text, ref, None) == PULL_REFUSED


@pytest.mark.parametrize("text,ref", [
    ("failed to register layer: open /var/lib/docker/overlay2/x/diff/a: input/output error", "renter/img:1"),
    ("unexpected EOF", "renter/img:1"),  # from Docker Hub: the CLI lost dockerd, or the node's network
    ("Cannot connect to the Docker daemon at unix:///var/run/docker.sock.", "registry.renter.example/img:1"),
], ids=["eio-in-layer", "eof-hub", "daemon-gone-own"])
def test_the_nodes_own_failures_stay_the_nodes(text, ref):
    assert pull_fault(text, ref, None) == PULL_NODE_FAILED


def _agent_answer(tmp_path, monkeypatch, reference, stderr):
    cfg = agent.Config({"GPUMARKET_RUNTIME": "docker", "GPUMARKET_STATE_DIR": str(tmp_path)})
    monkeypatch.setattr(dockerpull, "run", lambda argv, timeout=60, check=True, env=None:
                        subprocess.CompletedProcess(argv, 1, "", stderr))
    with pytest.raises(agent.AgentError) as raised:
        dockerpull.docker_pull(cfg, {"vm_id": "inst-1", "spec": {"image": {"docker": reference},
                                                                  "image_env": True}}, None)
    return {"code": raised.value.code, "message": raised.value.message}


@pytest.mark.django_db
def test_a_full_disk_during_an_own_images_pull_is_a_node_event_not_a_node_fault(
        fake_node, tmp_path, monkeypatch):  # noqa: F811
    node = checked_node()
    answer = _agent_answer(tmp_path, monkeypatch, "renter/bomb:latest", BOMB)

    def pull_fails():
        raise AgentFailed(answer)

    instance, job = provision(node, image="renter/bomb:latest")
    fake_node.hooks[("vm", "create")] = pull_fails
    run_in_worker(tasks.instance_provision, job)
    job = failed(job)
    assert job.fault == JobFault.RENTER, (job.fault, job.error)
    assert reliability(node) == 1.0
    message = Instance.objects.get(pk=instance.pk).status_message
    assert "disk filled while it was unpacked" in message, message
    event = NodeEvent.objects.get(node=node, kind="pull_no_space")
    assert event.level == NodeEvent.Level.WARNING and f"instance {instance.pk}" in event.message


@pytest.mark.django_db
def test_a_full_disk_during_a_catalogue_images_pull_is_the_nodes(fake_node, tmp_path, monkeypatch):  # noqa: F811
    node = checked_node()
    answer = _agent_answer(tmp_path, monkeypatch, "ubuntu:24.04", BOMB)

    def pull_fails():
        raise AgentFailed(answer)

    _, job = provision(node)  # a catalogue image
    fake_node.hooks[("vm", "create")] = pull_fails
    run_in_worker(tasks.instance_provision, job)
    assert failed(job).fault == JobFault.NODE
    assert reliability(node) < 1.0
    assert not NodeEvent.objects.filter(node=node, kind="pull_no_space").exists()
