"""The acceptance policy: pure functions from (catalogue entry, declared count, agent answers) to findings a
provider can act on, from findings to a verdict, and from measured figures to a score.

Every threshold lives in TOLERANCES, the one reviewed table; no rule hides a literal. Nothing here touches the
database or Django: scripts/gpu-selfcheck and bench/verdict_stability.py use it with the catalogue's JSON file.
"""
from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from provisioning.verification.articles import with_article
from provisioning.verification.pci_ids import NVIDIA_VENDOR_ID, PCI_DEVICE_IDS, parse_device_id, slug_for_device_id

REJECT = "reject"
DEGRADE = "degrade"
CATALOGUE_FILE = Path(__file__).resolve().parents[2] / "marketplace" / "data" / "gpu_models.json"

# The small-CNN workload figures, judged against the model's fleet only (no datasheet gives them).
CNN_FIGURES = {
    "cnn_train_images_s": ("small-CNN training", "images/s"),
    "cnn_infer_images_s": ("small-CNN inference", "images/s"),
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
                      "memory_bandwidth_gbs": 0.10, "cnn_train_images_s": 0.15, "cnn_infer_images_s": 0.15},
    "fleet_mad_k": 4.0,
    # Relative (Frobenius) error of a matmul against FP64 on the same inputs.
    "matmul_max_rel_error": {"fp32": 1e-3, "bf16": 2e-2},
    # The platform's challenge (challenge.py): entries are exact integers; a BF16-rounded output is off by at most
    # 2^-8 of the value (8 significant bits), an FP32 one not at all.
    "challenge_entry_rel_tolerance": 2 ** -8,
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
# Streaming multiprocessors = tensor cores / this, from Ampere on (4 tensor cores per SM).
TENSOR_CORES_PER_SM = {"Ampere": 4, "Ada Lovelace": 4, "Hopper": 4}


@dataclass(frozen=True)
class Finding:
    severity: str  # REJECT or DEGRADE
    code: str
    message: str
    gpu_index: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DeclaredModel:
    """What the catalogue says about the model the provider declared."""

    smi_name: str
    memory_mib: int
    memory_type: str
    pcie_lanes: int
    mig_supported: bool
    slug: str = ""
    name: str = ""
    pcie_gen: int = 0
    datasheet: dict = field(default_factory=dict)  # FIGURES keys -> datasheet value
    derived: frozenset = frozenset()  # FIGURES keys the catalogue marks as derived
    sm_count: int | None = None
    pci_device_ids: tuple = ()
    memory_mib_ecc_off: int = 0  # memory.total with ECC off / on (0: the catalogue does not say; memory_mib then)
    memory_mib_ecc_on: int = 0
    tdp_w: float = 0

    @classmethod
    def from_catalogue(cls, entry: dict) -> DeclaredModel:
        """From a catalogue entry: a GpuModel's fields as a dict (marketplace/data/gpu_models.json)."""
        note = (entry.get("figures_note") or "").upper()
        named = note.split("DERIVED")[0] if "DERIVED" in note else ""
        derived = {k for k in FIGURES if k.split("_")[0].upper() in named}
        if "bf16_tflops" in derived:
            derived.add("fp16_tflops")  # one BF16/FP16 figure in the catalogue
        per_sm = TENSOR_CORES_PER_SM.get(entry.get("architecture", ""))
        return cls(
            smi_name=entry["smi_name"], memory_mib=entry["memory_mib"], memory_type=entry["memory_type"],
            pcie_lanes=entry.get("pcie_lanes", 16), mig_supported=entry.get("mig_max_instances", 0) > 0,
            slug=entry.get("slug", ""), name=entry.get("name", ""), pcie_gen=entry.get("pcie_gen", 0),
            datasheet={"bf16_tflops": entry["bf16_tflops"], "fp16_tflops": entry["bf16_tflops"],
                       "tf32_tflops": entry["tf32_tflops"], "fp32_tflops": entry["fp32_tflops"],
                       "memory_bandwidth_gbs": entry["memory_bandwidth_gbps"]},
            derived=frozenset(derived),
            sm_count=entry["tensor_cores"] // per_sm if per_sm and entry.get("tensor_cores") else None,
            pci_device_ids=PCI_DEVICE_IDS.get(entry.get("slug", ""), ()),
            memory_mib_ecc_off=entry.get("memory_mib_ecc_off") or entry["memory_mib"],
            memory_mib_ecc_on=entry.get("memory_mib_ecc_on") or entry["memory_mib"],
            tdp_w=entry.get("tdp_w") or 0,
        )

    @classmethod
    def from_gpu_model(cls, gpu_model) -> DeclaredModel:
        keys = ("slug", "name", "smi_name", "architecture", "memory_mib", "memory_type", "memory_bandwidth_gbps",
                "fp32_tflops", "tf32_tflops", "bf16_tflops", "figures_note", "pcie_gen", "pcie_lanes",
                "tensor_cores", "mig_max_instances", "memory_mib_ecc_off", "memory_mib_ecc_on", "tdp_w")
        return cls.from_catalogue({k: getattr(gpu_model, k) for k in keys})

    @property
    def label(self) -> str:
        return self.name or self.smi_name

    @property
    def a_label(self) -> str:
        """The label with its article: "an A100 80GB SXM", "an RTX A6000", "a GeForce RTX 4090"."""
        return with_article(self.label)

    def memory_sizes(self, ecc_mode: str | None) -> tuple[int, int]:
        """(least, most) MiB memory.total may be for the card's ECC mode; either size when the mode is unknown."""
        mode = (ecc_mode or "").lower()
        sizes = {"enabled": [self.memory_mib_ecc_on], "disabled": [self.memory_mib_ecc_off]}.get(
            mode, [self.memory_mib_ecc_on, self.memory_mib_ecc_off])
        return min(sizes), max(sizes)

    def memory_said(self) -> str:
        if self.memory_mib_ecc_on == self.memory_mib_ecc_off:
            return f"{self.a_label} has {self.memory_mib_ecc_on} MiB"
        return (f"{self.a_label} has {self.memory_mib_ecc_on} MiB with ECC on and {self.memory_mib_ecc_off} MiB "
                "with ECC off")


def load_catalogue(path: Path = CATALOGUE_FILE) -> dict[str, dict]:
    """The catalogue's entries by slug, read from its JSON file (no database)."""
    return {entry["slug"]: entry for entry in json.loads(Path(path).read_text())["models"]}


# ------------------------------------------------------------------------------------------- identity

def check_identity(declared: DeclaredModel, declared_count: int, gpus: list[dict],
                   mig_gpus: frozenset[int] = frozenset()) -> list[Finding]:
    """Do the GPUs the server reports (nvidia-smi, via `inventory`) match what the provider declared?
    `mig_gpus`: the GPUs declared split into MIG slices (their MIG mode is expected; verification/mig.py)."""
    findings: list[Finding] = []
    if len(gpus) != declared_count:
        findings.append(Finding(REJECT, "gpu_count",
                                f"{declared_count} GPUs were declared but the server reports {len(gpus)}."))
    t = TOLERANCES
    for gpu in gpus:
        i = gpu.get("index")
        name = gpu.get("name") or ""
        if "MIG" in name.split() or ((gpu.get("mig_mode") or "").lower() == "enabled" and i not in mig_gpus):
            findings.append(Finding(REJECT, "mig_enabled",
                                    f"GPU {i} is a MIG slice or has MIG mode on ({name!r}); disable MIG "
                                    "(`nvidia-smi -mig 0`) so renters get the whole GPU, or declare its MIG "
                                    "layout (mig_layout) to rent it per slice.", i))
        if name != declared.smi_name:
            findings.append(Finding(REJECT, "gpu_name",
                                    f"GPU {i} reports {name!r}, not {declared.smi_name!r} as declared.", i))
        findings += _check_memory_size(declared, i, gpu.get("memory_total_mib"), gpu.get("ecc_mode"), "nvidia-smi")
        limit, default = gpu.get("power_limit_w"), gpu.get("power_default_limit_w")
        floor = max(default or 0, declared.tdp_w or 0) * t["power_limit_min_fraction"]
        if limit and limit < floor:
            rated = " and ".join(part for part in (f"its default ({default:g} W)" if default else "",
                                                   f"{declared.a_label}'s TDP ({declared.tdp_w:g} W)"
                                                   if declared.tdp_w else "") if part)
            findings.append(Finding(DEGRADE, "power_capped",
                                    f"GPU {i}'s power limit is {limit:g} W, below {rated}; reset it with "
                                    f"`nvidia-smi -i {i} -pl {max(default or 0, declared.tdp_w or 0):g}`.", i))
        width_max = gpu.get("pcie_link_width_max")
        if width_max and width_max < declared.pcie_lanes:
            findings.append(Finding(DEGRADE, "pcie_width",
                                    f"GPU {i} sits on an x{width_max} PCIe link; it needs x{declared.pcie_lanes} "
                                    "(check the riser or slot).", i))
        findings += _check_pci_id(declared, i, gpu.get("pci_device_id"))
    by_uuid: dict[str, list] = {}
    for gpu in gpus:
        if gpu.get("uuid"):
            by_uuid.setdefault(gpu["uuid"], []).append(gpu.get("index"))
    for uuid, indices in by_uuid.items():
        if len(indices) > 1:
            findings.append(Finding(REJECT, "gpu_uuid_repeated",
                                    f"GPUs {', '.join(map(str, indices))} report the same UUID {uuid}; every GPU "
                                    "has its own (check `nvidia-smi -L` and the driver).", indices[0]))
    return findings


# ---------------------------------------------------------------------------------- one server, one node
# Decided by the platform's records (unique constraints on live nodes), not by the node's answers. The messages
# say what the provider can check on their own server and never name the other node or its provider.

def duplicate_host_key(fingerprint: str) -> Finding:
    return Finding(REJECT, "duplicate_host_key",
                   f"This server's SSH host key ({fingerprint}) belongs to another live node: a server can be "
                   "listed only once. If you registered it before, use that node or retire it, then verify this "
                   "one again. If this server was installed from another machine's image, give it host keys of "
                   "its own (remove /etc/ssh/ssh_host_* and run `ssh-keygen -A`), then verify again.")


def duplicate_gpus(gpus: list[tuple[int, str]]) -> Finding:
    """`gpus`: (index, uuid) of this server's GPUs that another live node holds."""
    which = ", ".join(f"GPU {i} ({uuid})" for i, uuid in gpus) or "Its GPUs"
    return Finding(REJECT, "duplicate_gpu",
                   f"{which} already belong{'s' if len(gpus) == 1 else ''} to another live node: a GPU can be "
                   "listed by one node only. If you registered this server before, use that node or retire it, "
                   "then verify this one again; if the cards came from another server of yours, verify or "
                   "retire that one first.", gpus[0][0] if gpus else None)


def _check_memory_size(declared: DeclaredModel, i, memory, ecc_mode: str | None, source: str) -> list[Finding]:
    """memory.total (or CUDA's total) against the catalogue's size for the card's ECC mode."""
    t = TOLERANCES
    least, most = declared.memory_sizes(ecc_mode)
    ecc = {"enabled": " with ECC on", "disabled": " with ECC off"}.get((ecc_mode or "").lower(), "")
    said = f"GPU {i} has {memory} MiB of memory{ecc} according to {source}; {declared.memory_said()}"
    if memory is None or memory < t["memory_min_fraction"] * least:
        return [Finding(REJECT, "gpu_memory", f"{said}. It is not the card declared, or part of its memory is "
                                              "taken (a MIG slice, a vGPU profile): declare the model it is.", i)]
    if memory > t["memory_max_fraction"] * most:
        return [Finding(REJECT, "memory_larger_than_model",
                        f"{said}: more than that model has. Either it is another card (declare that one) or its "
                        "driver reports a faked size (reinstall NVIDIA's own driver, without shims).", i)]
    return []


def _check_pci_id(declared: DeclaredModel, i, raw) -> list[Finding]:
    """Only a PCI id known to belong to *another* model rejects; an id this table does not know says nothing."""
    parsed = parse_device_id(raw)
    if parsed is None or not declared.pci_device_ids:
        return []
    device, vendor = parsed
    other = slug_for_device_id(device)
    if vendor != NVIDIA_VENDOR_ID or (other and device not in declared.pci_device_ids):
        what = f"belongs to {other}" if other else f"has vendor 0x{vendor:04x}, not NVIDIA"
        return [Finding(REJECT, "pci_device_id",
                        f"GPU {i}'s PCI device id 0x{device:04x} {what}, not to {declared.a_label} "
                        f"({', '.join(f'0x{d:04x}' for d in declared.pci_device_ids)}).", i)]
    return []


# ---------------------------------------------------------------------------------------- performance

def check_performance(declared: DeclaredModel, bench: dict, inventory_gpus: Sequence[dict] = (),
                      fleet: FleetReference | None = None) -> list[Finding]:
    """Judge the `benchmark` answer: memory and power against nvidia-smi and the catalogue, figures against the
    datasheet, link, clocks, results, the node's median and (when given) the model's fleet reference."""
    findings: list[Finding] = []
    gpus = bench.get("gpus") or []
    smi = {g.get("index"): g for g in inventory_gpus}
    for gpu in gpus:
        seen = smi.get(gpu["index"]) or {}
        if bench.get("device", "cuda") == "cuda":
            findings += _check_cuda_identity(declared, gpu, seen.get("name"))
            findings += _check_cuda_memory(declared, gpu, seen)
            findings += _check_power(declared, gpu, seen)
        findings += _check_figures(declared, gpu)
        findings += _check_link(declared, gpu)
        findings += _check_clocks(gpu)
        findings += _check_results(gpu)
    findings += _check_node_median(gpus)
    if fleet is not None and bench.get("device", "cuda") == "cuda":
        findings += check_fleet(declared, gpus, fleet)
    return findings


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
    found = _check_memory_size(declared, i, cuda, smi.get("ecc_mode"), "CUDA")
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


def _check_figures(declared: DeclaredModel, gpu: dict) -> list[Finding]:
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


def _check_results(gpu: dict) -> list[Finding]:
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
    """What a model's other verified/degraded nodes measured (each node's per-GPU median, latest run): per figure,
    the median over the nodes and the median absolute deviation. The service builds it (provisioning.selectors)."""

    nodes: int
    median: dict = field(default_factory=dict)  # figure -> median over the nodes
    mad: dict = field(default_factory=dict)  # figure -> median absolute deviation over the nodes

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
                label, unit = FIGURES.get(key) or CNN_FIGURES[key]
                below.append(f"{label} {value:,.4g} {unit}, {1 - value / fleet.median[key]:.0%} under the fleet's "
                             f"{fleet.median[key]:,.4g}")
        if below:
            found.append(Finding(DEGRADE, "below_fleet_median",
                                 f"GPU {i} measures clearly less than the {fleet.nodes} other {declared.label} nodes "
                                 f"on this platform: {'; '.join(below)}. Check its cooling, clocks and power limit; "
                                 "if it is another card than declared (its name and SM count faked), declare the "
                                 "model it is.", i))
    return found


# ---------------------------------------------------------------------------------------- verdict, score

# ------------------------------------------------------------------------------------------ the interconnect

def _is_nvlink(link: str) -> bool:
    return link.startswith("NV")


def nvlink_summary(topology: dict | None, p2p: Sequence[dict] | None) -> dict:
    """What offers show of the interconnect: NVLink-connected or not, its islands, the fewest active links of a GPU
    in an island, and the measured p2p GB/s (median over NVLink pairs; else over all pairs measured)."""
    topology, p2p = topology or {}, list(p2p or [])
    islands = topology.get("nvlink_islands") or []
    in_island = {g for island in islands for g in island}
    links = [g.get("links_active") or 0 for g in topology.get("gpus") or [] if g.get("index") in in_island]
    kind = {(p["a"], p["b"]): p["link"] for p in topology.get("pairs") or []}
    nvlink_pairs = [p["gbs"] for p in p2p if p.get("gbs") and _is_nvlink(kind.get((p["a"], p["b"]), ""))]
    other_pairs = [p["gbs"] for p in p2p if p.get("gbs") and not _is_nvlink(kind.get((p["a"], p["b"]), ""))]
    measured = nvlink_pairs or other_pairs
    return {"connected": bool(islands), "islands": islands, "links_per_gpu": min(links) if links else None,
            "p2p_gbs": round(statistics.median(measured), 1) if measured else None,
            "pcie_p2p_gbs": round(statistics.median(other_pairs), 1) if other_pairs else None}


def check_topology(nvlink_declared: bool, gpu_count: int, topology: dict | None,
                   p2p: Sequence[dict] | None) -> list[Finding]:
    """NVLink declared but absent; links down; NVLink pairs whose p2p copies are slow for their links."""
    if gpu_count < 2:
        return []
    topology, found = topology or {}, []
    if nvlink_declared and not topology.get("nvlink_islands"):
        found.append(Finding(DEGRADE, "nvlink_absent",
                             "The node is declared NVLink-connected, but nvidia-smi (`topo -m`) shows no NVLink "
                             "between its GPUs. Fix the bridges or board, or declare it without NVLink."))
    speeds = {g["index"]: g for g in topology.get("gpus") or []}
    for gpu in speeds.values():
        total, active = gpu.get("links_total") or 0, gpu.get("links_active") or 0
        if total and active < total:
            found.append(Finding(DEGRADE, "nvlink_degraded",
                                 f"GPU {gpu['index']} has {active} of its {total} NVLink links active "
                                 f"(`nvidia-smi nvlink -s -i {gpu['index']}`): reseat the card or check the board.",
                                 gpu["index"]))
    kind = {(p["a"], p["b"]): p["link"] for p in topology.get("pairs") or []}
    for pair in p2p or []:
        a, b, gbs = pair.get("a"), pair.get("b"), pair.get("gbs")
        if not gbs or not _is_nvlink(kind.get((a, b), "")):
            continue
        total = min((speeds.get(i) or {}).get("links_total") or 0 for i in (a, b))
        per_link = max((speeds.get(i) or {}).get("link_gbs") or 0.0 for i in (a, b))
        expected = total * per_link
        if expected and gbs < TOLERANCES["nvlink_p2p_min_fraction"] * expected:
            weaker = min((a, b), key=lambda i: (speeds.get(i) or {}).get("links_active") or 0)  # the likely culprit
            found.append(Finding(DEGRADE, "nvlink_p2p_slow",
                                 f"GPUs {a} and {b} copy peer to peer at {gbs:g} GB/s over NVLink, "
                                 f"{gbs / expected:.0%} of their {total} links' {expected:g} GB/s.", weaker))
    return found


def verdict_for(findings: list[Finding]) -> str:
    if any(f.severity == REJECT for f in findings):
        return "rejected"
    if findings:
        return "degraded"
    return "verified"


def gpu_score(gpu: dict) -> float | None:
    """100 x geometric mean of (BF16, bandwidth) / the reference card's datasheet, for one GPU."""
    ref = TOLERANCES["score_reference"]
    bf16, bandwidth = gpu.get("bf16_tflops"), gpu.get("memory_bandwidth_gbs")
    if not bf16 or not bandwidth:
        return None
    return 100 * math.sqrt(bf16 / ref["bf16_tflops"] * bandwidth / ref["memory_bandwidth_gbs"])


def node_score(gpus: list[dict], verdict: str) -> float | None:
    """The node's score per GPU (offers are priced per GPU-hour): the mean GPU score, lowered for a degraded
    node, 0 for a rejected one. None when no GPU was measured."""
    scores = [s for s in map(gpu_score, gpus) if s is not None]
    if not scores:
        return None
    return round(statistics.fmean(scores) * TOLERANCES["score_factor"][verdict], 2)


def _dedupe(findings: list[Finding]) -> list[Finding]:
    seen, kept = set(), []
    for f in findings:
        if (f.code, f.gpu_index) not in seen:
            seen.add((f.code, f.gpu_index))
            kept.append(f)
    return kept


@dataclass(frozen=True)
class MigJudgement:
    """The MIG part of a check (verification/mig.py): findings, the slices judged, the GPUs declared split, and
    the slices' figures as whole-card equivalents for the score."""

    findings: Sequence[Finding] = ()
    slices: Sequence[dict] = ()
    gpus: frozenset[int] = frozenset()
    card_figures: Sequence[dict] = ()


@dataclass
class Judgement:
    verdict: str
    findings: list[Finding]
    score: float | None
    figures: dict


# Throughput per watt: the BF16 matmul figure over the most the card drew under that load (the telemetry's
# maximum while loaded, so the figure errs low, never high). Only on CUDA runs: a CPU run has no GPU power.
PER_WATT_FIGURES = ("power_draw_w", "bf16_tflops_per_w")


def per_watt(gpu: dict) -> dict:
    """A GPU's power under load and its BF16 TFLOP/s per watt (None where either was not measured)."""
    draw = (gpu.get("telemetry") or {}).get("power_draw_w")
    tflops = gpu.get("bf16_tflops")
    draw = draw if isinstance(draw, int | float) and draw > 0 else None
    return {"power_draw_w": draw,
            "bf16_tflops_per_w": round(tflops / draw, 5) if draw and isinstance(tflops, int | float) else None}


def summarize(declared: DeclaredModel, bench: dict) -> dict:
    """What a verification run keeps of the benchmark: per GPU figures, their share of the datasheet, a score."""
    keep = ("index", "uuid", "name", "sm_count", *FIGURES, "h2d_gbs", "d2h_gbs", "cnn_train_images_s",
            "cnn_infer_images_s", "matmul_rel_error", "matmul_shapes_tflops", "telemetry")
    gpus = []
    for gpu in bench.get("gpus") or []:
        row = {k: gpu.get(k) for k in keep}
        row["of_datasheet"] = {k: round(gpu[k] / declared.datasheet[k], 3) for k in FIGURES
                               if gpu.get(k) and declared.datasheet.get(k)}
        score = gpu_score(gpu)
        row["score"] = round(score, 2) if score is not None else None
        if bench.get("device", "cuda") == "cuda":
            row.update(per_watt(gpu))
        gpus.append(row)
    medians = {}
    for key in (*FIGURES, "h2d_gbs", "d2h_gbs", "cnn_train_images_s", "cnn_infer_images_s", *PER_WATT_FIGURES):
        values = [g[key] for g in gpus if g.get(key) is not None]
        places = 5 if key == "bf16_tflops_per_w" else 3  # ~0.5-2 TFLOP/s per W: 3 places would be 3 digits
        medians[key] = round(statistics.median(values), places) if values else None
    head = {k: bench.get(k) for k in ("mode", "device", "quick", "duration_s", "time_limit_s", "torch_version",
                                      "cuda_runtime", "agent_version")}
    return {**head, "datasheet": dict(declared.datasheet), "score_reference": TOLERANCES["score_reference"]["name"],
            "median": medians, "gpus": gpus}


def judge(declared: DeclaredModel, declared_count: int, inventory_gpus: list[dict], bench: dict | None,
          bench_error: str = "", fleet: FleetReference | None = None,
          challenge: Sequence[Finding] = (), topology: dict | None = None,
          nvlink_declared: bool = False, mig: MigJudgement | None = None) -> Judgement:
    """The whole policy: identity, then the benchmark's figures (when there are any) against the datasheet and,
    when the model has one, its fleet reference; with the platform's own challenge findings (challenge.judge);
    verdict and score."""
    mig = mig or MigJudgement()
    findings = check_identity(declared, declared_count, inventory_gpus, mig.gpus)
    if bench is not None:
        findings += check_performance(declared, bench, inventory_gpus, fleet)
    findings += list(challenge)
    findings += list(mig.findings)
    p2p = (bench or {}).get("p2p")
    findings += check_topology(nvlink_declared, declared_count, topology, p2p)
    if bench_error:
        findings.append(Finding(REJECT, "benchmark_unavailable", f"The benchmark could not run: {bench_error}"))
    findings = _dedupe(findings)
    verdict = verdict_for(findings)
    figures = summarize(declared, bench) if bench is not None else {}
    if figures and fleet is not None:  # what this node was compared with, kept with its figures
        figures["fleet"] = {"nodes": fleet.nodes, "median": {k: round(v, 3) for k, v in fleet.median.items()}}
    if figures and (topology or p2p):
        figures["p2p"] = list(p2p or [])
        figures["nvlink"] = nvlink_summary(topology, p2p)
    if figures and mig.slices:
        figures["mig_slices"] = [dict(s) for s in mig.slices]
    score = node_score([*(bench.get("gpus") or []), *mig.card_figures], verdict) if bench is not None else None
    return Judgement(verdict, findings, score, figures)
