"""The thresholds every acceptance rule reads, in one reviewed table (TOLERANCES), and the measured figures the
rules judge with their names for people. No rule hides a literal: a rule reads its threshold here.
"""
from __future__ import annotations

from typing import Any

# The small-CNN workload figures, judged against the model's fleet only (no datasheet gives them).
CNN_FIGURES = {
    "cnn_train_images_s": ("small-CNN training", "images/s"),
    "cnn_infer_images_s": ("small-CNN inference", "images/s"),
}
# The platform's own measurement of each GPU (its challenge, timed on the platform's clock), judged against the
# model's fleet: the agent's figures are the node's word, a shim can report an honest card's (found by review).
PLATFORM_FIGURES = {
    "platform_bf16_tflops": ("BF16 of the platform's challenge, timed by the platform", "TFLOP/s"),
}
# The measured figures judged against the datasheet, with their names for people.
FIGURES = {
    "bf16_tflops": ("BF16 matmul", "TFLOP/s"),
    "fp16_tflops": ("FP16 matmul", "TFLOP/s"),
    "tf32_tflops": ("TF32 matmul", "TFLOP/s"),
    "fp32_tflops": ("FP32 matmul", "TFLOP/s"),
    "memory_bandwidth_gbs": ("device memory bandwidth", "GB/s"),
}

TOLERANCES: dict[str, Any] = {  # values of many shapes, each read where its rule is
    # --- identity (nvidia-smi) ---
    # memory.total may differ slightly by driver around the catalogue's size for the card's ECC mode (GDDR6 cards
    # with ECC on give 1/16 of it to ECC: the catalogue holds both sizes; HBM keeps ECC beside the data).
    "memory_min_fraction": 0.99,
    "memory_max_fraction": 1.01,
    # CUDA's total memory / NVML's memory.total on the same card. CUDA leaves out what the driver reserves for
    # itself (PyTorch's out-of-memory messages put it 0-2 % under memory.total, e.g. 79.15 GiB on an 80 GiB A100)
    # and never sees more than the card has: outside this band one of the two answers is faked, or the driver is
    # broken.
    "cuda_memory_min_fraction": 0.95,
    "cuda_memory_max_fraction": 1.005,
    # A card whose power limit is set below this share of its default, or of the model's TDP, is capped.
    "power_limit_min_fraction": 0.95,
    # Under the benchmark's full load a card held back by its power limit (SwPowerCap) draws that limit: the most
    # it drew is the limit really enforced, whatever power.limit says. Honest cards at their cap draw 95-100 % of
    # their TDP; below 90 % the limit in force is lower than the model's (a cap set in firmware, the BMC or hidden
    # by a shim). Above 90 % the loss is a few per cent of throughput: not worth a finding.
    "power_capped_draw_max_fraction": 0.90,
    # --- measured figures / datasheet figure ---
    # Below `degrade`: degraded. Below `reject`: rejected (not the card claimed, or broken). Above `max`: rejected
    # (more than the model can do: a different card or a faked timer). gpus.md: healthy BF16 is 80-87 % on
    # A100/H100, device copies 75-90 %. FP32's floor is 0.65, not 0.75: Ampere/Ada GDDR cards count dual-issue
    # FP32 in their datasheet figure and SGEMM reaches ~0.70-0.78 of it there (the sim profiles use 0.75), so
    # 0.75 would flag healthy RTX A4000/A6000s about half the time. No upper bound on FP16 (some stacks
    # accumulate in FP16 at twice the rate on GeForce cards, whose catalogue figure is the FP32-accumulate one)
    # nor on TF32 (on GeForce cards the catalogue's TF32 equals FP32; tensor-core TF32 may beat it).
    "figure_bands": {
        "bf16_tflops": {"reject": 0.45, "degrade": 0.65, "max": 1.15},
        "fp16_tflops": {"reject": 0.45, "degrade": 0.65, "max": None},
        "tf32_tflops": {"reject": 0.40, "degrade": 0.60, "max": None},
        "fp32_tflops": {"reject": 0.45, "degrade": 0.65, "max": 1.15},
        "memory_bandwidth_gbs": {"reject": 0.50, "degrade": 0.70, "max": 1.05},
    },
    # Figures the catalogue marks as derived (cores x clock, not a datasheet line) get floors this much lower.
    "derived_floor_factor": 0.9,
    # Pinned host<->device GB/s, by the card's PCIe generation (healthy x16: Gen3 ~12, Gen4 24-26, Gen5 ~55).
    "host_link_min_gbs": {3: 9.0, 4: 18.0, 5: 40.0, 6: 80.0},
    # Every GPU within this share of the node's median on these figures (healthy cards differ by up to ~5 %).
    "node_median_max_deviation": 0.10,
    # An NVLink pair's p2p copy below this share of its links' speed (links x GB/s per link, as nvidia-smi reports
    # them) is slow: healthy A100/H100 pairs reach 75-90 % of it; a pair with half its links down about 40 %.
    "nvlink_p2p_min_fraction": 0.6,
    "node_median_figures": ("bf16_tflops", "memory_bandwidth_gbs"),
    # Clock event reasons that mean the card slowed down on its own (SwPowerCap under full load is normal).
    "slowdown_reasons": ("HwSlowdown", "HwThermalSlowdown", "SwThermalSlowdown", "HwPowerBrakeSlowdown"),
    # Median SM clock under load at least this share of the card's maximum SM clock.
    "sm_clock_min_fraction": 0.60,
    # --- fleet references: what the same model measures on the platform's other verified/degraded nodes ---
    # A GPU is below its fleet when a figure falls under median - max(gap x median, mad_k x 1.4826 x MAD) of the
    # nodes' per-node medians (1.4826 x MAD estimates one standard deviation of a normal spread; a fleet that
    # spreads widely widens its own floor instead of flagging honest nodes). Gaps: 10 % for the matmul and
    # bandwidth figures, as the node-median rule (healthy cards differ by up to ~5 % in one node, a run moves a
    # figure by up to ~3 %); 15 % for the small CNN, which is launch-bound: its images/s move with the host CPU and
    # the driver too. A slower card whose name and SM count are faked and whose figures land inside the datasheet
    # bands sits 13-15 % under its fleet. Only with settings.FLEET_REFERENCE_MIN_NODES nodes or more (the
    # selector's rule). bench/verdict_stability.py gives each gap's headroom.
    "fleet_max_gap": {"bf16_tflops": 0.10, "fp16_tflops": 0.10, "tf32_tflops": 0.10, "fp32_tflops": 0.10,
                      "memory_bandwidth_gbs": 0.10, "cnn_train_images_s": 0.15, "cnn_infer_images_s": 0.15,
                      "platform_bf16_tflops": 0.10},
    "fleet_mad_k": 4.0,
    # Relative (Frobenius) error of a matmul against FP64 on the same inputs.
    "matmul_max_rel_error": {"fp32": 1e-3, "bf16": 2e-2},
    # Seconds of the platform's own scheduling and SSH jitter (a busy control plane, a loaded worker) given to the
    # node before "too slow" or "outlier" is judged: ~10 % of the quick target, ~2 % of the full one. "Too fast"
    # is judged on the raw time, so each judgement gives the node the benefit of the doubt.
    "challenge_latency_allowance_s": 0.15,
    # The most round trip taken off a timed answer (verification/round_trip.py): about the longest honest one
    # (Sydney to London over the internet, ~0.3 s). The credit is the least of the agent's pongs, sshd's keepalive
    # reply and the kernel's TCP estimate; this cap bounds what a node that slowed all three could buy.
    "round_trip_credit_max_s": 0.3,
    # The memory proof's fresh root (memproof.py): seconds of the platform's own latency beyond the time the
    # claimed card reads its fill at half its datasheet bandwidth (tens of ms), plus the round trips' spread up to the
    # cap. Not generous: a card that rebuilds the memory it lacks on the card pays passes of its memory, tens of
    # ms each (bench/memproof_recompute.py); a late first answer gets a second fresh salt, so one slow line of a
    # busy control plane is not a verdict.
    "memory_proof_latency_allowance_s": 0.1,
    "memory_proof_jitter_allowance_max_s": 0.15,
    # --- score ---
    # 100 = the reference card at its datasheet: geometric mean of BF16 and bandwidth ratios, per GPU.
    "score_reference": {"name": "A100 80GB SXM datasheet", "bf16_tflops": 312.0, "memory_bandwidth_gbs": 2039.0},
    "score_factor": {"verified": 1.0, "degraded": 0.8, "rejected": 0.0},
}
