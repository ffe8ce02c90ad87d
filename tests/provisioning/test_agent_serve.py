"""The long-lived agent (`serve`, provisioning/agent/gpumarket_agent/serve.py), run as the platform runs it: the
zipapp in a python3 process, JSON lines on its stdin and stdout. It answers the read-only commands only, validates
every line as strictly as the command line does, keeps answering after a bad line, and stops when its input ends
or its own file is replaced."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from provisioning.ssh import agent_bundle

PROFILES = Path(__file__).resolve().parents[2] / "provisioning" / "agent" / "profiles"


@pytest.fixture
def agent(tmp_path):
    """A started `serve` agent in sim mode: (process, path of its file)."""
    path = tmp_path / "gpumarket_agent.pyz"
    path.write_bytes(agent_bundle()[0])
    env = {**os.environ, "GPUMARKET_RUNTIME": "sim", "GPUMARKET_SIM_PROFILE": str(PROFILES / "a10-x2.json"),
           "GPUMARKET_SIM_ROOT": str(tmp_path / "sim")}
    proc = subprocess.Popen([sys.executable, str(path), "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    yield proc, path
    proc.kill()
    proc.wait(timeout=10)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        stream.close()


def ask(proc, line: bytes) -> dict:
    proc.stdin.write(line + b"\n")
    proc.stdin.flush()
    answer = proc.stdout.readline()
    assert answer.endswith(b"\n"), (answer, proc.stderr.read() if proc.poll() is not None else b"")
    return json.loads(answer)


def request(**msg) -> bytes:
    return json.dumps(msg).encode()


def test_health_is_answered_line_after_line_with_the_request_id(agent):
    proc, _ = agent
    for rid in (1, 2, 7):
        answer = ask(proc, request(id=rid, command="health", request={}))
        assert answer["id"] == rid and answer["ok"] is True, answer
        assert answer["gpu_count"] == 2 and answer["runtime"] == "sim" and answer["inventory_hash"]
    proc.stdin.close()
    assert proc.wait(timeout=10) == 0  # the end of its input (the channel closed) ends it


@pytest.mark.parametrize(("line", "field"), [
    (b"not json", "request"),
    (b"[1, 2]", "request"),
    (request(id=1, command="health", request={}, extra=1), "extra"),
    (request(id="1", command="health"), "id"),
    (request(id=True, command="health"), "id"),
    (request(id=-1, command="health"), "id"),
    (request(command="health"), "id"),
    (request(id=1, command="inventory"), "command"),  # not a served command
    (request(id=1, command=["vm", "create"]), "command"),
    (request(id=1, command="vm"), "command"),
    (request(id=1, command="health", request=[]), "request"),
    (request(id=1, command="health", request={"vm_id": "x"}), "vm_id"),  # health takes no field
])
def test_a_bad_line_is_refused_naming_the_field_and_the_agent_keeps_serving(agent, line, field):
    proc, _ = agent
    answer = ask(proc, line)
    assert answer["ok"] is False and answer["error"]["code"] == "invalid_request", answer
    assert answer["error"]["field"] == field
    assert ask(proc, request(id=2, command="health"))["ok"] is True


def test_a_line_over_the_size_limit_is_refused_and_ends_the_agent(agent):
    proc, _ = agent
    answer = ask(proc, b" " * (1 << 20) + request(id=1, command="health"))
    assert answer == {"ok": False, "id": None, "agent_version": answer["agent_version"],
                      "error": {"code": "invalid_request", "field": "request", "message": "request larger than 1 MiB"}}
    assert proc.wait(timeout=10) == 2


def test_a_replaced_agent_file_ends_the_agent_with_agent_missing(agent):
    proc, path = agent
    assert ask(proc, request(id=1, command="health"))["ok"] is True
    path.unlink()
    path.write_bytes(agent_bundle()[0])  # an upgrade or a clean-up put another file there
    answer = ask(proc, request(id=2, command="health"))
    assert answer["id"] == 2 and answer["error"]["code"] == "agent_missing", answer
    assert proc.wait(timeout=10) == 1
