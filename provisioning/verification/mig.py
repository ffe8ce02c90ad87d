"""The MIG part of the check: the layout nvidia-smi shows against the provider's declaration, and each slice's
proof (its memory and throughput against its profile's share of the card's datasheet, in the same bands as a
whole card's figures). Pure, like policy.py: the service gives it what the agent answered."""
from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

from marketplace.mig import profiles_for

from .model import REJECT, DeclaredModel, Finding
from .performance import check_figures, check_results
from .policy import MigJudgement, gpu_score
from .tolerances import TOLERANCES

# A slice holds a little less than its share of the card (the driver keeps some): 3g.40gb on an A100 80GB shows
# 40192 MiB of 40960, 1g.10gb 9728 of 10240 (nvidia-smi on real cards). Under this share it is not that profile.
SLICE_MEMORY_MIN_FRACTION = 0.9


def slice_model(declared: DeclaredModel, profile) -> DeclaredModel:
    """The declared card scaled to one slice: throughput by its compute slices of 7, bandwidth and memory by its
    memory slices of 8. The figure bands then apply to a slice as to a whole card."""
    sheet = dict(declared.datasheet)
    for key in ("bf16_tflops", "fp16_tflops", "tf32_tflops", "fp32_tflops"):
        if key in sheet:
            sheet[key] = sheet[key] * profile.compute_fraction
    if "memory_bandwidth_gbs" in sheet:
        sheet["memory_bandwidth_gbs"] = sheet["memory_bandwidth_gbs"] * profile.memory_fraction
    return replace(declared, datasheet=sheet, name=f"{declared.label} MIG {profile.name}")


def card_configuration(card: Mapping | None, devices: Sequence[dict]) -> list[str] | None:
    """How nvidia-smi shows a card: None whole (MIG mode off), else the sorted profiles of its MIG devices."""
    if ((card or {}).get("mig_mode") or "").lower() != "enabled":
        return None
    return sorted(d["profile"] for d in devices)


def pending_layout(layout: Mapping[int, Sequence[str]], inventory_gpus: Sequence[dict], devices: Sequence[dict],
                   held: Mapping[int, Collection[str]],
                   awaiting: Mapping[int, Sequence[str] | None] | None = None) -> list[int]:
    """The cards whose declared layout cannot be applied yet because renters hold them, so that the check does not
    judge them against it: their layout stays pending until they are free. `held`: {inventory index: the UUIDs of
    the rented MIG slices on that card} for each card renters hold (an empty set: held whole).
    - Held whole and declared split but not configured so: MIG mode cannot be turned on under its renter.
    - Holding rented slices, each still on it, and configured otherwise than declared (or declared whole): the
      rented slices stay until their renters leave (the free part may be re-split meanwhile, and is then judged).
    A card whose rented slice is gone, or held whole and in MIG mode though declared whole, is judged as any other:
    that is about the renters' hardware. Before, such a card was judged against the new declaration, the node was
    rejected and every renter on it cut to $0/h (found by review).
    `awaiting`: {index: the configuration the card was last judged in (card_configuration)} for each card nobody
    holds whose declared layout is another one (its last renter left, provisioning.services.mig.cards_awaiting):
    pending while nvidia-smi still shows it so, since the provider can re-split it only now that it is free.
    Before, the check its release queued rejected the whole node for a card still in its old configuration
    (found by review). A card configured otherwise than both is judged (a re-split gone wrong)."""
    smi = {g.get("index"): g for g in inventory_gpus}
    by_gpu: dict[int, list[dict]] = {}
    for dev in devices:
        by_gpu.setdefault(dev["gpu"], []).append(dev)
    pending = []
    for gpu, rented in held.items():
        seen = by_gpu.get(gpu, [])
        if rented and not set(rented) <= {d.get("uuid") for d in seen}:
            continue  # a renter's slice is gone: the card is not what they rented
        if gpu not in layout:
            if rented:  # declared whole again: MIG mode stays on until its slices' renters leave
                pending.append(gpu)
            continue
        mode = ((smi.get(gpu) or {}).get("mig_mode") or "").lower()
        if mode != "enabled" or not seen or sorted(d["profile"] for d in seen) != sorted(layout[gpu]):
            pending.append(gpu)
    for gpu, then in (awaiting or {}).items():
        declared = sorted(layout[gpu]) if gpu in layout else None
        if gpu in held or gpu not in smi or declared == (sorted(then) if then is not None else None):
            continue
        if card_configuration(smi[gpu], by_gpu.get(gpu, [])) == (sorted(then) if then is not None else None):
            pending.append(gpu)
    return sorted(pending)


def repeated_mig_findings(devices: Sequence[dict]) -> list[Finding]:
    """Per card, a MIG device its `nvidia-smi -L` listing repeats: a UUID another device (of this card or another)
    also reports (`mig_uuid_repeated`), or a device number listed twice on it (`mig_device_repeated`). A driver
    fault on that card, named on it (gpu_index) so that only its renters are concerned: the other cards are judged
    as usual. Its slices prove nothing (known by their UUID: the benchmark's figures, MigSlice rows)."""
    counted = Counter(dev["uuid"] for dev in devices)
    numbered = Counter((dev["gpu"], dev["device"]) for dev in devices)
    cards_of: dict[str, set[int]] = {}  # a repeated UUID -> the cards listing it
    for dev in devices:
        if counted[dev["uuid"]] > 1:
            cards_of.setdefault(dev["uuid"], set()).add(dev["gpu"])
    findings: list[Finding] = []
    for gpu in sorted({dev["gpu"] for dev in devices}):
        shared = sorted(uuid for uuid, gpus in cards_of.items() if gpu in gpus)
        if shared:
            others = sorted(set().union(*(cards_of[u] for u in shared)) - {gpu})
            where = (f"also reported by GPU{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}"
                     if others else "listed twice on it")
            findings.append(Finding(REJECT, "mig_uuid_repeated",
                                    f"GPU {gpu}'s MIG device UUID {', '.join(shared)} is {where}; every MIG "
                                    f"device has its own. {_REPEAT_ADVICE.format(gpu=gpu)}", gpu))
        twice = sorted(number for (card, number), count in numbered.items() if card == gpu and count > 1)
        if twice:
            findings.append(Finding(REJECT, "mig_device_repeated",
                                    f"GPU {gpu} lists MIG device {', '.join(map(str, twice))} more than once. "
                                    f"{_REPEAT_ADVICE.format(gpu=gpu)}", gpu))
    return findings


# What a provider can do about a card whose MIG listing repeats a device (a driver fault on that card).
_REPEAT_ADVICE = ("None of GPU {gpu}'s slices is listed until `nvidia-smi -L` shows each of its MIG devices once: "
                  "re-create its MIG instances (`nvidia-smi mig -i {gpu} -dci`, `nvidia-smi mig -i {gpu} -dgi`, "
                  "then the declared ones with `nvidia-smi mig -i {gpu} -cgi ... -C`) or reload the NVIDIA driver, "
                  "then verify again. The server's other cards are judged as usual.")


def check_mig(declared: DeclaredModel, layout: dict[int, list[str]], inventory_gpus: Sequence[dict],
              devices: Sequence[dict], measured: Sequence[dict] | None,
              skip_uuids: Sequence[str] = (), disproved: Collection[str] = (),
              pending: Collection[int] = ()) -> tuple[list[Finding], list[dict]]:
    """(findings, slices): the configured layout against `layout` ({gpu index: [profile, ...]}), then each
    measured slice against its profile. `slices` lists every configured slice of a declared GPU with its figures
    and whether it was proven (a slice in `skip_uuids` is rented: not measured, not judged, kept as it was; one in
    `disproved` failed the platform's own challenge (slice_challenge.py): not proven, whatever it reported).
    A card in `pending` (pending_layout: renters hold it) is not judged against its declared layout: no finding,
    none of its slices listed by this check."""
    findings = repeated_mig_findings(devices)
    # A card whose listing repeats a MIG device is withheld whole: which of its entries is the slice is unknown.
    # Only that card: before, the repeat made the whole inventory malformed, a finding about no card, and every
    # renter of the node was cut to $0/h (found by review).
    withheld = {f.gpu_index for f in findings}
    profiles = profiles_for(declared.slug)
    smi = {g.get("index"): g for g in inventory_gpus}
    by_gpu: dict[int, list[dict]] = {}
    for dev in devices:
        by_gpu.setdefault(dev["gpu"], []).append(dev)
    figures = {row.get("uuid"): row for row in measured or []}
    slices: list[dict] = []
    for gpu, wanted in sorted(layout.items()):
        if gpu in pending or gpu in withheld:
            continue
        seen = by_gpu.get(gpu, [])
        mode = ((smi.get(gpu) or {}).get("mig_mode") or "").lower()
        if mode != "enabled" or not seen:
            findings.append(Finding(REJECT, "mig_not_configured",
                                    f"GPU {gpu} is declared split into MIG slices ({', '.join(wanted)}), but "
                                    f"nvidia-smi shows {'MIG mode off' if mode != 'enabled' else 'no MIG devices'}. "
                                    f"Enable MIG (`nvidia-smi -i {gpu} -mig 1`) and create the declared instances "
                                    "(`nvidia-smi mig -cgi ... -C`), or declare the GPU without a layout.", gpu))
            continue
        have = sorted(d["profile"] for d in seen)
        if have != sorted(wanted):
            findings.append(Finding(REJECT, "mig_layout_mismatch",
                                    f"GPU {gpu} is declared as {', '.join(sorted(wanted))} but nvidia-smi -L shows "
                                    f"{', '.join(have)}: make the layout match, or declare the one it has.", gpu))
            continue
        for dev in seen:
            slices.append(_judge_slice(declared, profiles[dev["profile"]], smi.get(gpu) or {}, dev,
                                       figures.get(dev["uuid"]), dev["uuid"] in skip_uuids, findings,
                                       dev["uuid"] in disproved))
    return findings, slices


def _judge_slice(declared: DeclaredModel, profile, card: dict, dev: dict, row: dict | None, rented: bool,
                 findings: list[Finding], disproved: bool = False) -> dict:
    gpu, name = dev["gpu"], f"GPU {dev['gpu']}'s MIG {dev['profile']} slice {dev['device']} ({dev['uuid']})"
    summary = {"gpu": gpu, "device": dev["device"], "profile": dev["profile"], "uuid": dev["uuid"],
               "memory_mib": None, "bf16_tflops": None, "memory_bandwidth_gbs": None, "score": None,
               "proven": False, "rented": rented}
    if rented:
        return summary
    if row is None:
        findings.append(Finding(REJECT, "mig_slice_unproven", f"{name} was not measured: the benchmark gave no "
                                                              "figures for it.", gpu))
        return summary
    own: list[Finding] = []
    card_mib = card.get("memory_total_mib") or declared.memory_mib
    expected = profile.memory_mib(card_mib)
    memory = row.get("memory_mib")
    summary.update(memory_mib=memory, bf16_tflops=row.get("bf16_tflops"),
                   memory_bandwidth_gbs=row.get("memory_bandwidth_gbs"))
    if not memory or memory < SLICE_MEMORY_MIN_FRACTION * expected:
        own.append(Finding(REJECT, "mig_slice_memory",
                           f"{name} holds {memory} MiB; a {profile.name} slice of {declared.a_label} holds about "
                           f"{expected} MiB. It is a smaller slice than its name says.", gpu))
    model = slice_model(declared, profile)
    for f in check_figures(model, dict(row, index=gpu)) + check_results(dict(row, index=gpu)):
        code = "mig_slice_wrong_results" if f.code == "wrong_results" else (
            "mig_slice_too_fast" if f.code.endswith("_too_high") else "mig_slice_slow")
        own.append(Finding(f.severity, code, f"{name}: " + f.message.replace(f"GPU {gpu} ", "it ", 1), gpu))
    findings.extend(own)
    score = gpu_score(row)
    summary.update(proven=not disproved and not any(f.severity == REJECT for f in own),
                   score=round(score, 2) if score is not None else None)
    return summary


def card_equivalent(slices: Sequence[dict], slug: str) -> list[dict]:
    """Measured slices as whole-card figures (divided by their share of the card), so that a node with only
    split cards still gets a score per card (policy.node_score)."""
    profiles, out = profiles_for(slug), []
    for s in slices:
        p = profiles.get(s["profile"])
        if p and s.get("bf16_tflops") and s.get("memory_bandwidth_gbs"):
            out.append({"bf16_tflops": s["bf16_tflops"] / p.compute_fraction,
                        "memory_bandwidth_gbs": s["memory_bandwidth_gbs"] / p.memory_fraction})
    return out


def judge_mig(declared: DeclaredModel, layout: dict[int, list[str]], inventory: dict, bench: dict | None,
              skip_uuids: Sequence[str] = (), disproved: Collection[str] = (),
              held: Mapping[int, Collection[str]] | None = None,
              awaiting: Mapping[int, Sequence[str] | None] | None = None) -> MigJudgement:
    """What policy.judge takes of MIG: nothing for a node without a declared layout (an undeclared MIG card is
    then rejected by check_identity, as always). `disproved`: slices the platform's challenge failed. `held`: the
    cards renters hold (pending_layout); a card whose layout is pending is not judged against it, and MIG mode is
    expected on one declared whole again while its rented slices are still on it. `awaiting`: the free cards
    declared anew, as pending_layout takes them."""
    pending = pending_layout(layout, inventory.get("gpus") or [], inventory.get("mig") or [], held or {}, awaiting)
    if not layout and not pending:
        return MigJudgement()
    findings, slices = check_mig(declared, layout, inventory.get("gpus") or [], inventory.get("mig") or [],
                                 (bench or {}).get("mig_slices"), skip_uuids, disproved, pending)
    return MigJudgement(findings=findings, slices=slices, gpus=frozenset(layout) | frozenset(pending),
                        card_figures=card_equivalent([s for s in slices if s["proven"]], declared.slug))


__all__ = ["judge_mig", "card_configuration", "pending_layout", "repeated_mig_findings", "SLICE_MEMORY_MIN_FRACTION",
           "TOLERANCES", "card_equivalent", "check_mig", "slice_model"]
