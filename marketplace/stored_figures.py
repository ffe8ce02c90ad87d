"""The benchmark figures the platform stored from a node's answers, read back as well-typed values only. Pure: no
database, no Django.

Two JSON columns hold them: a node's summary of its last check (Node.benchmark_summary: what the offers show, the
API's list and single offer, the offers page, Vast's offer search) and a verification run's figures and findings
(provisioning.models.VerificationRun: the provider's server page, the GPU comparison). jsonb keeps any shape, and a
row written before the agent's answers were checked (provisioning/verification/answers.py), by hand or by a
migration holds what no check allows: a `median_per_gpu` or `nvlink` that is no object, `findings` that is no list,
a figure that is text, a bool or a list, a number no float holds (found by review: each made a reader fail, a 500,
or print "True" or a figure read out of text as if measured). Every reader goes through here: a value of the wrong
kind reads as absent (null, or left out), never as an error, and the rest of the row as stored.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from datetime import datetime
from typing import Any

INT_LIMIT = 2**63  # a bigint's: no figure of a node comes near it

# The medians the offers show (Node.benchmark_summary's `median_per_gpu`; provisioning's OFFER_SUMMARY_FIGURES).
MEDIAN_FIGURES = ("bf16_tflops", "tf32_tflops", "fp32_tflops", "memory_bandwidth_gbs", "h2d_gbs",
                  "cnn_train_images_s", "cnn_infer_images_s", "power_draw_w", "bf16_tflops_per_w")


# ------------------------------------------------------------------------------------------- values

def finite_float(value: Any) -> float | None:
    """A value as the finite float JSON can carry, or None: what DRF's FloatField writes of it (12, "12.5",
    Decimal("12.5")) where that is finite. Stored JSON may hold what no float is: jsonb keeps any number, and
    Python's json reads one beyond a float's range back as an int that float() refuses (OverflowError) or, with a
    fraction, as inf, which JSON has no number for. The stored figures are read with `number`, stricter."""
    if value is None:
        return None
    try:
        number_ = float(value)
    except (TypeError, ValueError, ArithmeticError):  # ArithmeticError: OverflowError; Decimal("sNaN"): ValueError
        return None
    return number_ if math.isfinite(number_) else None


def finite_int(value: Any) -> int | None:
    """A whole number as DRF's IntegerField writes it (int(12.0) = 12), or None where it is not a finite number or
    lies beyond 64 bits (JSON's readers, and the renderer past 4,300 digits, fail on it)."""
    number_ = finite_float(value)
    if number_ is None:
        return None
    whole_ = value if type(value) is int else int(number_)
    return whole_ if -INT_LIMIT <= whole_ < INT_LIMIT else None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)  # JSON's numbers; true is no 1


def number(value: Any) -> float | None:
    """A stored figure: a JSON number that a float holds finitely, as that float; None for anything else (text,
    even "12.5", a bool, a list, an object, NaN, inf, 1e400)."""
    return finite_float(value) if _is_number(value) else None


def whole(value: Any) -> int | None:
    """A stored count or index: a JSON number that is a whole number within 64 bits (12.0 is 12); None otherwise."""
    if not _is_number(value) or (isinstance(value, float) and not value.is_integer()):
        return None
    return finite_int(value)


def boolean(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def moment(value: Any) -> str | None:
    """A stored time: ISO 8601 text with a date and a time, as stored; None otherwise."""
    if not isinstance(value, str):
        return None
    try:
        datetime.fromisoformat(value)
    except ValueError:
        return None
    return value if "T" in value or " " in value else None


def as_object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


# ------------------------------------------------------------------------------- a node's summary

def nvlink_islands(value: Any) -> list[list[int]]:
    """The stored islands, keeping only GPU indices (JSON integers within 64 bits)."""
    if not isinstance(value, list):
        return []
    return [[gpu for gpu in island if type(gpu) is int and -INT_LIMIT <= gpu < INT_LIMIT]
            for island in value if isinstance(island, list)]


def nvlink_summary(nvlink: Any) -> dict[str, Any] | None:
    """The summary's `nvlink` as the API writes it (NvlinkSummarySerializer): None unless an object; `connected`
    only for a JSON true (as the offers' `nvlink` filter matches it: containment of true)."""
    if not isinstance(nvlink, dict):
        return None
    return {"connected": nvlink.get("connected") is True,
            "islands": nvlink_islands(nvlink.get("islands")),
            "links_per_gpu": whole(nvlink.get("links_per_gpu")), "p2p_gbs": number(nvlink.get("p2p_gbs")),
            "pcie_p2p_gbs": number(nvlink.get("pcie_p2p_gbs"))}


def summary(stored: Any) -> dict[str, Any] | None:
    """A node's benchmark_summary as the API's `benchmark` writes it (BenchmarkSummarySerializer): None unless an
    object; a key absent stays absent, except `nvlink` (null when absent); each value present of the wrong kind is
    null: `checked_at` unless ISO text, `verdict` unless text, `median_per_gpu` unless an object (then each of
    MEDIAN_FIGURES, null unless a number), `findings` unless a list (then its codes: the text items)."""
    if not isinstance(stored, dict):
        return None
    out: dict[str, Any] = {}
    if "checked_at" in stored:
        out["checked_at"] = moment(stored["checked_at"])
    if "verdict" in stored:
        out["verdict"] = text(stored["verdict"])
    if "median_per_gpu" in stored:
        medians = stored["median_per_gpu"]
        out["median_per_gpu"] = ({name: number(medians.get(name)) for name in MEDIAN_FIGURES}
                                 if isinstance(medians, dict) else None)
    out["nvlink"] = nvlink_summary(stored.get("nvlink"))
    if "findings" in stored:
        findings = stored["findings"]
        out["findings"] = [code for code in findings if isinstance(code, str)] if isinstance(findings, list) else None
    return out


def nvlink_connected(stored: Any) -> bool:
    """The offer's `nvlink`: summary(stored)'s nvlink says connected (read without the rest)."""
    nvlink = as_object(stored).get("nvlink")
    return isinstance(nvlink, dict) and nvlink.get("connected") is True


def median(stored: Any, name: str) -> float | None:
    """One of summary(stored)'s medians (MEDIAN_FIGURES), read without the rest (Vast's search reads thousands)."""
    medians = as_object(stored).get("median_per_gpu")
    return number(medians.get(name)) if isinstance(medians, dict) and name in MEDIAN_FIGURES else None


# --------------------------------------------------------------------- a verification run's figures

# What a run's figures hold, as the pages read them (policy.summarize, challenge_verdict.judge, memproof_verdict.judge,
# slice_challenge): a reader per value; an object's spec names its keys (ANY: every other key; INDEX: a GPU index
# as text), a list's its items. A value that does not fit is left out, an object's key with it.
Spec = Callable[[Any], Any] | dict[str, Any] | list[Any]
ANY, INDEX = "*", "#"
_FIGURES = {ANY: number}
_GPU = {"index": whole, "sm_count": whole, "of_datasheet": _FIGURES, ANY: number}
_CHALLENGE = {"bf16_tflops": number, "of_datasheet": number, "platform_elapsed_s": number, "node_elapsed_s": number,
              "correct": boolean}
_PROOF = {"correct": boolean, "fresh_s": number, "fill_s": number}
RUN_FIGURES: dict[str, Any] = {
    "median": _FIGURES, "datasheet": _FIGURES, "gpus": [_GPU],
    "challenge": {
        "gpus": {INDEX: _CHALLENGE},
        "memory_proof": {"gpus": {INDEX: _PROOF}, "read_deadline_s": number, "nominal_bytes": whole,
                         "not_run": text},
        "mig_slices": {"slices": {ANY: {**_CHALLENGE, "profile": text, "memory_proof": _PROOF}},
                       "memory_proof": {"read_deadline_s": number, "not_run": text}},
    },
}
RUN_FINDING = {"severity": text, "code": text, "message": text, "gpu_index": whole}


def _is_index(key: str) -> bool:
    return key.isascii() and key.isdigit() and len(key) <= 6


def well_typed(value: Any, spec: Spec) -> Any:
    """`value` with only what fits `spec`; None where the value itself does not."""
    if callable(spec):
        return spec(value)
    if isinstance(spec, list):
        if not isinstance(value, list):
            return None
        items = (well_typed(item, spec[0]) for item in value)
        return [item for item in items if item is not None]
    if not isinstance(value, dict):
        return None
    out = {}
    for key, item in value.items():
        sub = spec.get(key) or (spec.get(INDEX) if _is_index(key) else None) or spec.get(ANY)
        if sub is not None and (read := well_typed(item, sub)) is not None:
            out[key] = read
    return out


def run_figures(stored: Any) -> dict[str, Any]:
    """A run's figures as the pages read them (RUN_FIGURES): {} unless an object."""
    return well_typed(stored, RUN_FIGURES) or {}


def run_findings(stored: Any) -> list[dict[str, Any]]:
    """A run's findings that say something (an object with a text code and message), each with its severity and
    gpu_index where they are text and a whole number; [] unless a list."""
    return [finding for finding in well_typed(stored, [RUN_FINDING]) or []
            if "code" in finding and "message" in finding]
