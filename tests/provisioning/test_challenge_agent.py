"""`agent challenge`, the node's side, as the platform runs it: the zipapp in a process, one JSON line each way.
Bad requests get an error line and end the exchange; a hung sim node ends at the challenge's time limit."""
import json
import subprocess
import sys
import time

import pytest

from provisioning.sim import PROFILES_DIR
from provisioning.verification import challenge
from provisioning.verification.model import DeclaredModel, load_catalogue
from tests.provisioning.sshkit import write_agent

A4000 = DeclaredModel.from_catalogue(load_catalogue()["rtx-a4000"])


def start(tmp_path, profile=None, runtime="sim", command="challenge"):
    env = {"GPUMARKET_RUNTIME": runtime, "GPUMARKET_SIM_ROOT": str(tmp_path), "PATH": "/usr/bin:/bin"}
    if profile is not None:
        path = tmp_path / "profile.json"
        data = profile if isinstance(profile, dict) else json.loads((PROFILES_DIR / f"{profile}.json").read_text())
        path.write_text(json.dumps(data))
        env["GPUMARKET_SIM_PROFILE"] = str(path)
    return subprocess.Popen([sys.executable, str(write_agent(tmp_path)), command], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)


def say(proc, message):
    proc.stdin.write(json.dumps(message) + "\n")
    proc.stdin.flush()


def hear(proc):
    return json.loads(proc.stdout.readline())


def request(**changes):
    return dict(challenge.draw(A4000, [0, 1], quick=True).request(30), **changes)


def test_the_whole_exchange_in_order(tmp_path):
    proc = start(tmp_path, "rtx-a4000-x2")
    say(proc, {"ping": 0})
    assert hear(proc) == {"pong": 0}
    started = time.monotonic()
    say(proc, {"challenge": request()})
    first, second = hear(proc), hear(proc)
    assert {first["gpu"], second["gpu"]} == {0, 1} and all(len(m["commitment"]) == 64 for m in (first, second))
    assert time.monotonic() - started > 1.5 / 0.75  # an RTX A4000 at ~72 % of its datasheet: no sooner
    say(proc, {"reveal": {"1": [[1, 3], [0, 15]]}})
    line = hear(proc)
    assert line["gpu"] == 1
    revealed = {"1": line["revealed"]}
    assert [(r["product"], r["row"]) for r in revealed["1"]["rows"]] == [(1, 3), (0, 15)]
    assert len(revealed["1"]["rows"][0]["values"]) == 16 and len(revealed["1"]["product_digests"]) == 2
    assert hear(proc)["ok"] is True and proc.wait(5) == 0


@pytest.mark.parametrize("message, field", [
    ({"challenge": request(seed=-1)}, "seed"),
    ({"challenge": request(n=100000)}, "n"),
    ({"challenge": request(dtype="fp8")}, "dtype"),
    ({"challenge": request(gpu_indices=[0, 0])}, "gpu_indices"),
    ({"challenge": request(gpu_indices=[5])}, "gpu_indices"),
    ({"challenge": request(extra=1)}, "extra"),
    ({"challenge": "please"}, "challenge"),
])
def test_a_bad_challenge_gets_an_error_line_and_ends(tmp_path, message, field):
    proc = start(tmp_path, "rtx-a4000-x2")
    say(proc, message)
    answer = hear(proc)
    assert answer["ok"] is False and (answer["error"]["code"], answer["error"]["field"]) == ("invalid_request", field)
    assert proc.wait(5) == 2


@pytest.mark.parametrize("reveal", [{"7": [[0, 0]]}, {"0": [[9, 0]]}, {"0": [[0, 99]]}, {"0": "all"}, []])
def test_a_bad_reveal_gets_an_error_line(tmp_path, reveal):
    proc = start(tmp_path, "rtx-a4000-x2")
    say(proc, {"challenge": request(flop_per_gpu=1.0)})
    hear(proc), hear(proc)
    say(proc, {"reveal": reveal})
    assert hear(proc)["error"]["code"] == "invalid_request" and proc.wait(5) == 2


def test_a_node_without_the_cuda_path_says_so(tmp_path):
    proc = start(tmp_path, runtime="docker")
    say(proc, {"challenge": request()})
    assert hear(proc)["error"]["code"] == "challenge_unsupported" and proc.wait(5) == 1


def test_a_platform_that_hangs_up_ends_the_agent(tmp_path):
    proc = start(tmp_path, "rtx-a4000-x2")
    proc.stdin.close()
    assert hear(proc)["error"]["code"] == "challenge_aborted" and proc.wait(5) == 1


def test_a_hung_node_ends_at_the_challenges_time_limit(tmp_path):
    data = json.loads((PROFILES_DIR / "rtx-a4000-x2.json").read_text())
    data["performance"]["challenge_hang_s"] = 120
    proc = start(tmp_path, data)
    started = time.monotonic()
    say(proc, {"challenge": request(time_limit_s=1)})
    assert proc.wait(10) == 1 and time.monotonic() - started < 5
