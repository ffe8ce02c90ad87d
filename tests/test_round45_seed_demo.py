"""`make demo` stops the simulated servers when it ends (scripts/demo's trap: `simnodes down`), so the next
`make demo` finds every demo node's server gone and seed_demo retires and registers each again. Before, it retired
them as reachable nodes (no failed health check was recorded while the demo was down): a volume, a stopped instance
or a destroyed one whose VM awaited clean-up, left by the customer in the last demo, made node_retire refuse
(Conflict), seed_demo raised halfway and scripts/demo (set -e) stopped before starting anything. Now the gone
server is recorded unreachable (the fleet's health record) and retired by node_retire's unreachable path, with its
money rules, each node's end and its new registration in one transaction. Found by review (round 45, finding 4)."""
import io
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.utils import timezone

from marketplace.models import (
    GpuAllocation,
    Instance,
    InstanceStatus,
    Node,
    NodeState,
    User,
    Verdict,
    Volume,
    VolumeState,
)
from marketplace.services import instances as svc
from marketplace.services import nodes as node_svc
from provisioning import sim
from provisioning.models import NodeEvent
from tests.marketplace.renting_helpers import book, run, sent_jobs_fixture  # noqa: F401 (no job is sent)

pytestmark = pytest.mark.django_db

PROVIDER = "provider@example.com"


@pytest.fixture
def simnodes(settings, tmp_path):
    settings.SIMNODES_DIR = str(tmp_path)
    yield tmp_path
    sim.nodes_down(tmp_path)


def _seed():
    call_command("seed_demo", stdout=io.StringIO())


def _live():
    return {n.name: n for n in Node.objects.exclude(state=NodeState.RETIRED).filter(provider__email=PROVIDER)}


def _running_ports(base):
    return {n["ssh_port"] for n in sim.nodes_list(base) if n["running"]}


def _leave_what_a_customer_leaves():
    """The last demo: its nodes verified and healthy 10 minutes ago, and the customer's leftovers on them."""
    nodes = _live()
    Node.objects.filter(pk__in=[n.pk for n in nodes.values()]).update(
        state=NodeState.ACTIVE, verdict=Verdict.VERIFIED, listed=True, score=1.0, reliability=0.99,
        last_seen_at=timezone.now() - timedelta(minutes=10))
    customer = User.objects.get(email="customer@example.com")
    running = run(book(customer, nodes["fra-a100-01"]))
    stopped = run(book(customer, nodes["ams-a6000-01"]))
    svc.instance_stop(instance=stopped)
    svc.instance_mark_stopped(instance_id=stopped.pk)
    destroyed = run(book(customer, nodes["waw-a4000-01"]))  # destroyed; its VM still to be removed (GPU held)
    Instance.objects.filter(pk=destroyed.pk).update(status=InstanceStatus.DESTROYED)
    requested = book(customer, nodes["iad-h100-01"])  # caught between two states: no job will finish it
    volume = Volume.objects.create(owner=customer, node=nodes["waw-a4000-01"], size_gb=10,
                                   state=VolumeState.AVAILABLE, price_per_gb_month_micros=100_000,
                                   available_at=timezone.now() - timedelta(hours=2))
    return nodes, {"running": running, "stopped": stopped, "destroyed": destroyed, "requested": requested,
                   "volume": volume}


def test_seed_demo_runs_again_whatever_the_last_demo_left(simnodes):
    _seed()
    old, left = _leave_what_a_customer_leaves()
    assert "cannot be retired yet" in str(_refusal(old["waw-a4000-01"]))  # what stopped the demo before
    sim.nodes_down(simnodes)  # the last demo ended: its trap stopped the simulated servers

    _seed()  # the next `make demo`

    live = _live()
    assert set(live) == set(old) and not {n.pk for n in live.values()} & {n.pk for n in old.values()}
    assert {n.ssh_port for n in live.values()} <= _running_ports(simnodes)
    for node in old.values():
        node.refresh_from_db()
        assert node.state == NodeState.RETIRED and not node.listed
    for instance in left.values():
        instance.refresh_from_db()
    # The retire's money rules, unreachable path: nothing bypassed.
    assert left["running"].status == InstanceStatus.FAILED
    assert node_svc.RETIRED_WHILE_INTERRUPTED in left["running"].status_message  # interrupted, then credited
    assert left["running"].interruptions.get().ended_at is not None
    assert left["stopped"].status == InstanceStatus.FAILED
    assert node_svc.RETIRED_WHILE_STOPPED in left["stopped"].status_message
    assert not GpuAllocation.objects.filter(instance=left["destroyed"], released_at__isnull=True).exists()
    assert left["requested"].status == InstanceStatus.FAILED and "simulated server" in left["requested"].status_message
    volume = left["volume"]
    assert volume.state == VolumeState.DELETED
    assert volume.cost_micros > 0 and volume.billed_until <= old["waw-a4000-01"].last_seen_at
    for name in ("fra-a100-01", "ams-a6000-01", "waw-a4000-01"):
        assert NodeEvent.objects.filter(node=old[name], kind="retired_unreachable").exists(), name

    # And once more with the servers up: nothing changes.
    _seed()
    assert {n.pk for n in _live().values()} == {n.pk for n in live.values()}


def _refusal(node):
    from core.errors import Conflict

    try:
        with pytest.raises(Conflict) as refused:
            node_svc.node_retire(node=node)
    finally:
        node.refresh_from_db()
    return refused.value


def test_a_node_that_fails_to_register_again_leaves_its_old_node_and_no_server(simnodes, monkeypatch):
    """Each node's end and its new registration are one transaction: a failure leaves the old node, its renters'
    things and their money as they were, stops the server it had started, and the next run finishes the job."""
    _seed()
    old, left = _leave_what_a_customer_leaves()
    sim.nodes_down(simnodes)
    real_register = node_svc.node_register

    def register(**kwargs):
        if kwargs["name"] == "waw-a4000-01":
            raise RuntimeError("the database went away")
        return real_register(**kwargs)

    monkeypatch.setattr("operations.management.commands.seed_demo.node_register", register)
    with pytest.raises(RuntimeError, match="the database went away"):
        _seed()
    waw = old["waw-a4000-01"]
    waw.refresh_from_db()
    assert waw.state == NodeState.ACTIVE and waw.health_failures == 0
    for key in ("destroyed", "volume"):
        left[key].refresh_from_db()
    assert left["destroyed"].status == InstanceStatus.DESTROYED and left["volume"].state == VolumeState.AVAILABLE
    assert left["volume"].cost_micros == 0
    assert len(_running_ports(simnodes)) == 2  # fra and ams registered again; waw's new server stopped

    monkeypatch.setattr("operations.management.commands.seed_demo.node_register", real_register)
    _seed()
    assert len(_live()) == 4 and {n.ssh_port for n in _live().values()} <= _running_ports(simnodes)
    waw.refresh_from_db()
    assert waw.state == NodeState.RETIRED
