"""`manage.py simnodes`: the demo's way to start simulated GPU servers (real sshd processes)."""
import io
import json

import pytest
from django.core.management import CommandError, call_command

from provisioning import sim
from tests.provisioning.sshkit import new_keypair, pinned_client, run_agent, upload_agent

pytestmark = pytest.mark.slow


@pytest.fixture
def simdir(settings, tmp_path):
    settings.SIMNODES_DIR = tmp_path
    try:
        yield tmp_path
    finally:
        sim.nodes_down(tmp_path)


def simnodes(*args):
    out = io.StringIO()
    call_command("simnodes", *args, stdout=out)
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_up_authorize_list_down(simdir):
    nodes = simnodes("up", "--profile", "rtx-a4000-x2", "--count", "2")
    assert len(nodes) == 2 and len({n["ssh_port"] for n in nodes}) == 2
    for node in nodes:
        assert set(node) >= {"address", "ssh_port", "ssh_user", "host_key_fingerprint", "profile", "pid"}
        assert node["profile"] == "rtx-a4000-x2"
        assert node["node_dir"].startswith(str(simdir))

    key, public = new_keypair("platform")
    port = nodes[0]["ssh_port"]
    # A key pasted unquoted arrives as several words: the command puts the line back together.
    assert simnodes("authorize", str(port), *public.split()) == [{"ssh_port": port, "authorized": True,
                                                                   "added": True}]
    with pinned_client("127.0.0.1", port, nodes[0]["ssh_user"], key, nodes[0]["host_public_key"]) as ssh:
        status, answer = run_agent(ssh, upload_agent(ssh), "inventory")
    assert (status, answer["gpu_count"]) == (0, 2)

    listed = simnodes("list")
    assert [(n["ssh_port"], n["running"]) for n in listed] == sorted((n["ssh_port"], True) for n in nodes)

    assert simnodes("down", "--port", str(port)) == [{"stopped": 1, "ssh_port": port}]
    assert [n["ssh_port"] for n in simnodes("list")] == [nodes[1]["ssh_port"]]
    assert simnodes("down") == [{"stopped": 1}]
    assert simnodes("list") == []


def test_errors_are_command_errors(simdir):
    with pytest.raises(CommandError, match="no profile"):
        simnodes("up", "--profile", "no-such-profile")
    with pytest.raises(CommandError, match="no simulated node"):
        simnodes("authorize", "1", *new_keypair()[1].split())
    with pytest.raises(CommandError, match="no simulated node"):
        simnodes("down", "--port", "1")
    (node,) = simnodes("up", "--profile", "h100-sxm-x1")
    with pytest.raises(CommandError, match="options are not allowed"):
        simnodes("authorize", str(node["ssh_port"]), 'command="id"', *new_keypair()[1].split())
