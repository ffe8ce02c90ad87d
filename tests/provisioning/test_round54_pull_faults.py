"""Review r54 #1: a failed pull of a renter's own image was always the renter's failure. The agent answered every
failed `docker pull` with pull_failed, and the platform marked each one JobFault.RENTER: a node whose
/var/lib/docker was full, whose docker daemon was gone or whose DNS was down failed every booking of an own image,
told the renter "The image could not be pulled: ... no space left on device", and never lost reliability. Now the
agent tells the registry's refusal (pull_failed) from the node's failure (pull_node_failed, dockerpull.pull_fault),
the sim runtime answers the same way, and only a refusal of the renter's own reference is theirs."""
import subprocess

import pytest

from marketplace.models import Instance
from provisioning import tasks
from provisioning.agent import gpumarket_agent as agent
from provisioning.agent.gpumarket_agent.runtimes import dockerpull
from provisioning.agent.gpumarket_agent.runtimes.simpull import sim_pull
from provisioning.models import JobFault
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

ENOSPC = ("failed to register layer: write /var/lib/docker/overlay2/abc/diff/usr/lib/x.so: no space left on device")
DAEMON_GONE = "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?"
HUB_DNS = ('Error response from daemon: Get "https://registry-1.docker.io/v2/": dial tcp: lookup '
           "registry-1.docker.io on 127.0.0.53:53: server misbehaving")
OWN_DNS = ('Error response from daemon: Get "https://registry.example.com/v2/": dial tcp: lookup '
           "registry.example.com: no such host")
HUB_LIMIT = "Error response from daemon: toomanyrequests: You have reached your unauthenticated pull rate limit."
AUTH = {"username": "renter", "password": "s3cret-pw"}


@pytest.mark.parametrize(
    ("stderr", "reference", "auth", "code"),
    [
        # A full disk: pull_failed (a renter's image can fill it; the platform counts it for a catalogue image).
        (ENOSPC, "registry.example.com/team/x:1", None, "pull_failed"),
        (ENOSPC, "team/x:1", AUTH, "pull_failed"),
        (DAEMON_GONE, "registry.example.com/team/x:1", None, "pull_node_failed"),
        ("unexpected EOF\n", "team/x:1", None, "pull_node_failed"),  # the CLI lost dockerd, or Docker Hub cut it
        (HUB_DNS, "team/x:1", None, "pull_node_failed"),
        ('Error response from daemon: Get "https://ghcr.io/v2/": net/http: TLS handshake timeout',
         "ghcr.io/team/x:1", None, "pull_node_failed"),
        ("Error response from daemon: received unexpected HTTP status: 503 Service Unavailable", "team/x:1", None,
         "pull_node_failed"),
        (HUB_LIMIT, "team/x:1", None, "pull_node_failed"),  # Docker Hub's per-IP limit: the node's address
        (HUB_LIMIT, "team/x:1", AUTH, "pull_failed"),  # the renter's own account's limit
        ("Error response from daemon: toomanyrequests: slow down", "registry.example.com/x:1", None, "pull_failed"),
        ("Error response from daemon: manifest for team/x:missing not found: manifest unknown: manifest unknown",
         "team/x:missing", None, "pull_failed"),
        ("Error response from daemon: pull access denied for team/x, repository does not exist or may require "
         "'docker login': denied: requested access to the resource is denied", "team/x:1", None, "pull_failed"),
        ("Error response from daemon: Head \"https://registry.example.com/v2/x/manifests/1\": unauthorized: "
         "authentication required", "registry.example.com/x:1", AUTH, "pull_failed"),
        ("Error response from daemon: received unexpected HTTP status: 403 Forbidden", "team/x:1", None,
         "pull_failed"),
        ("invalid reference format", "team/x:1", None, "pull_failed"),
        # The renter's own registry that cannot be reached: ambiguous (their registry down or misnamed, or the
        # node's network), judged theirs: a renter naming an unreachable host must not cost a node at will.
        (OWN_DNS, "registry.example.com/x:1", None, "pull_failed"),
        ("Error response from daemon: Get \"https://registry.example.com/v2/\": x509: certificate signed by "
         "unknown authority", "registry.example.com/x:1", None, "pull_failed"),
    ],
    ids=["enospc-own", "enospc-hub-login", "daemon-gone", "cli-eof", "hub-dns", "ghcr-tls-timeout", "hub-503",
         "hub-anonymous-rate-limit", "hub-account-rate-limit", "own-registry-rate-limit", "manifest-unknown",
         "denied", "unauthorized", "http-403", "invalid-reference", "own-registry-dns", "own-registry-x509"],
)
def test_docker_pulls_failure_is_the_registrys_refusal_or_the_nodes(tmp_path, monkeypatch, stderr, reference, auth,
                                                                     code):
    cfg = agent.Config({"GPUMARKET_RUNTIME": "docker", "GPUMARKET_STATE_DIR": str(tmp_path)})
    monkeypatch.setattr(dockerpull, "run", lambda argv, timeout=60, check=True, env=None:
                        subprocess.CompletedProcess(argv, 1, "", stderr))
    rec = {"vm_id": "inst-1", "spec": {"image": {"docker": reference}, "image_env": True}}
    with pytest.raises(agent.AgentError) as raised:
        dockerpull.docker_pull(cfg, rec, auth)
    assert raised.value.code == code, raised.value.message
    assert "s3cret-pw" not in raised.value.message


@pytest.mark.parametrize(
    ("reference", "code", "words"),
    [
        ("registry.example.com/team/x:nospace", "pull_failed", "no space left on device"),
        ("team/x:nodenet", "pull_node_failed", "server misbehaving"),
        ("registry.example.com/team/x:nodenet", "pull_failed", "server misbehaving"),  # the renter's own registry
        ("team/x:missing", "pull_failed", "manifest unknown"),
    ],
    ids=["nospace", "hub-dns", "own-registry-dns", "missing"],
)
def test_the_sim_runtime_fails_a_pull_as_docker_would(tmp_path, reference, code, words):
    cfg = agent.Config({"GPUMARKET_RUNTIME": "docker", "GPUMARKET_STATE_DIR": str(tmp_path)})
    with pytest.raises(agent.AgentError) as raised:
        sim_pull(cfg, {"vm_id": "inst-1", "spec": {"image": {"docker": reference}}}, None)
    assert (raised.value.code, words in raised.value.message) == (code, True), raised.value.message
    assert dockerpull.pull_fault(raised.value.message, reference, None) == code


def agent_answer(tmp_path, monkeypatch, reference, stderr):
    """What the agent answers to `vm create` whose docker pull printed `stderr`, as the platform receives it."""
    cfg = agent.Config({"GPUMARKET_RUNTIME": "docker", "GPUMARKET_STATE_DIR": str(tmp_path)})
    monkeypatch.setattr(dockerpull, "run", lambda argv, timeout=60, check=True, env=None:
                        subprocess.CompletedProcess(argv, 1, "", stderr))
    try:
        dockerpull.docker_pull(cfg, {"vm_id": "inst-1", "spec": {"image": {"docker": reference}, "image_env": True}},
                               None)
    except agent.AgentError as exc:
        return {"code": exc.code, "message": exc.message}
    raise AssertionError("the pull did not fail")


@pytest.mark.django_db
@pytest.mark.parametrize("stderr", [DAEMON_GONE], ids=["daemon-gone"])
def test_the_nodes_failure_to_pull_an_own_image_counts_against_the_node_and_blames_no_image(
        fake_node, tmp_path, monkeypatch, stderr):  # noqa: F811
    node = checked_node()
    reference = "registry.example.com/team/x:1"
    answer = agent_answer(tmp_path, monkeypatch, reference, stderr)

    def pull_fails():
        raise AgentFailed(answer)

    instance, job = provision(node, image=reference)
    fake_node.hooks[("vm", "create")] = pull_fails
    run_in_worker(tasks.instance_provision, job)
    job = failed(job)
    assert job.fault == JobFault.NODE, (job.fault, job.error)
    assert reliability(node) < 1.0
    message = Instance.objects.get(pk=instance.pk).status_message
    assert "could not be pulled" not in message and "not a fault of the image" in message, message
    assert "does not count against the node" not in job.error


@pytest.mark.django_db
def test_the_registrys_refusal_of_an_own_image_stays_the_renters(fake_node, tmp_path, monkeypatch):  # noqa: F811
    node = checked_node()
    reference = "registry.example.com/team/x:missing"
    answer = agent_answer(tmp_path, monkeypatch, reference,
                          f"Error response from daemon: manifest for {reference} not found: manifest unknown")

    def refused():
        raise AgentFailed(answer)

    instance, job = provision(node, image=reference)
    fake_node.hooks[("vm", "create")] = refused
    run_in_worker(tasks.instance_provision, job)
    job = failed(job)
    assert job.fault == JobFault.RENTER and "could not be pulled" in job.error
    assert reliability(node) == 1.0
