"""Shared by tests/provisioning/test_round47_quarantine_*.py: a simulated GPU server (a real sshd, the real agent,
VMs that are real sshd processes) whose SSH host key really changes, so that the platform's own health check meets
the new key and quarantines the node (provisioning.services.nodes._session_connect), and an operator then accepts
it (verification.node_accept_host_key). Jobs run in the test's process as a worker's delivery runs them
(tests/marketplace/sim_renting.py); one node per test, as each test changes its key. Import the fixtures by name."""
import subprocess
from pathlib import Path

import pytest

from billing.services.ledger import credit_grant
from marketplace.models import Instance, InstanceStatus, Node, NodeState
from provisioning import sim, tasks
from provisioning.models import Job, JobFault, JobKind, NodeEvent
from provisioning.services.maintenance import nodes_health_check
from provisioning.services.nodes import node_session
from provisioning.services.verification import node_accept_host_key
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import ed25519_key
from tests.marketplace.sim_renting import deliver_until_closed


@pytest.fixture(scope="module", name="simbase")
def simbase_fixture(tmp_path_factory):
    base = tmp_path_factory.mktemp("round47-quarantine")
    yield base
    sim.nodes_down(base)


class SimNode:
    """A listed node backed by its own simulated server."""

    def __init__(self, simbase):
        self.simbase = simbase
        self.info = sim.node_up("rtx-a4000-x2", simbase)
        self.node = make_listed_node(UserFactory(), gpu_model="rtx-a4000", gpu_count=2,
                                     address=self.info["address"], ssh_port=self.info["ssh_port"],
                                     ssh_user=self.info["ssh_user"],
                                     host_key_fingerprint=self.info["host_key_fingerprint"], price="1.000000")
        sim.node_authorize(self.info["ssh_port"], self.node.ssh_public_key, simbase)

    def fresh(self) -> Node:
        return Node.objects.get(pk=self.node.pk)

    def change_host_key(self) -> None:
        """The server is reinstalled: same address and port, a new host key; its VMs and volumes stay (they are
        not under its sshd)."""
        port = self.info["ssh_port"]
        sim.node_cut(port, self.simbase)
        key = Path(self.info["node_dir"]) / "ssh_host_ed25519_key"
        key.unlink()
        (key.parent / "ssh_host_ed25519_key.pub").unlink()
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        sim.node_restore(port, self.simbase)

    def quarantined_by_a_health_check(self) -> Node:
        """Its key changes, and the fleet's health check (as beat runs it) meets the new key."""
        self.change_host_key()
        nodes_health_check()
        node = self.fresh()
        assert node.state == NodeState.QUARANTINED, (node.state, node.last_error)
        return node

    def accepted_and_verified(self) -> Node:
        """An operator accepts the new key; its verification (queued, not run here) passes: active again."""
        node_accept_host_key(node=self.fresh(), operator_email="ops@example.com")
        assert self.fresh().state == NodeState.VERIFYING
        Node.objects.filter(pk=self.node.pk).update(state=NodeState.ACTIVE)
        return self.fresh()

    def agent(self, *command: str, request: dict | None = None) -> dict:
        """An agent command over a connection of the test's own (the node's pinned key as it is now)."""
        with node_session(self.fresh()) as session:
            return session.agent(*command, request or {})

    def critical_events(self) -> int:
        return NodeEvent.objects.filter(node_id=self.node.pk, kind="host_key_changed").count()


@pytest.fixture(name="qnode")
def qnode_fixture(simbase):
    node = SimNode(simbase)
    yield node
    sim.node_down(node.info["ssh_port"], simbase)


def funded_renter(micros: int = 100_000_000):
    renter = UserFactory()
    credit_grant(user=renter, amount_micros=micros, reason="tests")
    return renter


def jobs_held_against(node: Node) -> int:
    return Job.objects.filter(node_id=node.pk, fault=JobFault.NODE).count()


def instance_running_via_api(client, node: Node) -> Instance:
    """Booked through the API, its VM created on the server by the provision job (as a worker runs it)."""
    answer = client.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "pytorch-2-5",
                                                "ssh_public_key": ed25519_key()}, format="json")
    assert answer.status_code == 201, answer.content
    instance = Instance.objects.get(pk=answer.json()["id"])
    deliver_until_closed(tasks.instance_provision, Job.objects.get(instance=instance,
                                                                   kind=JobKind.INSTANCE_PROVISION))
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.RUNNING, instance.status_message
    return instance
