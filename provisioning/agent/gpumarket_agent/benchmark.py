"""The benchmark command. It measures every GPU at once with PyTorch, imported in measurements.import_torch()
only: every other command stays stdlib-only. With device "cpu" the same code measures the host CPU (how it is
tested without a GPU). In sim mode the figures come from the profile's `performance` section, with run-to-run
noise, in the same shape."""
import os
import random
import threading
import time

from .core import _WATCHDOG, AGENT_VERSION, AgentError, emit, invalid
from .measurements import MATMUL_DTYPES, bench_plan, import_torch, measure
from .mig import bench_slices, validate_mig_uuids
from .smi import load_profile
from .topology import measure_p2p, sim_copy_seconds, torch_copy_seconds
from .validation import reject_unknown

BENCH_LIMIT_S = (300, 1, 900)  # default, least and most time_limit_s a request may ask for


# The sim's small-CNN figures: ~13.8 MFLOP per training image (forward ~4.6), at this share of FP32 throughput.
SIM_CNN = {"train_flop": 13.8e6, "infer_flop": 4.6e6, "efficiency": 0.1}


def validate_benchmark(req):
    reject_unknown(req, ("quick", "device", "gpu_indices", "time_limit_s", "mig_uuids"))
    quick, device = req.get("quick", False), req.get("device", "cuda")
    limit, indices = req.get("time_limit_s", BENCH_LIMIT_S[0]), req.get("gpu_indices")
    if type(quick) is not bool:
        raise invalid("quick", "quick must be true or false")
    if device not in ("cuda", "cpu"):
        raise invalid("device", "device must be cuda or cpu")
    if type(limit) is not int or not BENCH_LIMIT_S[1] <= limit <= BENCH_LIMIT_S[2]:
        raise invalid("time_limit_s", "time_limit_s must be an integer from %d to %d" % BENCH_LIMIT_S[1:])
    if indices is not None and (not isinstance(indices, list) or len(set(indices)) != len(indices)
                                or not all(type(i) is int and 0 <= i < 64 for i in indices)):
        raise invalid("gpu_indices", "gpu_indices must be a list of distinct GPU indices")
    return quick, device, limit, indices


def start_watchdog(seconds):
    def expire():
        if emit({"ok": False, "agent_version": AGENT_VERSION, "error": {
                "code": "benchmark_timeout", "message": "the benchmark did not finish within %ds" % seconds}}):
            os._exit(1)
    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


class Deadline:
    def __init__(self, seconds):
        self.seconds, self.at = seconds, time.monotonic() + seconds

    def check(self, phase):
        if time.monotonic() > self.at:
            raise AgentError("benchmark_timeout", "the benchmark did not finish within %ds (it was measuring %s)" % (
                self.seconds, phase))


def cmd_benchmark(cfg, req):
    quick, device, limit, indices = validate_benchmark(req)
    mig_uuids = validate_mig_uuids(req.get("mig_uuids"))
    if _WATCHDOG:
        start_watchdog(limit)
    started = time.monotonic()
    if indices == [] and mig_uuids:  # only slices to measure (every whole card is split or rented)
        answer = {"mode": "simulated" if cfg.runtime == "sim" else "measured", "device": device, "quick": quick,
                  "gpus": []}
    elif cfg.runtime == "sim" and device == "cuda":
        answer = sim_benchmark(cfg, quick, indices)
    else:
        answer = measure(device, quick, indices, Deadline(limit))
    if mig_uuids:  # each MIG slice on its own (mig.py)
        answer["mig_slices"] = bench_slices(cfg, quick, mig_uuids)
    if device == "cuda":
        answer["p2p"] = p2p_figures(cfg, [g["index"] for g in answer.get("gpus") or []])
    answer.update(duration_s=round(time.monotonic() - started, 3), time_limit_s=limit)
    return answer


def p2p_figures(cfg, indices, wait=True):
    """Peer-to-peer copy GB/s between each pair of the benchmarked GPUs (none with fewer than two); a sim copy
    waits as long as its hardware's would unless `wait` is False (in-process judging, sim_copy_seconds)."""
    if len(indices) < 2:
        return []
    if cfg.runtime == "sim":
        rng = random.Random(os.urandom(16))  # noqa: S311 - noise, not secrets
        noisy = lambda v: v * (1 + max(-0.03, min(0.03, rng.gauss(0, 0.012))))  # noqa: E731
        return measure_p2p(sorted(indices), sim_copy_seconds(load_profile(cfg.sim_profile)[0], noisy, wait))
    return measure_p2p(sorted(indices), torch_copy_seconds(import_torch()))


def sim_benchmark(cfg, quick, indices):
    """The profile's `performance` figures with run-to-run noise, shaped exactly like measure()'s answer."""
    profile, claimed = load_profile(cfg.sim_profile)
    perf = profile.get("performance") or {}
    if perf.get("hang_s"):  # a knob for tests: a benchmark that never comes back (a wedged driver)
        time.sleep(perf["hang_s"])
    rng = random.Random(os.urandom(16))  # noqa: S311 - noise, not secrets

    def noisy(value, digits=3):  # about 1 % run to run, never past 3 %
        return round(value * (1 + max(-0.03, min(0.03, rng.gauss(0, 0.012)))), digits)
    plan, specs, gpus = bench_plan("cuda", quick), {g["index"]: g for g in perf.get("gpus", [])}, []
    for card in claimed:
        spec = specs.get(card["index"])
        if spec is None or (indices is not None and card["index"] not in indices):
            continue
        sheet, frac, tele = dict(perf.get("datasheet", {}), **spec.get("datasheet", {})), spec["fraction"], \
            spec["telemetry"]
        fake = spec.get("fake_figures", perf.get("fake_figures"))
        if fake:  # a shim that reports another card's figures; the challenge (challenge.py) still takes real time
            sheet, frac = dict(sheet, **fake.get("datasheet", {})), dict(frac, **fake.get("fraction", {}))
        # What a driver shim makes CUDA report, per GPU or for all of them; else the real thing.
        shim = {k: spec.get(k, perf.get(k, real)) for k, real in (
            ("cuda_memory_mib", card["memory_total_mib"]), ("cuda_name", card["name"]),
            ("cuda_sm_count", sheet.get("sm_count")))}
        gpu = {"index": card["index"], "uuid": card["uuid"], "memory_mib": shim["cuda_memory_mib"],
               "name": shim["cuda_name"], "sm_count": shim["cuda_sm_count"], "matmul_shapes_tflops": {}}
        for name in MATMUL_DTYPES:
            figures = [noisy(sheet[name + "_tflops"] * frac[name]) for _ in plan["matmul_shapes"]]
            gpu["matmul_shapes_tflops"][name], gpu[name + "_tflops"] = figures, max(figures)
        link = sheet["host_link_gbs"] * frac["host_link"]
        gpu.update(memory_bandwidth_gbs=noisy(sheet["memory_bandwidth_gbs"] * frac["memory_bandwidth"], 2),
                   h2d_gbs=noisy(link, 2), d2h_gbs=noisy(link, 2))
        flops = gpu["fp32_tflops"] * 1e12 * SIM_CNN["efficiency"]
        gpu.update(cnn_train_images_s=noisy(flops / SIM_CNN["train_flop"], 1),
                   cnn_infer_images_s=noisy(flops / SIM_CNN["infer_flop"], 1))
        # A shim may also report its own correctness check as passed: the challenge still gets the wrong products.
        correct = spec.get("matmul_correct", True) or spec.get("fake_correct", perf.get("fake_correct", False))
        gpu["matmul_rel_error"] = {"fp32": noisy(2e-7 if correct else 0.25, 12),
                                   "bf16": noisy(3e-3 if correct else 0.3, 9)}
        reasons = sorted(tele.get("clocks_event_reasons", []))
        gpu["telemetry"] = {
            "samples": 40, "sm_clock_mhz": min(noisy(tele["sm_clock_mhz"], 0), sheet.get("max_sm_clock_mhz") or 1e9),
            "sm_clock_max_mhz": sheet.get("max_sm_clock_mhz"), "power_draw_w": tele.get("power_draw_w"),
            "temperature_c": tele.get("temperature_c"), "clocks_event_reasons": reasons,
            "clocks_event_reason_samples": {r: 30 for r in reasons}, "pcie_link_gen": tele.get("pcie_link_gen"),
            "pcie_link_width": tele.get("pcie_link_width"), "error": None}
        gpus.append(gpu)
    return {"mode": "simulated", "device": "cuda", "quick": quick, "plan": plan, "torch_version": None,
            "cuda_runtime": None, "gpus": gpus}
