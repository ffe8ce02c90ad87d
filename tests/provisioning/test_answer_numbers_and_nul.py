"""What Python's json takes but a node's answer may not hold: NaN and Infinity, a float past the double's range
(1e999), an integer past 64 bits (10**400: math.isfinite on it raised OverflowError, a verification crashed as the
platform's failure and an active node kept its listing), and a NUL anywhere (no text column takes one: a NUL in a
VM id or an error message quoted into `last_error` failed the health batch's write, and one in a spot check's
refusal failed its node event, turning the node's dodge into the platform's internal error). Each is the node's
garbage at the parse, on every path an answer comes by (found by review)."""
import json
import random
import time

import pytest

from core import untrusted_json
from provisioning.ssh import NodeSession
from provisioning.ssh_channels import AgentServe
from provisioning.ssh_errors import AgentGarbage
from provisioning.verification import challenge
from tests.provisioning.test_nested_answers import Scripted, _declared

HEALTH = {"ok": True, "runtime": "docker", "runtime_ok": True, "gpu_count": 2, "vms": {"inst-1": "running"}}

REFUSED = [
    (b'{"ok": true, "gpus": [{"power_limit_w": ' + b"1" * 401 + b"}]}", "integer 1111"),
    (b'{"ok": true, "bf16_tflops": 1e999}', "1e999 is out of range"),
    (b'{"ok": true, "bf16_tflops": NaN}', "NaN"),
    (b'{"ok": true, "x": -Infinity}', "-Infinity"),
    (b'{"ok": true, "vms": {"inst\\u0000": "running"}}', "NUL"),
    (b'{"ok": false, "error": {"code": "runtime_down", "message": "docker\\u0000down"}}', "NUL"),
]


@pytest.mark.parametrize("text, why", REFUSED)
def test_an_agent_answer_holding_what_no_column_takes_is_agent_garbage_saying_why(monkeypatch, text, why):
    session = NodeSession.__new__(NodeSession)
    session.timeouts = type("T", (), {"command": 5})()
    monkeypatch.setattr(session, "ensure_agent", lambda: "/tmp/agent.py", raising=False)
    monkeypatch.setattr(session, "_exec", lambda cmd, payload, timeout: text, raising=False)
    with pytest.raises(AgentGarbage, match="refused") as raised:
        session.agent("inventory")
    assert why in str(raised.value)
    assert "\x00" not in str(raised.value)  # what is stored of it (a job's error, last_error) takes it


@pytest.mark.parametrize("text, why", REFUSED)
def test_a_served_answer_holding_what_no_column_takes_is_agent_garbage(text, why):
    line = text.replace(b'{"ok"', b'{"id": 1, "ok"', 1)

    class Once:
        def send(self, message):
            return time.monotonic()

        def receive(self, timeout):
            return line, time.monotonic()

        def close(self):
            pass

    serve = AgentServe(Once())
    with pytest.raises(AgentGarbage):
        serve.answer(serve.send("health", {}), 5)


def test_a_challenge_refusal_with_a_nul_is_the_nodes_garbage_and_quotes_no_nul():
    drawn = challenge.draw(_declared(), [0], quick=True, rng=random.Random(1))
    refusal = json.dumps({"ok": False, "error": {"code": "x", "message": "no\u0000pe"}}).encode()
    out = challenge.run(Scripted([refusal]), drawn, 60)
    assert out.problem and "NUL" in out.problem and "\x00" not in out.problem


def test_numbers_within_range_and_text_without_nul_still_parse():
    answer = untrusted_json.answer_loads(b'{"a": [9223372036854775807, -9223372036854775808, 1e308, -0.0, "x\\u00e9"]}')
    assert answer == {"a": [2**63 - 1, -(2**63), 1e308, -0.0, "x\u00e9"]}
    assert untrusted_json.loads('"a\\u0000"') == "a\x00"  # clients' bodies: their fields name a NUL themselves
    with pytest.raises(untrusted_json.NotANumber):
        untrusted_json.loads("[NaN]")
