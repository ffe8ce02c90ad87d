"""Persistent SSH connections to nodes (provisioning/ssh_pool.py), over real sshds (simulated nodes): a kept
connection is reused, replaced when the node's sshd restarted, and a new one still has the host key pinned (a
changed key quarantines the node); the agent's SFTP check is skipped once its hash is known on the node, and done
again when the node says the agent is gone."""
import os
import subprocess
from pathlib import Path

import paramiko
import pytest
from celery.signals import worker_process_shutdown

from marketplace.models import Node, NodeState
from provisioning import sim, tasks  # noqa: F401 (tasks: registers the worker-shutdown hook)
from provisioning.models import NodeEvent
from provisioning.services import fleet
from provisioning.services.nodes import node_health_probe
from provisioning.ssh import agent_bundle
from provisioning.ssh_pool import SshPool, worker_pool, worker_pool_close
from tests.factories import UserFactory, make_listed_node

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def simbase(tmp_path_factory):
    base = tmp_path_factory.mktemp("pool-simnodes")
    yield base
    sim.nodes_down(base)


@pytest.fixture
def sim_node(simbase):
    """A listed node backed by a real sshd: (node, info)."""
    info = sim.node_up("rtx-a4000-x2", simbase)
    node = make_listed_node(UserFactory(), gpu_model="rtx-a4000", gpu_count=2, address=info["address"],
                            ssh_port=info["ssh_port"], ssh_user=info["ssh_user"],
                            host_key_fingerprint=info["host_key_fingerprint"])
    sim.node_authorize(info["ssh_port"], node.ssh_public_key, simbase)
    return node, info


@pytest.fixture
def pool():
    kept = SshPool()
    yield kept
    kept.close_all()


@pytest.fixture
def sftp_stats(monkeypatch):
    """Counts the SFTP `stat` calls of the agent's file (the agent check), which still run for real."""
    calls = []
    real = paramiko.SFTPClient.stat

    def stat(self, path):
        if path == agent_bundle()[1]:  # not the upload's own stat of its temporary file
            calls.append(path)
        return real(self, path)

    monkeypatch.setattr(paramiko.SFTPClient, "stat", stat)
    return calls


def restart_sshd(info, simbase):
    """Stop the node's sshd and every session under it, then start it again (same port, same host key)."""
    assert sim.node_cut(info["ssh_port"], simbase)
    assert sim.node_restore(info["ssh_port"], simbase)


def test_a_kept_connection_is_reused_and_replaced_after_the_sshd_restarts(sim_node, simbase, pool):
    node, info = sim_node
    assert node_health_probe(node, pool=pool).ok
    assert node_health_probe(node, pool=pool).ok
    assert (pool.connects, pool.reuses, len(pool)) == (1, 1, 1)
    restart_sshd(info, simbase)
    result = node_health_probe(node, pool=pool)
    assert result.ok, result.error
    assert pool.connects == 2 and len(pool) == 1
    assert node_health_probe(node, pool=pool).ok and pool.connects == 2


def test_a_kept_connection_that_looks_alive_but_broke_is_retried_on_a_new_one(sim_node, simbase, pool):
    node, info = sim_node
    assert node_health_probe(node, pool=pool).ok
    kept = pool._idle[node.pk]
    restart_sshd(info, simbase)
    # As if the transport had not noticed yet: the pool lends it, the command fails, a new connection answers.
    kept.session._client.get_transport().is_active = lambda: True
    result = node_health_probe(node, pool=pool)
    assert result.ok, result.error
    assert pool.connects == 2


def test_a_new_connection_still_pins_the_host_key(sim_node, simbase, pool):
    node, info = sim_node
    assert node_health_probe(node, pool=pool).ok
    # The server is reinstalled: same address and port, a new host key.
    sim.node_cut(info["ssh_port"], simbase)
    key = Path(info["node_dir"]) / "ssh_host_ed25519_key"
    key.unlink()
    (key.parent / "ssh_host_ed25519_key.pub").unlink()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    sim.node_restore(info["ssh_port"], simbase)
    result = node_health_probe(node, pool=pool)
    assert not result.ok and "host key changed" in result.error
    node.refresh_from_db()
    assert node.state == NodeState.QUARANTINED and node.seen_host_key_fingerprint != info["host_key_fingerprint"]
    assert NodeEvent.objects.filter(node=node, kind="host_key_changed").exists()
    assert len(pool) == 0  # nothing kept to the changed server


def test_the_agent_check_is_skipped_once_its_hash_is_known_on_the_node(sim_node, simbase, pool, sftp_stats):
    node, info = sim_node
    assert node_health_probe(node, pool=pool).ok
    assert len(sftp_stats) == 1  # the first contact checks (and here uploads) the agent
    assert node_health_probe(node, pool=pool).ok
    assert len(sftp_stats) == 1  # the kept connection: no SFTP at all
    pool.discard(node.pk)
    assert node_health_probe(node, pool=pool).ok
    assert pool.connects == 2 and len(sftp_stats) == 1  # a new connection to a node whose agent is known
    other_worker = SshPool()
    try:
        assert node_health_probe(node, pool=other_worker).ok
        assert len(sftp_stats) == 2  # another worker process knows nothing yet: it checks once
    finally:
        other_worker.close_all()

    # The agent vanished from the node (cleaned up by hand): the probe checks again, uploads it, and answers.
    remote = Path(info["node_dir"]) / "home" / agent_bundle()[1]
    assert remote.is_file(), list((Path(info["node_dir"]) / "home").rglob("*"))
    remote.unlink()
    result = node_health_probe(node, pool=pool)
    assert result.ok, result.error
    assert len(sftp_stats) == 3 and remote.is_file()


def test_a_changed_node_is_not_served_by_its_old_connection(sim_node, pool):
    node, _ = sim_node
    assert node_health_probe(node, pool=pool).ok
    Node.objects.filter(pk=node.pk).update(ssh_port=node.ssh_port)  # unchanged: reused
    assert node_health_probe(Node.objects.get(pk=node.pk), pool=pool).ok and pool.connects == 1
    node.ssh_user = "someone-else"  # e.g. the provider moved the node to another login
    assert not node_health_probe(node, pool=pool).ok  # a new connection, refused: not the kept one
    assert pool.connects == 1 and len(pool) == 0


def test_idle_connections_are_evicted_and_the_pool_is_bounded(simbase, pool):
    nodes = []
    for _ in range(3):
        info = sim.node_up("rtx-a4000-x2", simbase)
        node = make_listed_node(address=info["address"], ssh_port=info["ssh_port"], ssh_user=info["ssh_user"],
                                host_key_fingerprint=info["host_key_fingerprint"], gpu_model="rtx-a4000",
                                gpu_count=2)
        sim.node_authorize(info["ssh_port"], node.ssh_public_key, simbase)
        nodes.append(node)
    pool.max_size = 2
    for node in nodes:
        assert node_health_probe(node, pool=pool).ok
    assert len(pool) == 2 and nodes[0].pk not in pool._idle  # the least recently used one was closed
    pool.idle_s = 0
    assert pool.evict_idle() == 2 and len(pool) == 0


def test_the_worker_pool_serves_the_fleet_check_and_closes_on_worker_shutdown(sim_node, sftp_stats):
    node, _ = sim_node
    worker_pool_close()
    try:
        for _ in range(3):
            summary = fleet.nodes_health_check()
            assert summary["checked"] == 1 and summary["failed"] == 0, summary
        kept = worker_pool()
        assert kept.connects == 1 and kept.reuses == 2 and len(sftp_stats) == 1
        transport = kept._idle[node.pk].session._client.get_transport()
        assert transport.is_active()
        worker_process_shutdown.send(sender=None, pid=os.getpid(), exitcode=0)  # provisioning.tasks listens
        assert not transport.is_active()
    finally:
        worker_pool_close()


@pytest.fixture
def channels(monkeypatch):
    """Counts the SSH channels the platform opens (each exec or SFTP is one); they still open for real."""
    opened = []
    real = paramiko.Transport.open_session

    def open_session(self, *args, **kwargs):
        opened.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(paramiko.Transport, "open_session", open_session)
    return opened


def serve_pids(info) -> list[int]:
    """The node's long-lived agents (`python3 <agent> serve` under the node's folder)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")[:-1]
        except OSError:
            continue
        if argv[-1:] == [b"serve"] and any(a.startswith(info["node_dir"].encode()) for a in argv):
            found.append(int(entry.name))
    return found


def test_a_kept_connection_probes_through_one_long_lived_agent(sim_node, simbase, pool, channels):
    node, info = sim_node
    assert node_health_probe(node, pool=pool).ok  # connects, checks the agent (SFTP), starts `serve`
    first = len(channels)
    assert first == 2 and len(serve_pids(info)) == 1
    for _ in range(3):
        summary = fleet.nodes_health_batch([node.pk], pool=pool)
        assert summary["checked"] == 1 and summary["failed"] == 0, summary
    # Three batches: no new channel, no new process on the node: one line written, one read, each time.
    assert len(channels) == first and pool.connects == 1 and len(serve_pids(info)) == 1
    node.refresh_from_db()
    assert node.health_failures == 0 and node.last_seen_at is not None

    # The long-lived agent is stopped on the node (killed, or it crashed): the next probe starts another one on
    # the same connection and answers.
    for pid in serve_pids(info):
        os.kill(pid, 9)
    summary = fleet.nodes_health_batch([node.pk], pool=pool)
    assert summary["checked"] == 1 and summary["failed"] == 0, summary
    assert pool.connects == 1 and len(channels) == first + 1 and len(serve_pids(info)) == 1


def test_a_batch_over_a_kept_connection_notices_a_cut_node(sim_node, simbase, pool):
    node, info = sim_node
    assert fleet.nodes_health_batch([node.pk], pool=pool)["failed"] == 0
    sim.node_cut(info["ssh_port"], simbase)
    summary = fleet.nodes_health_batch([node.pk], pool=pool)
    assert summary["failed"] == 1, summary
    node.refresh_from_db()
    assert node.health_failures == 1 and len(pool) == 0
    sim.node_restore(info["ssh_port"], simbase)
    assert fleet.nodes_health_batch([node.pk], pool=pool)["failed"] == 0
