"""Review r53 #4: JSON nested deeper than Python's recursion limit is the caller's bad input (invalid_request), not
the agent's own bug (internal_error), both on the command line (cli.handle) and in `serve` (serve.parse_request)."""
from pathlib import Path

import pytest

from provisioning.agent.gpumarket_agent import cli, serve
from provisioning.agent.gpumarket_agent.core import AgentError

DEEP = "[" * 200000
PROFILES = Path(__file__).resolve().parents[2] / "provisioning" / "agent" / "profiles"


def test_cli_answers_invalid_request_for_deeply_nested_stdin(tmp_path):
    env = {"GPUMARKET_RUNTIME": "sim", "GPUMARKET_SIM_PROFILE": str(PROFILES / "a10-x2.json"),
           "GPUMARKET_SIM_ROOT": str(tmp_path / "sim")}
    answer, status = cli.handle(["vm", "create"], DEEP, env)
    assert answer["ok"] is False
    assert answer["error"]["code"] == "invalid_request", answer
    assert answer["error"]["field"] == "request"
    assert "nested too deeply" in answer["error"]["message"]
    assert status == 2


def test_serve_answers_invalid_request_for_a_deeply_nested_line():
    with pytest.raises(AgentError) as caught:
        serve.parse_request(DEEP.encode(), {"health": lambda cfg, req: {}})
    assert caught.value.code == "invalid_request"
    assert caught.value.field == "request"
    assert "nested too deeply" in caught.value.message
