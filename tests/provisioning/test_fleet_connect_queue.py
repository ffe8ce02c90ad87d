"""A probe that never got one of the worker's connect slots (SshPool `connecting`) by the batch's deadline never
contacted its node: not a failed check (found by review)."""
import socket
import threading
import time

import pytest

from marketplace.models import Node
from provisioning import sim
from provisioning.services import fleet
from provisioning.services.nodes import node_health_probe
from provisioning.ssh_pool import SshPool
from tests.factories import UserFactory, make_listed_node


@pytest.fixture
def simbase(tmp_path_factory):
    base = tmp_path_factory.mktemp("review-simnodes")
    yield base
    sim.nodes_down(base)


@pytest.fixture
def silent_port():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)
    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1]
    stop.set()
    server.close()
    for conn in held:
        conn.close()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_healthy_node_queued_behind_the_workers_own_connects_is_not_a_failed_check(simbase, silent_port,
                                                                                    monkeypatch):
    info = sim.node_up("rtx-a4000-x2", simbase)
    healthy = make_listed_node(UserFactory(), gpu_model="rtx-a4000", gpu_count=2, address=info["address"],
                               ssh_port=info["ssh_port"], ssh_user=info["ssh_user"],
                               host_key_fingerprint=info["host_key_fingerprint"])
    sim.node_authorize(info["ssh_port"], healthy.ssh_public_key, simbase)
    frozen = make_listed_node(address="127.0.0.1", ssh_port=silent_port)
    pool = SshPool(connecting=1)
    earlier = threading.Thread(target=lambda: node_health_probe(frozen, pool=pool), daemon=True)
    earlier.start()
    deadline = time.monotonic() + 5
    while pool._connecting._value and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool._connecting._value == 0
    monkeypatch.setattr(fleet, "HEALTH_PROBE_DEADLINE_S", 2.0)
    summary = fleet.nodes_health_batch([healthy.pk], pool=pool)
    healthy.refresh_from_db()
    earlier.join(10)
    assert summary["failed"] == 0 and healthy.health_failures == 0, healthy.last_error
    assert summary["busy"] == 1  # nothing learnt either way: judged next time


@pytest.mark.django_db(transaction=True)
def test_a_probe_given_up_after_it_contacted_its_node_is_a_failed_check_one_never_started_or_queued_is_not(
        silent_port, monkeypatch):
    """Three nodes that never answer SSH (a silent port), one connect slot, two probe threads: the probe that got the
    slot contacted its node and is a failed check at the deadline; the one waiting for the slot and the one whose
    thread never started are not (busy: nothing learnt)."""
    nodes = [make_listed_node(address="127.0.0.1", ssh_port=silent_port) for _ in range(3)]
    monkeypatch.setattr(fleet, "HEALTH_PROBE_DEADLINE_S", 2.0)
    summary = fleet.nodes_health_batch([n.pk for n in nodes], pool=SshPool(connecting=1), parallelism=2)
    assert (summary["failed"], summary["busy"]) == (1, 2)
    failures = sorted(Node.objects.filter(pk__in=[n.pk for n in nodes]).values_list("health_failures", flat=True))
    assert failures == [0, 0, 1]


def test_the_pool_says_which_threads_wait_for_a_connect_slot():
    pool = SshPool(connecting=1)
    entered, release = threading.Event(), threading.Event()
    idents = {}

    def borrow(name):
        idents[name] = threading.get_ident()
        with pool._connect_slot():
            entered.set()
            release.wait(10)

    first = threading.Thread(target=borrow, args=("first",))
    first.start()
    assert entered.wait(5)
    second = threading.Thread(target=borrow, args=("second",))
    second.start()
    deadline = time.monotonic() + 5
    while not pool.waiting_to_connect(idents.get("second", -1)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.waiting_to_connect(idents["second"]) and not pool.waiting_to_connect(idents["first"])
    release.set()
    first.join(5)
    second.join(5)
    assert not pool.waiting_to_connect(idents["second"])
