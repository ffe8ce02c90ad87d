"""The node agent resolves a renter's registry name before `vm create` (reference.internal_registry): a name whose
address is inside the node's network (loopback, private, link-local...) is refused like the address itself. Before,
only localhost and IP literals were: `registry.corp.example:5000`, or this node's own host name, pointing at a
private address made the node's dockerd connect into the provider's network, its error text answered to the renter
(the probe of review r53 #3 by a name). A name that does not resolve passes (docker's own pull fails on it)."""
import ipaddress
import socket
import time

import pytest

from provisioning.agent import gpumarket_agent as agent
from provisioning.agent.gpumarket_agent import reference
from tests.provisioning.sshkit import new_keypair
from tests.provisioning.test_agent_docker import node  # noqa: F401 (fixture)

KEY = new_keypair()[1]
HOST = socket.gethostname().lower()  # resolved by this machine's resolver (/etc/hosts), as a node's would


def request(image):
    return {"vm_id": "inst-1", "gpu_indices": [0], "ssh_public_keys": [KEY], "image": {"docker": image},
            "image_env": True}


def addresses(host):
    return {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}


def test_this_nodes_own_host_name_is_refused_like_its_address():
    assert addresses(HOST) and all(ipaddress.ip_address(a).is_loopback or ipaddress.ip_address(a).is_private
                                   for a in addresses(HOST)), "this test needs a host name with an inside address"
    with pytest.raises(agent.AgentError) as exc:
        agent.validate_create(request(HOST + ":5000/probe:1"), "docker", [0])
    assert (exc.value.code, exc.value.field) == ("invalid_request", "image")
    assert f"{HOST} resolves to" in exc.value.message and "inside the node's network" in exc.value.message


@pytest.mark.parametrize("address,kind", [("10.0.0.5", "private"), ("169.254.169.254", "link-local"),
                                          ("::ffff:127.0.0.1", "private"), ("fd00::1", "private")])
def test_a_name_with_any_inside_address_is_refused(address, kind):
    def resolve(host):
        return [ipaddress.ip_address("8.8.8.8"), ipaddress.ip_address(address)]

    why = reference.internal_registry("registry.corp.example:5000", (), resolve)
    shown = ipaddress.ip_address(address)
    assert why == f"registry.corp.example resolves to {shown}, a {kind} address inside the node's network"
    assert reference.internal_registry("registry.corp.example:5000", ("registry.corp.example",), resolve) is None


def test_public_and_unresolvable_names_pass():
    def public(host):
        return [ipaddress.ip_address("140.82.112.33")]

    assert reference.internal_registry("ghcr.io", (), public) is None
    assert reference.resolve_host("registry.invalid") == []  # RFC 2606: never resolves
    assert agent.validate_create(request("registry.invalid:5000/app:1"), "docker", [0])[1]["image"]["docker"] \
        == "registry.invalid:5000/app:1"


def test_a_resolver_that_hangs_is_given_up_on(monkeypatch):
    def hang(*args, **kwargs):
        time.sleep(3)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.5", 0))]

    monkeypatch.setattr(reference, "RESOLVE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(reference.socket, "getaddrinfo", hang)
    assert reference.resolve_host("slow.example") == []


def test_vm_create_refuses_the_name_before_any_pull_or_record(node, tmp_path):  # noqa: F811
    answer = node.create("inst-3", [0], image=HOST + ":5000/probe:1", image_env=True)
    assert not answer["ok"] and answer["error"]["code"] == "invalid_request", answer
    assert answer["error"]["field"] == "image" and "resolves to" in answer["error"]["message"]
    assert not any("pull" in c or c[0] == "create" for c in node.docker_calls()), node.docker_calls()
    assert not (tmp_path / "state" / "vms" / "inst-3").exists() and node.states() == {}
