"""Review r54 #2: the docker runtime's gpumarket network. Two networks of that name (two first creates at once:
docker's duplicate-name check is best effort) made inspect answer "ambiguous" and create "already exists" for
good, and ensure_network recursed until RecursionError, ~1900 docker commands per `vm create`. Now the network is
made under the node-wide "network" lock, inspect is read once more after "already exists", and the node is told
what to fix (bad_node_config)."""
import subprocess

import pytest

from provisioning.agent import gpumarket_agent as agent
from provisioning.agent.gpumarket_agent.records import file_lock
from provisioning.agent.gpumarket_agent.runtimes import docker as docker_runtime

AMBIGUOUS = "Error response from daemon: network gpumarket-vms is ambiguous (2 matches found on name)\n"
EXISTS = "Error response from daemon: network with name gpumarket-vms already exists\n"


@pytest.fixture
def rt(tmp_path):
    return docker_runtime.DockerRuntime(agent.Config({"GPUMARKET_RUNTIME": "docker",
                                                      "GPUMARKET_STATE_DIR": str(tmp_path / "state")}))


def fake_docker(monkeypatch, inspect, create):
    """docker's answers: inspect and create are lists of (returncode, stdout, stderr), the last one repeated."""
    calls = []

    def fake_run(argv, timeout=60, check=True, env=None):
        calls.append(argv[:3])
        answers = inspect if argv[:3] == ["docker", "network", "inspect"] else create
        seen = sum(1 for c in calls if c == argv[:3])
        code, out, err = answers[min(seen, len(answers)) - 1]
        return subprocess.CompletedProcess(argv, code, out, err)

    monkeypatch.setattr(docker_runtime, "run", fake_run)
    return calls


def test_two_networks_of_that_name_are_a_bad_node_config_after_one_more_inspect_not_a_recursion(rt, monkeypatch):
    calls = fake_docker(monkeypatch, inspect=[(1, "", AMBIGUOUS)], create=[(1, "", EXISTS)])
    try:
        rt.ensure_network()
    except RecursionError:
        raise AssertionError(f"ensure_network recursed without bound: {len(calls)} docker commands") from None
    except agent.AgentError as exc:
        assert exc.code == "bad_node_config", exc.code
        assert "gpumarket-vms" in exc.message and "ambiguous" in exc.message and "docker network rm" in exc.message
    else:
        raise AssertionError("an ambiguous network was used")
    assert calls == [["docker", "network", "inspect"], ["docker", "network", "create"],
                     ["docker", "network", "inspect"]]


def test_a_network_made_meanwhile_by_another_run_is_used_after_one_more_inspect(rt, monkeypatch):
    calls = fake_docker(monkeypatch, create=[(1, "", EXISTS)], inspect=[
        (1, "", "Error: No such network: gpumarket-vms\n"),
        (0, '{"com.docker.network.bridge.enable_icc":"false"}', "")])
    assert rt.ensure_network() is None
    assert len(calls) == 3


def test_the_network_is_made_under_the_node_wide_network_lock(rt, monkeypatch):
    """Another agent run holding the lock: ensure_network waits for it (here: answers busy) rather than creating
    the network beside it."""
    calls = fake_docker(monkeypatch, inspect=[(1, "", "Error: No such network: gpumarket-vms\n")],
                        create=[(0, "net-id\n", "")])
    monkeypatch.setattr("provisioning.agent.gpumarket_agent.records.time.sleep", lambda s: None)
    ticks = iter(range(0, 10 ** 6, 30))
    monkeypatch.setattr("provisioning.agent.gpumarket_agent.records.time.monotonic", lambda: next(ticks))
    with file_lock(rt.cfg, "network", timeout=1):
        with pytest.raises(agent.AgentError) as raised:
            rt.ensure_network()
    assert raised.value.code == "busy" and calls == []
    assert rt.ensure_network() is None and calls == [["docker", "network", "inspect"], ["docker", "network", "create"]]
