"""A node's stderr costs the worker a bounded tail, however much the node writes (provisioning/ssh.py _exec)."""
import tracemalloc

import pytest

from marketplace.services.nodes import node_private_key
from provisioning import sim
from provisioning.ssh import STDERR_TAIL_BYTES, Endpoint, NodeSession, Timeouts, _keep_tail
from provisioning.ssh_errors import AgentGarbage
from tests.factories import UserFactory, make_node

STDERR_MIB = 12


@pytest.fixture(scope="module")
def simbase(tmp_path_factory):
    base = tmp_path_factory.mktemp("stderr-simnodes")
    yield base
    sim.nodes_down(base)


def test_keep_tail_keeps_the_last_bytes_only():
    err = bytearray()
    for n in range(100):
        _keep_tail(err, bytes([n % 256]) * 1000)
    assert len(err) == STDERR_TAIL_BYTES
    assert bytes(err[-1000:]) == bytes([99]) * 1000 and bytes(err[:96]) == bytes([95]) * 96


def test_a_node_streaming_stderr_costs_the_worker_only_its_tail(db, simbase):
    info = sim.node_up("rtx-a4000-x2", simbase)
    node = make_node(UserFactory(), gpu_model="rtx-a4000", gpu_count=2, address=info["address"],
                     ssh_port=info["ssh_port"], ssh_user=info["ssh_user"],
                     host_key_fingerprint=info["host_key_fingerprint"])
    sim.node_authorize(info["ssh_port"], node.ssh_public_key, simbase)
    endpoint = Endpoint(node.address, node.ssh_port, node.ssh_user, node_private_key(node=node),
                        node.host_key_fingerprint)
    # 12 MiB on stderr, then its last words, and nothing on stdout: the answer quotes those words, and the worker
    # held a few KiB of stderr (paramiko's own window aside), not the 12 MiB it was sent.
    cmd = f"sh -c 'head -c {STDERR_MIB << 20} /dev/zero | tr \"\\\\0\" x >&2; echo the-last-words >&2'"
    with NodeSession(endpoint, Timeouts(connect=5, command=60, attempts=1)) as session:
        tracemalloc.start()
        try:
            with pytest.raises(AgentGarbage, match="the-last-words"):
                session._exec(cmd, b"", 60)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < (STDERR_MIB << 20) // 3, peak
