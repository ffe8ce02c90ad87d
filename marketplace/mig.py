"""MIG (Multi-Instance GPU) profiles of the catalogue and the platform's placement rule. Pure: no database.

The profiles live in marketplace/data/mig_profiles.json next to the GPU catalogue. The placement rule is
deliberately simpler than the driver's (which also fixes where on the card each instance starts): per card, the
profiles' compute slices add up to at most 7 and their memory slices to at most 8. A layout the rule accepts but
the driver cannot place is caught by the check, which compares the layout nvidia-smi shows with the declaration.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

PROFILES_FILE = Path(__file__).resolve().parent / "data" / "mig_profiles.json"
COMPUTE_SLICES_PER_CARD = 7
MEMORY_SLICES_PER_CARD = 8


@dataclass(frozen=True)
class MigProfile:
    name: str  # as nvidia-smi prints it: "3g.40gb"
    compute_slices: int  # of COMPUTE_SLICES_PER_CARD
    memory_slices: int  # of MEMORY_SLICES_PER_CARD
    memory_gb: int  # nominal, from the name

    @property
    def compute_fraction(self) -> float:
        return self.compute_slices / COMPUTE_SLICES_PER_CARD

    @property
    def memory_fraction(self) -> float:
        return self.memory_slices / MEMORY_SLICES_PER_CARD

    def memory_mib(self, card_memory_mib: int) -> int:
        """The slice's share of the card's memory.total (derived: memory slices / 8 of the card)."""
        return card_memory_mib * self.memory_slices // MEMORY_SLICES_PER_CARD

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "compute_slices": self.compute_slices, "memory_slices": self.memory_slices,
                "memory_gb": self.memory_gb, "compute_fraction": round(self.compute_fraction, 4),
                "memory_fraction": self.memory_fraction}


@cache
def _catalogue() -> dict[str, dict[str, MigProfile]]:
    data = json.loads(PROFILES_FILE.read_text())
    return {slug: {p["name"]: MigProfile(p["name"], p["compute_slices"], p["memory_slices"], p["memory_gb"])
                   for p in rows} for slug, rows in data["models"].items()}


def profiles_for(slug: str) -> dict[str, MigProfile]:
    """The MIG profiles of a catalogue model by name ({} for a model without MIG)."""
    return dict(_catalogue().get(slug, {}))


def all_profile_names() -> list[str]:
    return sorted({name for profiles in _catalogue().values() for name in profiles})


def layout_by_gpu(layout: list[dict[str, Any]] | None) -> dict[int, list[str]]:
    """A declared layout ([{"gpu": 0, "profiles": [...]}]) as {gpu index: [profile names]}."""
    return {int(entry["gpu"]): list(entry["profiles"]) for entry in layout or []}


def layout_problems(slug: str, gpu_count: int, layout: Any) -> str | None:
    """Why a declared MIG layout cannot be accepted for `gpu_count` cards of model `slug` (None: it can).

    The message names the entry at fault, for the API's 400 on `mig_layout`."""
    if layout in (None, []):
        return None
    profiles = profiles_for(slug)
    if not profiles:
        return f"The {slug} has no MIG: declare no mig_layout for it."
    if not isinstance(layout, list):
        return 'mig_layout must be a list of {"gpu": <index>, "profiles": [<profile>, ...]}.'
    seen: set[int] = set()
    for n, entry in enumerate(layout):
        if not isinstance(entry, dict) or set(entry) != {"gpu", "profiles"}:
            return f'mig_layout[{n}] must be {{"gpu": <index>, "profiles": [<profile>, ...]}} and nothing else.'
        gpu, names = entry["gpu"], entry["profiles"]
        if type(gpu) is not int or not 0 <= gpu < gpu_count:
            return f"mig_layout[{n}].gpu must be a GPU index of this node, 0 to {gpu_count - 1}."
        if gpu in seen:
            return f"mig_layout[{n}]: GPU {gpu} is given twice."
        seen.add(gpu)
        if not isinstance(names, list) or not names or not all(isinstance(p, str) for p in names):
            return f"mig_layout[{n}].profiles must be a non-empty list of profile names."
        unknown = [p for p in names if p not in profiles]
        if unknown:
            return (f"mig_layout[{n}]: {unknown[0]!r} is not a MIG profile of the {slug}; it has "
                    f"{', '.join(profiles)} (/api/v1/gpu-models/).")
        compute = sum(profiles[p].compute_slices for p in names)
        memory = sum(profiles[p].memory_slices for p in names)
        if compute > COMPUTE_SLICES_PER_CARD or memory > MEMORY_SLICES_PER_CARD:
            return (f"mig_layout[{n}] overfills GPU {gpu}: its profiles take {compute} compute slices of "
                    f"{COMPUTE_SLICES_PER_CARD} and {memory} memory slices of {MEMORY_SLICES_PER_CARD}.")
    return None


def price_problems(layout: list[dict[str, Any]] | None, prices: dict[str, int]) -> str | None:
    """Every profile of the layout needs a price per slice-hour; a price for a profile not in it is refused."""
    used = {p for entry in layout or [] for p in entry["profiles"]}
    missing = sorted(used - set(prices))
    if missing:
        return f"Give a price per slice-hour for {', '.join(missing)} (mig_prices)."
    extra = sorted(set(prices) - used)
    if extra:
        return f"mig_prices names {', '.join(extra)}, which mig_layout does not use."
    return None
