"""The platform's challenge and memory proof per MIG slice: the node's own slice figures (bench_slices) can be
faked by a provider who controls the driver; this is work the platform chooses and times itself, as for a whole
GPU (challenge.py, memproof.py).

Slices of one profile are challenged together in one exchange; the claimed rate is the profile's compute share
(g/7) of the card's datasheet (mig.slice_model), so the expected time and the bands are a slice's. A slice is named
in the challenge by a label (challenge.MIG_LABEL_BASE + its position in `mig_uuids`) that also keys its matrices;
the agent maps the label to the MIG device it validated. The memory proof fills 95 % of the profile's share of
the card's memory (memory slices / 8) and times the re-read at that share of its bandwidth. A finding names the
slice (codes mig_slice_challenge_*, mig_slice_memory_proof_*), and a slice with a rejecting finding is not proven
(mig.check_mig then leaves it unlisted).

Pure: no Django, no SSH.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from marketplace.mig import MigProfile, profiles_for

from . import memproof, memproof_verdict
from .challenge import MIG_LABEL_BASE, Challenge, Outcome, draw
from .challenge_verdict import judge
from .mig import slice_model
from .model import REJECT, DeclaredModel, Finding


@dataclass(frozen=True)
class SliceChallenge:
    """One exchange: the slices of one profile, by label."""

    profile: MigProfile
    model: DeclaredModel  # the declared card scaled to one slice of the profile
    challenge: Challenge
    devices: dict  # label -> the slice as the inventory lists it ({"gpu", "device", "profile", "uuid"})
    proof: memproof.MemProof | None = None  # the memory proof of the same slices


def slice_groups(devices: Sequence[dict], uuids: Sequence[str]) -> dict[str, list[dict]]:
    """The slices to challenge (`uuids`, in the inventory's order), by profile name."""
    wanted = set(uuids)
    groups: dict[str, list[dict]] = {}
    for dev in devices:
        if dev.get("uuid") in wanted:
            groups.setdefault(dev["profile"], []).append(dev)
    return groups


def draw_slices(declared: DeclaredModel, devices: Sequence[dict], uuids: Sequence[str], quick: bool,
                card_memory_mib: int | None = None, rng: random.Random | None = None,
                real_work: bool = False) -> list[SliceChallenge]:
    """One challenge per profile among the slices named, or with `real_work` one per slice (a real node's agent
    runs each in a child process that sees only that slice); a profile the catalogue does not know is skipped
    (the layout check already rejects it)."""
    profiles = profiles_for(declared.slug)
    out = []
    groups = sorted(slice_groups(devices, uuids).items())
    if real_work:
        groups = [(name, [dev]) for name, devs in groups for dev in devs]
    for name, devs in groups:
        profile = profiles.get(name)
        if profile is None:
            continue
        # The slice's memory comes from the card's as it reports it (its ECC mode counted): one size, whatever mode.
        memory = profile.memory_mib(card_memory_mib or declared.memory_mib)
        model = replace(slice_model(declared, profile), memory_mib=memory, memory_mib_ecc_on=memory,
                        memory_mib_ecc_off=memory)
        labels = [MIG_LABEL_BASE + i for i in range(len(devs))]
        uuids_of = tuple(d["uuid"] for d in devs)
        drawn = replace(draw(model, labels, quick, rng=rng, real_work=real_work), mig_uuids=uuids_of)
        proof = replace(memproof.draw(model, labels, rng=rng, real=real_work), mig_uuids=uuids_of)
        out.append(SliceChallenge(profile=profile, model=model, challenge=drawn, proof=proof,
                                  devices=dict(zip(labels, devs, strict=True))))
    return out


def slice_name(dev: dict) -> str:
    return f"GPU {dev['gpu']}'s MIG {dev['profile']} slice {dev['device']} ({dev['uuid']})"


def judge_slices(drawn: SliceChallenge, outcome: Outcome) -> tuple[list[Finding], dict[str, Any], set[str]]:
    """(findings naming each slice, figures by slice UUID, the UUIDs of slices the challenge disproved)."""
    found, figures = judge(drawn.model, drawn.challenge, outcome)
    return _per_slice(drawn, found, figures)


def judge_slice_proofs(drawn: SliceChallenge, outcome: memproof.Outcome,
                       ) -> tuple[list[Finding], dict[str, Any], set[str]]:
    """The memory proof's (findings naming each slice, figures by slice UUID, disproved UUIDs)."""
    assert drawn.proof is not None
    found, figures = memproof_verdict.judge(drawn.model, drawn.proof, outcome)
    return _per_slice(drawn, found, figures)


def _per_slice(drawn: SliceChallenge, found: list[Finding], figures: dict[str, Any],
               ) -> tuple[list[Finding], dict[str, Any], set[str]]:
    findings: list[Finding] = []
    disproved: set[str] = set()
    for f in found:
        dev = drawn.devices.get(f.gpu_index) if f.gpu_index is not None else None
        if dev is None:  # about the whole exchange (the node stopped with an error): every slice in it
            findings.append(Finding(f.severity, f"mig_slice_{f.code}",
                                    f"MIG {drawn.profile.name} slices: {f.message}"))
            if f.severity == REJECT:
                disproved |= {d["uuid"] for d in drawn.devices.values()}
            continue
        message = f.message.replace(f"GPU {f.gpu_index}", slice_name(dev), 1)
        findings.append(Finding(f.severity, f"mig_slice_{f.code}", message, dev["gpu"]))
        if f.severity == REJECT:
            disproved.add(dev["uuid"])
    by_uuid = {drawn.devices[int(label)]["uuid"]: dict(row, profile=drawn.profile.name)
               for label, row in figures.pop("gpus").items()}
    figures["slices"] = by_uuid
    return findings, figures, disproved
