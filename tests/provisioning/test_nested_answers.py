"""A node's answer nested past Python's recursion limit (10 kB of "[") is the node's garbage, never a crash of the
check: json raises RecursionError, not ValueError, and each parse site caught only ValueError (found by review).
An internal error is not the node's fault, so an active node kept its listing; a health probe re-raised it and
ended its whole batch. All of them read through core.untrusted_json now."""
import json
import random
import time

import pytest

from provisioning.ssh import NodeSession
from provisioning.ssh_errors import NodeError
from provisioning.verification import challenge, memproof
from provisioning.verification.model import DeclaredModel, load_catalogue

DEEP = b"[" * 5000 + b"]" * 5000  # 10 kB of valid-looking JSON nesting, far under the 8 MiB a line


class Scripted:
    """An exchange whose node answers pings at once, then says `after` (one line per receive)."""

    def __init__(self, after):
        self.pending, self.after = [], list(after)

    def send(self, message):
        if "ping" in message:
            self.pending.append(json.dumps({"pong": message["ping"]}).encode())
        else:
            self.pending.extend(self.after)
            self.after = []
        return time.monotonic()

    def receive(self, timeout):
        if self.pending:
            return self.pending.pop(0), time.monotonic()
        return None, time.monotonic()


def _declared():
    return DeclaredModel.from_catalogue(load_catalogue()["h100-sxm"])


def test_challenge_deeply_nested_commitment_is_a_finding_not_a_crash():
    drawn = challenge.draw(_declared(), [0], quick=True, rng=random.Random(1))
    out = challenge.run(Scripted([DEEP]), drawn, 60)
    assert "not JSON (JSON nested deeper than 64 levels.)" in out.problem


def test_memproof_deeply_nested_root_is_a_finding_not_a_crash():
    drawn = memproof.draw(_declared(), [0], rng=random.Random(1))
    out = memproof.run(Scripted([DEEP]), drawn, 60)
    assert "nested deeper" in out.problem


def test_agent_answer_deeply_nested_is_agent_garbage(monkeypatch):
    """The inventory/benchmark answer (ssh.py NodeSession.agent): a RecursionError, not AgentGarbage, so the
    task's catch-all calls it an internal error of the platform (not the node's fault: an active node keeps its
    listing)."""
    session = NodeSession.__new__(NodeSession)
    session.timeouts = type("T", (), {"command": 5})()
    monkeypatch.setattr(session, "ensure_agent", lambda: "/tmp/agent.py", raising=False)
    monkeypatch.setattr(session, "_exec", lambda cmd, payload, timeout: DEEP, raising=False)
    with pytest.raises(NodeError, match="refused: JSON nested deeper"):
        session.agent("inventory")


def test_served_answer_deeply_nested_is_agent_garbage():
    """ssh_channels.AgentServe.answer (the long-lived agent: health probes of a whole fleet batch, which re-raises
    anything but NodeError: one node's answer would end the batch of up to 250 nodes)."""
    from provisioning.ssh_channels import AgentServe

    class Once:
        def send(self, message):
            return time.monotonic()

        def receive(self, timeout):
            return DEEP, time.monotonic()

        def close(self):
            pass

    serve = AgentServe(Once())
    with pytest.raises(NodeError, match="not the answer"):
        serve.answer(serve.send("health", {}), 5)
