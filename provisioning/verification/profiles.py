"""Judge a sim profile without a node or a database: its nvidia-smi lines as the inventory, one noisy draw of its
`performance` as the benchmark, its `declared` model from the catalogue's JSON. For tests and
bench/verdict_stability.py; the platform judges real answers that came over SSH."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from provisioning.agent import gpumarket_agent as agent
from provisioning.verification.policy import DeclaredModel, Judgement, judge, load_catalogue

PROFILES_DIR = Path(agent.__file__).resolve().parents[1] / "profiles"  # beside the agent package


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def profile_expectation(name: str) -> dict:
    """{"verdict": ..., "findings": [codes that must be among the findings]} as the profile states it."""
    return json.loads((PROFILES_DIR / f"{name}.json").read_text())["expect"]


def judge_profile(name: str, catalogue: dict | None = None, quick: bool = True) -> Judgement:
    path = PROFILES_DIR / f"{name}.json"
    profile, gpus = agent.load_profile(str(path))
    declared = profile["declared"]
    entry = (catalogue or load_catalogue())[declared["gpu_model"]]
    bench = agent.sim_benchmark(SimpleNamespace(sim_profile=str(path)), quick, None)
    return judge(DeclaredModel.from_catalogue(entry), declared["gpu_count"], gpus, bench)
