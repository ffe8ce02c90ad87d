"""What a check is judged against: the declared model from the catalogue (DeclaredModel), and what a rule finds
(Finding, REJECT or DEGRADE). Nothing here touches the database or Django: scripts/gpu-selfcheck and the benches
read the catalogue's JSON file.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from provisioning.verification.articles import with_article
from provisioning.verification.pci_ids import PCI_DEVICE_IDS
from provisioning.verification.tolerances import FIGURES

REJECT = "reject"
DEGRADE = "degrade"
CATALOGUE_FILE = Path(__file__).resolve().parents[2] / "marketplace" / "data" / "gpu_models.json"
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
