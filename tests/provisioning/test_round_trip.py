"""The round trip the platform takes off timed answers (verification/round_trip.py, ssh_round_trip.py): a node
that holds its agent's pongs back buys no time for a slow challenge or a late memory proof, on pipes (the cap)
and over real SSH (sshd's keepalive reply and the kernel's TCP estimate, which the agent does not answer)."""
import dataclasses
import threading
import time

import pytest

from provisioning import sim, ssh_round_trip
from provisioning.services.nodes import node_private_key
from provisioning.ssh import Endpoint, NodeSession
from provisioning.verification import challenge, challenge_verdict, memproof_verdict, round_trip
from provisioning.verification.profiles import PROFILES_DIR
from provisioning.verification.tolerances import TOLERANCES
from tests.factories import UserFactory, make_node
from tests.provisioning.test_challenge import A100
from tests.provisioning.test_challenge import exchange_with_agent as challenge_with_agent
from tests.provisioning.test_memproof import exchange_with_agent as memproof_with_agent

CAP = TOLERANCES["round_trip_credit_max_s"]
SLOW_CHALLENGE = "a6000-posing-as-a100-x2-delays-pongs"
SLOW_PROOF = "a100-40gb-sxm-says-80gb-rebuilds-delays-pongs-x1"
STAMP_SLACK_S = 0.1  # how much earlier than the platform's stamp an agent may start holding a pong back


class Below:
    """An exchange whose transport measured these round trips."""

    def __init__(self, **trips):
        self.trips = trips  # name -> samples

    def transport_round_trips(self):
        return self.trips


def test_the_credit_is_the_least_round_trip_measured_and_never_more_than_the_cap():
    assert round_trip.credit([0.9, 0.7, 0.8], Below(sshd=[0.05, 0.06], tcp=[0.04]))[:2] == (0.04, {
        "agent_pings": 0.7, "sshd": 0.05, "tcp": 0.04})
    assert round_trip.credit([0.02, 0.03], Below(sshd=[0.2]))[:2] == (0.02, {"agent_pings": 0.02, "sshd": 0.2})
    assert round_trip.credit([0.02], object())[:2] == (0.02, {"agent_pings": 0.02})  # a pipe: pings only
    # slowed everywhere: no more than the cap
    assert round_trip.credit([2.5, 2.6], Below(sshd=[2.5], tcp=[2.4]))[0] == CAP
    assert round_trip.credit([5.0], Below())[0] == CAP


def test_the_spread_is_the_steadiest_repeated_measurements():
    """The memory proof's jitter allowance: pongs answered unevenly widen it only if sshd's replies are uneven
    too; a single TCP estimate has no spread."""
    assert round_trip.credit([0.001, 5.0, 0.001], Below(sshd=[0.001, 0.003, 0.002], tcp=[0.004]))[2] == \
        pytest.approx(0.002)
    assert round_trip.credit([0.001, 0.2, 0.001], object())[2] == pytest.approx(0.199)  # a pipe: the pings'
    assert round_trip.credit([0.001, 0.004], Below(sshd=[0.1, 0.5]))[2] == pytest.approx(0.003)
    assert round_trip.credit([0.001], Below(tcp=[0.004]))[2] == 0.0


def test_holding_the_challenges_pongs_back_does_not_make_a_slow_card_look_fast():
    drawn, out, final, _ = challenge_with_agent(SLOW_CHALLENGE, A100, [0, 1])
    assert final["ok"] is True
    # >= the hold less a little: the platform stamps a ping after writing it, and under load the agent may have
    # read it and begun its hold first (2.4983 s was seen in CI)
    assert out.round_trips["agent_pings"] >= 2.5 - STAMP_SLACK_S and out.round_trip_s == CAP  # pipes: the cap
    findings, figures = challenge_verdict.judge(A100, drawn, out)
    assert sorted((f.code, f.gpu_index) for f in findings) == [("challenge_too_slow", 0), ("challenge_too_slow", 1)]
    assert figures["round_trips"]["agent_pings"] >= 2.5 - STAMP_SLACK_S
    # what the pongs alone would have bought: an A6000 passing as an A100
    pongs_only = dataclasses.replace(out, round_trip_s=out.round_trips["agent_pings"])
    bought, _ = challenge_verdict.judge(A100, drawn, pongs_only)
    assert bought == []


def test_holding_the_memory_proofs_pongs_back_does_not_hide_a_rebuild():
    drawn, out, final, _ = memproof_with_agent(PROFILES_DIR / f"{SLOW_PROOF}.json", A100, [0])
    assert final["ok"] is True
    assert out.round_trips["agent_pings"] >= 1.8 - STAMP_SLACK_S and out.round_trip_s == CAP
    findings, _ = memproof_verdict.judge(A100, drawn, out)
    assert [(f.code, f.gpu_index) for f in findings] == [("memory_proof_late", 0)]
    pongs_only = dataclasses.replace(out, round_trip_s=out.round_trips["agent_pings"])
    bought, _ = memproof_verdict.judge(A100, drawn, pongs_only)
    assert bought == []


@pytest.mark.slow
def test_over_ssh_sshd_and_tcp_time_the_trip_the_agent_holds_back(db, tmp_path):
    server = sim.node_up(SLOW_CHALLENGE, tmp_path)
    try:
        node = make_node(UserFactory(), gpu_model="a100-80gb-sxm", gpu_count=2, address=server["address"],
                         ssh_port=server["ssh_port"], ssh_user=server["ssh_user"],
                         host_key_fingerprint=server["host_key_fingerprint"])
        sim.node_authorize(server["ssh_port"], node.ssh_public_key, tmp_path)
        endpoint = Endpoint(node.address, node.ssh_port, node.ssh_user, node_private_key(node=node),
                            node.host_key_fingerprint)
        drawn = challenge.draw(A100, [0, 1], quick=True)
        with NodeSession(endpoint) as session:
            exchange = session.exchange("challenge")
            try:
                out = challenge.run(exchange, drawn, 300)
            finally:
                exchange.close()
    finally:
        sim.nodes_down(tmp_path)
    trips = out.round_trips
    assert set(trips) == {"agent_pings", "sshd", "tcp"}, trips
    assert trips["agent_pings"] >= 2.5 - STAMP_SLACK_S and max(trips["sshd"], trips["tcp"]) < 1.0, trips
    assert out.round_trip_s == min(trips.values())
    findings, figures = challenge_verdict.judge(A100, drawn, out)
    assert sorted((f.code, f.gpu_index) for f in findings) == [("challenge_too_slow", 0), ("challenge_too_slow", 1)]
    assert figures["round_trips"]["sshd"] < 1.0


def test_exchanges_measuring_one_pooled_connection_take_turns(db, tmp_path, monkeypatch):
    """paramiko answers global requests through one completion_event per transport: two measurements of a pooled
    connection at once would wake on each other's replies. They take turns, and each gets its three replies."""
    server = sim.node_up(SLOW_CHALLENGE, tmp_path)
    try:
        node = make_node(UserFactory(), gpu_model="a100-80gb-sxm", gpu_count=2, address=server["address"],
                         ssh_port=server["ssh_port"], ssh_user=server["ssh_user"],
                         host_key_fingerprint=server["host_key_fingerprint"])
        sim.node_authorize(server["ssh_port"], node.ssh_public_key, tmp_path)
        endpoint = Endpoint(node.address, node.ssh_port, node.ssh_user, node_private_key(node=node),
                            node.host_key_fingerprint)
        with NodeSession(endpoint) as session:
            exchange = session.exchange("challenge")
            try:
                transport = exchange.chan.get_transport()
                real, state = transport.global_request, {"now": 0, "most": 0}
                guard = threading.Lock()

                def counted(*args, **kwargs):
                    with guard:
                        state["now"] += 1
                        state["most"] = max(state["most"], state["now"])
                    time.sleep(0.02)  # widens the window two unserialised measurements would share
                    try:
                        return real(*args, **kwargs)
                    finally:
                        with guard:
                            state["now"] -= 1

                monkeypatch.setattr(transport, "global_request", counted)
                results = []
                threads = [threading.Thread(target=lambda: results.append(exchange.transport_round_trips()))
                           for _ in range(4)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join(30)
            finally:
                exchange.close()
    finally:
        sim.nodes_down(tmp_path)
    assert state["most"] == 1, state
    assert len(results) == 4 and all(len(r["sshd"]) == ssh_round_trip.KEEPALIVES for r in results), results
