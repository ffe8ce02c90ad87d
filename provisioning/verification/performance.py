"""The benchmark's figures judged: memory and power against nvidia-smi and the catalogue, throughput against
the datasheet, the host link, clocks, correctness, the node's own median and the model's fleet (FleetReference).
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from provisioning.verification.identity import check_memory_size
from provisioning.verification.model import DEGRADE, REJECT, DeclaredModel, Finding
from provisioning.verification.tolerances import CNN_FIGURES, FIGURES, PLATFORM_FIGURES, TOLERANCES


def check_performance(declared: DeclaredModel, bench: dict, inventory_gpus: Sequence[dict] = (),
                      fleet: FleetReference | None = None) -> list[Finding]:
    """Judge the `benchmark` answer: memory and power against nvidia-smi and the catalogue, figures against the
    datasheet, link, clocks, results, the node's median and (when given) the model's fleet reference."""
    findings: list[Finding] = []
    gpus = bench.get("gpus") or []
    smi = {g.get("index"): g for g in inventory_gpus}
    for gpu in gpus:
        seen = smi.get(gpu["index"]) or {}
        if on_gpu(bench):
            findings += _check_cuda_identity(declared, gpu, seen.get("name"))
            findings += _check_cuda_memory(declared, gpu, seen)
            findings += _check_power(declared, gpu, seen)
        findings += check_figures(declared, gpu)
        findings += _check_link(declared, gpu)
        findings += _check_clocks(gpu)
        findings += check_results(gpu)
    findings += _check_node_median(gpus)
    if fleet is not None and on_gpu(bench):
        findings += check_fleet(declared, gpus, fleet)
    return findings


def on_gpu(bench: dict) -> bool:
    """Whether the answer is judged as measured on GPUs: all but one that says "cpu" (gpu-selfcheck --device cpu,
    figures only). The verification refuses any device but the one it asked for (answers.benchmark_problems)."""
    return bench.get("device") != "cpu"


def _check_cuda_identity(declared: DeclaredModel, gpu: dict, smi_name: str | None) -> list[Finding]:
    # CUDA asks the driver, not NVML: a shim that renames the card for nvidia-smi/NVML does not reach it.
    i, found = gpu["index"], []
    cuda_name = (gpu.get("name") or "").strip()
    if cuda_name and smi_name and cuda_name.lower() != smi_name.strip().lower():
        found.append(Finding(REJECT, "cuda_name", f"GPU {i} is {cuda_name!r} to CUDA but {smi_name!r} to "
                                                  "nvidia-smi: its name is faked.", i))
    sms = gpu.get("sm_count")
    if sms is not None and declared.sm_count and sms != declared.sm_count:
        found.append(Finding(REJECT, "sm_count", f"GPU {i} has {sms} streaming multiprocessors; {declared.a_label} "
                                                 f"has {declared.sm_count}.", i))
    return found


def _check_cuda_memory(declared: DeclaredModel, gpu: dict, smi: dict) -> list[Finding]:
    """CUDA's total memory against NVML's memory.total and the catalogue. A shim rarely fakes both the same way;
    one that does (a 40 GB card shown as 80 GB everywhere) is left to the memory proof, which fills the memory."""
    i, cuda = gpu["index"], gpu.get("memory_mib")
    if cuda is None:
        return []
    found = check_memory_size(declared, i, cuda, smi.get("ecc_mode"), "CUDA")
    found = [f for f in found if f.code == "memory_larger_than_model"]  # CUDA's share below NVML's is normal
    nvml = smi.get("memory_total_mib")
    t = TOLERANCES
    if nvml and not (t["cuda_memory_min_fraction"] * nvml <= cuda <= t["cuda_memory_max_fraction"] * nvml):
        found.append(Finding(REJECT, "memory_mismatch_cuda_nvml",
                             f"GPU {i} has {cuda} MiB of memory according to CUDA but {nvml} MiB according to "
                             f"nvidia-smi (NVML); on a sound driver CUDA sees {t['cuda_memory_min_fraction']:.0%}-100 "
                             "% of it. One of them is faked or the driver is broken: reinstall NVIDIA's own driver "
                             "(no NVML or CUDA shims), check that `nvidia-smi` and `torch.cuda.mem_get_info()` agree, "
                             "then verify again.", i))
    return found


def _check_power(declared: DeclaredModel, gpu: dict, smi: dict) -> list[Finding]:
    """The power the card drew under full load, with SwPowerCap set, is the limit really in force."""
    i, tele = gpu["index"], gpu.get("telemetry") or {}
    draw, tdp = tele.get("power_draw_w"), declared.tdp_w
    if not draw or not tdp or "SwPowerCap" not in (tele.get("clocks_event_reasons") or []):
        return []
    if draw >= TOLERANCES["power_capped_draw_max_fraction"] * tdp:
        return []
    limit = smi.get("power_limit_w")
    reported = (f" although it reports a power limit of {limit:g} W: the limit in force is not the one reported"
                if limit and limit >= TOLERANCES["power_capped_draw_max_fraction"] * tdp else "")
    return [Finding(DEGRADE, "power_capped",
                    f"GPU {i} drew at most {draw:g} W under full load while held back by its power limit "
                    f"(SwPowerCap), {draw / tdp:.0%} of the {tdp:g} W {declared.a_label} is rated for{reported}. "
                    f"Set its limit to {tdp:g} W (`nvidia-smi -i {i} -pl {tdp:g}`) and check the power cap in the "
                    "BMC or firmware and the power supply.", i)]


def check_figures(declared: DeclaredModel, gpu: dict) -> list[Finding]:
    i, found = gpu["index"], []
    for key, (label, unit) in FIGURES.items():
        sheet, value = declared.datasheet.get(key), gpu.get(key)
        if not sheet:
            continue
        if value is None:
            found.append(Finding(REJECT, "benchmark_incomplete", f"GPU {i}: the benchmark gave no {label} figure.", i))
            continue
        band = TOLERANCES["figure_bands"][key]
        slack = TOLERANCES["derived_floor_factor"] if key in declared.derived else 1.0
        ratio, code = value / sheet, key.rsplit("_", 1)[0]
        said = (f"GPU {i} reaches {value:,.4g} {unit} in {label}, {ratio:.0%} of the {sheet:,.4g} "
                f"{declared.a_label} is rated for")
        if band["max"] is not None and ratio > band["max"]:
            found.append(Finding(REJECT, f"{code}_too_high", f"{said}: more than that model can do (at most "
                                 f"{band['max']:.0%}). Declare the model the server really has.", i))
        elif ratio < band["reject"] * slack:
            found.append(Finding(REJECT, f"{code}_low", f"{said} (at least {band['degrade'] * slack:.0%} expected): "
                                 "it is not the card it claims to be, or it is badly broken.", i))
        elif ratio < band["degrade"] * slack:
            found.append(Finding(DEGRADE, f"{code}_low", f"{said} (at least {band['degrade'] * slack:.0%} "
                                 "expected). Check its cooling, power limit and clocks.", i))
    return found


def _check_link(declared: DeclaredModel, gpu: dict) -> list[Finding]:
    i, found = gpu["index"], []
    tele = gpu.get("telemetry") or {}
    width, gen = tele.get("pcie_link_width"), tele.get("pcie_link_gen")
    if width and width < declared.pcie_lanes:
        found.append(Finding(DEGRADE, "pcie_width", f"GPU {i}'s PCIe link runs at x{width:g} under load, not "
                                                    f"x{declared.pcie_lanes}: check the riser or slot.", i))
    minimum = TOLERANCES["host_link_min_gbs"].get(declared.pcie_gen)
    links = [v for v in (gpu.get("h2d_gbs"), gpu.get("d2h_gbs")) if v is not None]
    if minimum and links and min(links) < minimum:
        seen = f" The link ran at Gen{gen:g} x{width:g}." if gen and width else ""
        found.append(Finding(DEGRADE, "host_link_slow",
                             f"GPU {i} moves {min(links):.1f} GB/s between host and GPU (pinned memory); a PCIe "
                             f"Gen{declared.pcie_gen} x{declared.pcie_lanes} link gives at least {minimum:g}.{seen} "
                             "Seat it in a full-speed x16 slot, without a riser.", i))
    return found


def _check_clocks(gpu: dict) -> list[Finding]:
    i, found = gpu["index"], []
    tele = gpu.get("telemetry") or {}
    slowed = [r for r in tele.get("clocks_event_reasons") or [] if r in TOLERANCES["slowdown_reasons"]]
    if slowed:
        temp = f", up to {tele['temperature_c']:g} °C" if tele.get("temperature_c") is not None else ""
        found.append(Finding(DEGRADE, "clock_slowdown",
                             f"GPU {i} slowed its clocks under load ({', '.join(slowed)}{temp}): improve its "
                             "cooling (airflow, fans, thermal paste) and check its power cables.", i))
    clock, top = tele.get("sm_clock_mhz"), tele.get("sm_clock_max_mhz")
    if clock and top and clock < TOLERANCES["sm_clock_min_fraction"] * top:
        found.append(Finding(DEGRADE, "low_clock", f"GPU {i} ran at {clock:g} MHz under load, {clock / top:.0%} of "
                                                   f"its {top:g} MHz maximum: check power limit and cooling.", i))
    return found


def check_results(gpu: dict) -> list[Finding]:
    i = gpu["index"]
    errors = gpu.get("matmul_rel_error") or {}
    for dtype, limit in TOLERANCES["matmul_max_rel_error"].items():
        err = errors.get(dtype)
        if err is None or err > limit:
            what = "no finite result" if err is None else f"a relative error of {err:.3g}"
            return [Finding(REJECT, "wrong_results",
                            f"GPU {i} computed wrong matrix products: {what} in {dtype.upper()} against an FP64 "
                            f"reference (at most {limit:g} expected). The card is faulty: take it out of service.", i)]
    return []


def _check_node_median(gpus: list[dict]) -> list[Finding]:
    found: dict[int, list[str]] = {}
    limit = TOLERANCES["node_median_max_deviation"]
    for key in TOLERANCES["node_median_figures"]:
        values = {g["index"]: g[key] for g in gpus if g.get(key)}
        if len(values) < 2:
            continue
        median = statistics.median(values.values())
        for i, value in values.items():
            if value < (1 - limit) * median:
                label, unit = FIGURES[key]
                found.setdefault(i, []).append(f"{label} {1 - value / median:.0%} below "
                                               f"({value:,.4g} vs {median:,.4g} {unit})")
    return [Finding(DEGRADE, "gpu_outlier", f"GPU {i} is slower than the node's other GPUs: "
                    f"{'; '.join(what)}, more than {limit:.0%} below the median. Check its cooling, slot and power "
                    "cables, or replace it.", i) for i, what in sorted(found.items())]


# ------------------------------------------------------------------------------------------ the fleet

@dataclass(frozen=True)
class FleetReference:
    """What a model's other verified nodes measured (each node's per-GPU median, latest run): per figure, the
    median over the nodes (over providers, each its own nodes' median: provisioning.selectors builds it) and the
    median absolute deviation."""

    nodes: int
    median: dict = field(default_factory=dict)  # figure -> median over the nodes (or providers)
    mad: dict = field(default_factory=dict)  # figure -> median absolute deviation over them
    providers: int | None = None  # how many providers' nodes (None: built from nodes alone, as the sim's profiles)

    @classmethod
    def from_node_medians(cls, node_medians: Sequence[dict]) -> FleetReference:
        """From each node's per-GPU medians ({figure: value}); a figure no node measured is left out."""
        median, mad = {}, {}
        for key in TOLERANCES["fleet_max_gap"]:
            values = [m[key] for m in node_medians if m.get(key)]
            if values:
                median[key] = statistics.median(values)
                mad[key] = statistics.median(abs(v - median[key]) for v in values)
        return cls(nodes=len(node_medians), median=median, mad=mad)

    def floor(self, key: str) -> float | None:
        """The value under which a GPU is clearly below its fleet on this figure."""
        median = self.median.get(key)
        if not median:
            return None
        t = TOLERANCES
        return median - max(t["fleet_max_gap"][key] * median, t["fleet_mad_k"] * 1.4826 * self.mad.get(key, 0.0))


def check_fleet(declared: DeclaredModel, gpus: Sequence[dict], fleet: FleetReference) -> list[Finding]:
    """Each GPU against what the same model measures across the platform's fleet."""
    found = []
    for gpu in gpus:
        i, below = gpu["index"], []
        for key in TOLERANCES["fleet_max_gap"]:
            floor, value = fleet.floor(key), gpu.get(key)
            if floor is not None and value is not None and value < floor:
                label, unit = FIGURES.get(key) or CNN_FIGURES.get(key) or PLATFORM_FIGURES[key]
                below.append(f"{label} {value:,.4g} {unit}, {1 - value / fleet.median[key]:.0%} under the fleet's "
                             f"{fleet.median[key]:,.4g}")
        if below:
            found.append(Finding(DEGRADE, "below_fleet_median",
                                 f"GPU {i} measures clearly less than the {fleet.nodes} other {declared.label} nodes "
                                 f"on this platform: {'; '.join(below)}. Check its cooling, clocks and power limit; "
                                 "if it is another card than declared (its name and SM count faked), declare the "
                                 "model it is.", i))
    return found
