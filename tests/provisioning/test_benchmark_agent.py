"""`agent benchmark`: the measuring code on this machine's CPU (quick mode), the sim answers, telemetry parsing,
request checks, and its time bound. No database, no SSH (test_benchmark_verification.py goes over SSH)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from provisioning.agent import gpumarket_agent as agent
from provisioning.sim import PROFILES_DIR
from tests.provisioning.sshkit import write_agent

pytest.importorskip("torch")

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "nvidia_smi"
GPU_KEYS = {"index", "uuid", "name", "memory_mib", "sm_count", "bf16_tflops", "fp16_tflops", "tf32_tflops",
            "fp32_tflops", "matmul_shapes_tflops", "memory_bandwidth_gbs", "h2d_gbs", "d2h_gbs", "cnn_train_images_s",
            "cnn_infer_images_s", "matmul_rel_error", "telemetry"}
TOP_KEYS = {"mode", "device", "quick", "plan", "torch_version", "cuda_runtime", "gpus", "duration_s", "time_limit_s",
            "ok", "agent_version"}


# The tests of `cpu_run` (a real CPU benchmark, module scope) on one xdist worker (`make test`'s --dist
# loadgroup): spread over two, each ran the benchmark again (about 3 s each).
ONE_CPU_RUN = pytest.mark.xdist_group("benchmark_agent_cpu_run")


@pytest.fixture(scope="module")
def cpu_run():
    """One quick benchmark of this machine's CPU with the real measuring code (PyTorch CPU build)."""
    started = time.monotonic()
    answer, status = agent.handle(["benchmark"], json.dumps({"device": "cpu", "quick": True}), {})
    return answer, status, time.monotonic() - started


@ONE_CPU_RUN
def test_the_measuring_code_runs_on_cpu_in_bounded_time(cpu_run):
    answer, status, seconds = cpu_run
    assert status == 0, answer
    assert set(answer) == TOP_KEYS
    assert (answer["mode"], answer["device"], answer["quick"]) == ("measured", "cpu", True)
    assert seconds < 30 and answer["duration_s"] <= seconds + 0.01
    assert answer["torch_version"].startswith("2.")
    [gpu] = answer["gpus"]
    assert set(gpu) == GPU_KEYS
    plan = agent.bench_plan("cpu", True)
    assert answer["plan"] == plan
    for dtype in agent.MATMUL_DTYPES:
        per_shape = gpu["matmul_shapes_tflops"][dtype]
        assert len(per_shape) == len(plan["matmul_shapes"]) and all(v > 0 for v in per_shape)
        assert gpu[f"{dtype}_tflops"] == max(per_shape)
    assert gpu["memory_bandwidth_gbs"] > 0.1
    assert gpu["cnn_train_images_s"] > 0 and gpu["cnn_infer_images_s"] > 0
    assert (gpu["h2d_gbs"], gpu["d2h_gbs"], gpu["telemetry"]) == (None, None, None)  # no GPU, no PCIe link


@ONE_CPU_RUN
def test_cpu_matmuls_agree_with_fp64(cpu_run):
    errors = cpu_run[0]["gpus"][0]["matmul_rel_error"]
    assert 0 < errors["fp32"] < 1e-5  # FP32 with K=256: ~1e-7
    assert 0 < errors["bf16"] < 1e-2  # bf16 output rounding: ~2e-3


def sim_cfg(name):
    return SimpleNamespace(sim_profile=str(PROFILES_DIR / f"{name}.json"))


@ONE_CPU_RUN
def test_sim_answers_have_the_shape_of_a_measured_one(cpu_run):
    env = {"GPUMARKET_RUNTIME": "sim", "GPUMARKET_SIM_PROFILE": str(PROFILES_DIR / "rtx-a4000-x2.json"),
           "GPUMARKET_SIM_ROOT": "/nonexistent"}
    answer, status = agent.handle(["benchmark"], json.dumps({"quick": True}), env)
    assert status == 0
    assert set(answer) == set(cpu_run[0]) | {"p2p"}  # peer-to-peer copies: GPUs only
    assert answer["mode"] == "simulated" and [g["index"] for g in answer["gpus"]] == [0, 1]
    for gpu in answer["gpus"]:
        assert set(gpu) == GPU_KEYS
        assert set(gpu["telemetry"]) == {"samples", "sm_clock_mhz", "sm_clock_max_mhz", "power_draw_w",
                                         "temperature_c", "clocks_event_reasons", "clocks_event_reason_samples",
                                         "pcie_link_gen", "pcie_link_width", "error"}
    only_one = agent.sim_benchmark(sim_cfg("rtx-a4000-x2"), True, [1])
    assert [g["index"] for g in only_one["gpus"]] == [1]


def test_sim_noise_is_a_few_percent_and_never_the_same_twice():
    profile = json.loads((PROFILES_DIR / "a100-80gb-sxm-x4.json").read_text())
    sheet, frac = profile["performance"]["datasheet"], profile["performance"]["gpus"][0]["fraction"]
    draws = [agent.sim_benchmark(sim_cfg("a100-80gb-sxm-x4"), False, [0])["gpus"][0] for _ in range(200)]
    bandwidth = [d["memory_bandwidth_gbs"] / (sheet["memory_bandwidth_gbs"] * frac["memory_bandwidth"]) for d in draws]
    assert max(abs(r - 1) for r in bandwidth) <= 0.0301
    assert 0.005 < (max(bandwidth) - min(bandwidth)) / 2  # it is noisy
    assert len({d["bf16_tflops"] for d in draws}) > 150


def test_a_sim_card_with_wrong_results_reports_large_errors():
    gpus = agent.sim_benchmark(sim_cfg("rtx-a4000-x2-bad-matmul"), True, None)["gpus"]
    assert gpus[0]["matmul_rel_error"]["fp32"] > 0.1 and gpus[1]["matmul_rel_error"]["fp32"] < 1e-6


@pytest.mark.parametrize(("request_body", "field"), [
    ({"quick": "yes"}, "quick"), ({"device": "tpu"}, "device"), ({"time_limit_s": 0}, "time_limit_s"),
    ({"time_limit_s": 901}, "time_limit_s"), ({"time_limit_s": 1.5}, "time_limit_s"), ({"gpu_indices": [0, 0]},
                                                                                       "gpu_indices"),
    ({"gpu_indices": "0"}, "gpu_indices"), ({"gpu_indices": [-1]}, "gpu_indices"), ({"repeats": 100}, "repeats"),
])
def test_malformed_requests_are_refused(request_body, field):
    answer, status = agent.handle(["benchmark"], json.dumps(request_body), {})
    assert (status, answer["error"]["code"], answer["error"]["field"]) == (2, "invalid_request", field)


def test_no_gpu_for_pytorch_is_a_clear_error():
    answer, status = agent.handle(["benchmark"], json.dumps({"quick": True}), {})  # this machine's torch: CPU only
    assert (status, answer["error"]["code"]) == (1, "no_cuda")
    assert "sees no GPU" in answer["error"]["message"]


@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="needs a python3 without PyTorch")
def test_a_node_without_pytorch_says_so(tmp_path):
    probe = subprocess.run(["/usr/bin/python3", "-c", "import torch"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip("/usr/bin/python3 has PyTorch")
    proc = subprocess.run(["/usr/bin/python3", str(write_agent(tmp_path)), "benchmark"], input='{"device": "cpu"}',
                          capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    [line] = proc.stdout.splitlines()
    answer = json.loads(line)
    assert (proc.returncode, answer["ok"], answer["error"]["code"]) == (1, False, "no_torch")
    assert "pip install torch" in answer["error"]["message"]


def test_a_hung_benchmark_is_stopped_at_its_time_limit(tmp_path):
    profile = json.loads((PROFILES_DIR / "rtx-a4000-x2.json").read_text())
    profile["performance"]["hang_s"] = 120  # uninterruptible, like a wedged driver call
    (tmp_path / "hang.json").write_text(json.dumps(profile))
    env = {"PATH": os.environ["PATH"], "GPUMARKET_RUNTIME": "sim", "GPUMARKET_SIM_PROFILE": str(tmp_path / "hang.json"),
           "GPUMARKET_SIM_ROOT": str(tmp_path)}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(write_agent(tmp_path)), "benchmark"], input='{"time_limit_s": 1}',
                          capture_output=True, text=True, timeout=30, env=env)
    elapsed = time.monotonic() - started
    [line] = proc.stdout.splitlines()  # exactly one answer, from the watchdog
    answer = json.loads(line)
    assert (proc.returncode, answer["error"]["code"]) == (1, "benchmark_timeout")
    assert "within 1s" in answer["error"]["message"]
    assert elapsed < 5


def test_the_deadline_stops_a_measurement_between_phases():
    deadline = agent.Deadline(0)
    time.sleep(0.01)
    with pytest.raises(agent.AgentError) as err:
        deadline.check("bf16")
    assert err.value.code == "benchmark_timeout" and "bf16" in err.value.message


# -- telemetry

SMI_TELEMETRY = """\
0, 1410, 1410, 387.52, 62, 0x0000000000000004, 4, 16
1, 1095, 1410, 301.10, 91, 0x0000000000000048, 4, 16
2, 210, 1410, 61.00, 35, 0x0000000000000001, 1, 16
3, [N/A], [N/A], [N/A], 40, [Not Supported], [N/A], [N/A]
"""


def test_telemetry_rows_and_clock_event_reasons_are_parsed():
    rows = agent.parse_telemetry(SMI_TELEMETRY + "garbage line\n")
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["clocks_event_reasons"] == ["SwPowerCap"]
    assert rows[1]["clocks_event_reasons"] == ["HwSlowdown", "HwThermalSlowdown"]
    assert rows[2]["clocks_event_reasons"] == ["GpuIdle"] and rows[2]["pcie_link_gen"] == 1.0
    assert rows[3]["sm_clock_mhz"] is None and rows[3]["clocks_event_reasons"] == []
    assert (rows[1]["sm_clock_mhz"], rows[1]["power_draw_w"], rows[1]["temperature_c"]) == (1095.0, 301.1, 91.0)


def test_telemetry_summary_looks_at_samples_under_load():
    tele = agent.Telemetry([0])
    idle = dict(agent.parse_telemetry("0, 210, 1410, 61.00, 35, 0x1, 1, 16")[0], phase="start")
    busy = [dict(agent.parse_telemetry(f"0, {clock}, 1410, 390.0, {temp}, {reasons}, 4, 16")[0], phase="bf16")
            for clock, temp, reasons in ((1410, 60, "0x4"), (1350, 70, "0x4"), (1200, 83, "0x40"))]
    tele.samples = [idle, *busy]
    summary = tele.summary(0)
    assert summary["samples"] == 4
    assert summary["sm_clock_mhz"] == 1350 and summary["sm_clock_max_mhz"] == 1410
    assert summary["clocks_event_reasons"] == ["HwThermalSlowdown", "SwPowerCap"]
    assert summary["clocks_event_reason_samples"] == {"SwPowerCap": 2, "HwThermalSlowdown": 1}
    assert (summary["pcie_link_gen"], summary["pcie_link_width"], summary["temperature_c"]) == (4, 16, 83)


def test_telemetry_falls_back_to_the_older_field_name(tmp_path, monkeypatch):
    # Drivers before 535 know clocks_throttle_reasons.active only, and refuse the whole query otherwise.
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\ncase \"$*\" in *clocks_event_reasons*) echo 'Field \"clocks_event_reasons.active\" "
                    "is not a valid field to query.' >&2; exit 2;; esac\necho '0, 1410, 1410, 380.1, 60, 0x8, 4, 16'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    tele = agent.Telemetry([0], interval=0.05)
    tele.phase = "bf16"
    tele.sample()
    assert tele.fields[5] == "clocks_throttle_reasons.active" and tele.error is None
    assert tele.summary(0)["clocks_event_reasons"] == ["HwSlowdown"]


def test_telemetry_without_nvidia_smi_records_the_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    tele = agent.Telemetry([0])
    tele.sample()
    assert "not installed" in tele.error and tele.summary(0)["samples"] == 0


# -- inventory digest (re-verification when it changes)

def test_inventory_hash_follows_identity_not_load():
    gpus = agent.parse_gpu_csv((FIXTURES / "a100_sxm4_80gb_x4.csv").read_text())  # real nvidia-smi output
    digest = agent.inventory_hash(gpus)
    assert digest == agent.inventory_hash([dict(g) for g in reversed(gpus)])
    idle = [dict(g, pcie_link_gen_current=1) for g in gpus]
    assert agent.inventory_hash(idle) == digest
    capped = [dict(g) for g in gpus]
    capped[2]["power_limit_w"] = 250.0
    assert agent.inventory_hash(capped) != digest


def test_health_reports_the_inventory_digest(tmp_path):
    profile = PROFILES_DIR / "rtx-a4000-x2.json"
    env = {"GPUMARKET_RUNTIME": "sim", "GPUMARKET_SIM_PROFILE": str(profile), "GPUMARKET_SIM_ROOT": str(tmp_path)}
    answer, status = agent.handle(["health"], "{}", env)
    assert status == 0
    assert answer["inventory_hash"] == agent.inventory_hash(agent.load_profile(str(profile))[1])
