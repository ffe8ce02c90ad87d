"""Offer rows straight from the database's tuples: OfferSerializer's JSON without a Node and a GpuModel per row.

Issue 14: a page of offers spent about a quarter of its time in DRF serialization, building two model instances
per row and walking a field tree per value. `OFFER_COLUMNS` is what a row reads (`values_list`) and `offer_row`
writes exactly what OfferSerializer writes for it (tests/marketplace/test_offer_rows.py holds them equal, field by
field and byte by byte). OfferSerializer stays the documented schema and serves the single-offer read.
"""
import math
from typing import Any

from rest_framework import serializers

from marketplace.mig import profiles_for
from marketplace.models import Verdict
from marketplace.models.host import cuda_version_text

# The order of offer_row's unpacking.
OFFER_COLUMNS = (
    "id", "gpu_model__slug", "gpu_model__name", "num_gpus_free", "gpu_count", "gpu_model__memory_gb",
    "price_per_gpu_hour_micros", "country", "city", "datacenter", "reliability", "score", "score_per_dollar",
    "verdict", "runtime", "benchmark_summary", "disk_price_per_gb_month_micros", "cpu_model", "cpu_cores",
    "ram_gb", "disk_left_gb", "disk_bandwidth_mbs", "driver_version", "cuda_version", "pcie_gen", "pcie_width",
    "net_mbps", "host_checked_at", "mig_prices_micros",
)
MEDIAN_FIGURES = ("bf16_tflops", "tf32_tflops", "fp32_tflops", "memory_bandwidth_gbs", "h2d_gbs",
                  "cnn_train_images_s", "cnn_infer_images_s", "power_draw_w", "bf16_tflops_per_w")

# DRF's own field for datetimes: the current time zone and its "Z" are DRF's rules, not restated here.
_datetime = serializers.DateTimeField()


def usd_text(micros: int) -> str:
    """UsdField's text of integer micro-dollars ("0.790000"), without Decimal."""
    whole, fraction = divmod(abs(micros), 1_000_000)
    return f"{'-' if micros < 0 else ''}{whole}.{fraction:06d}"


def _datetime_text(value: Any) -> Any:
    if not value:
        return None
    return value if isinstance(value, str) else _datetime.to_representation(value)


INT_LIMIT = 2**63  # a bigint's: no figure of a node comes near it


def finite_float(value: Any) -> float | None:
    """A figure of a node's stored benchmark summary (a JSON value) as the finite float JSON can carry, or None.

    Stored JSON may hold what no float is (found by review): jsonb keeps any number, and Python's json reads one
    beyond a float's range back as an int that float() refuses (OverflowError: a 500 on every offers page that held
    the node) or, with a fraction, as inf, which JSON has no number for (JSONRenderer refuses it, a page printed
    "inf"). Text that is no number, a list or an object is None too: one node's summary must not fail every offer
    list. What float() takes otherwise stays as DRF's FloatField writes it (12, "12.5", Decimal("12.5"))."""
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, ArithmeticError):  # ArithmeticError: OverflowError; Decimal("sNaN"): ValueError
        return None
    return number if math.isfinite(number) else None


def finite_int(value: Any) -> int | None:
    """A whole-number figure of a stored summary as DRF's IntegerField writes it (int(12.0) = 12), or None where it
    is not a finite number or lies beyond 64 bits (JSON's readers, and the renderer past 4,300 digits, fail on it)."""
    number = finite_float(value)
    if number is None:
        return None
    whole = value if type(value) is int else int(number)
    return whole if -INT_LIMIT <= whole < INT_LIMIT else None


def nvlink_islands(value: Any) -> list[list[int]]:
    """The stored islands, keeping only GPU indices: a node's summary written before its inventory was checked
    (provisioning/verification/answers.py) may hold anything, and one node's must not fail every offer list."""
    if not isinstance(value, list):
        return []
    return [[gpu for gpu in island if type(gpu) is int and -INT_LIMIT <= gpu < INT_LIMIT]
            for island in value if isinstance(island, list)]


def nvlink_summary(nvlink: Any) -> dict[str, Any] | None:
    """NvlinkSummarySerializer's output (the check always writes `connected` and `islands`)."""
    if not isinstance(nvlink, dict):
        return None
    return {"connected": bool(nvlink.get("connected")),
            "islands": nvlink_islands(nvlink.get("islands")),
            "links_per_gpu": finite_int(nvlink.get("links_per_gpu")), "p2p_gbs": finite_float(nvlink.get("p2p_gbs")),
            "pcie_p2p_gbs": finite_float(nvlink.get("pcie_p2p_gbs"))}


def benchmark_summary(summary: Any) -> dict[str, Any] | None:
    """BenchmarkSummarySerializer's output: absent keys stay absent, except those that allow null (the medians,
    nvlink): null when absent."""
    if summary is None:
        return None
    out: dict[str, Any] = {}
    if "checked_at" in summary:
        out["checked_at"] = _datetime_text(summary["checked_at"])
    if "verdict" in summary:
        verdict = summary["verdict"]
        out["verdict"] = None if verdict is None else str(verdict)
    if "median_per_gpu" in summary:
        medians = summary["median_per_gpu"]
        out["median_per_gpu"] = None if medians is None else {
            name: finite_float(medians.get(name)) for name in MEDIAN_FIGURES}
    out["nvlink"] = nvlink_summary(summary.get("nvlink"))  # allow_null: an absent key reads as null
    if "findings" in summary:
        findings = summary["findings"]
        out["findings"] = None if findings is None else [
            None if code is None else str(code) for code in findings]
    return out


def mig_slices(slug: str, prices: dict[str, int] | None, free: dict[str, int] | None) -> list[dict[str, Any]]:
    """OfferSerializer's `mig_slices`: per MIG profile with a free slice, its count and price per slice-hour. A
    profile the node prices no more is left out, never shown at 0 (booking it is refused): the selector counts none
    (marketplace.selectors.free_slices_by_node), and this holds it to the prices it was given."""
    profiles, prices = profiles_for(slug), prices or {}
    return [{"gpu_model": slug, "mig_profile": name,
             "memory_gb": profiles[name].memory_gb if name in profiles else None, "num_free": n,
             "price_per_slice_hour": usd_text(prices[name])}
            for name, n in sorted((free or {}).items()) if name in prices]


def offer_row(row: tuple[Any, ...], fee_percent: str, slices: dict[int, dict[str, int]] | None = None,
              ) -> dict[str, Any]:
    """One offer's JSON object from a tuple of OFFER_COLUMNS; `fee_percent` is the response's platform fee,
    `slices` the free MIG slices by node (selectors.free_slices_by_node)."""
    (pk, slug, model_name, free, total, memory_gb, price, country, city, datacenter, reliability, score,
     score_per_dollar, verdict, runtime, summary, disk_price, cpu_model, cpu_cores, ram_gb, disk_free_gb,
     disk_bandwidth_mbs, driver_version, cuda_version, pcie_gen, pcie_width, net_mbps, host_checked_at,
     mig_prices) = row
    return {
        "id": pk,
        "gpu_model": slug,
        "gpu_model_name": model_name,
        "num_gpus_free": free,
        "num_gpus_total": total,
        "gpu_memory_gb": memory_gb,
        "price_per_gpu_hour": usd_text(price),
        "country": country,
        "city": city,
        "datacenter": datacenter,
        "reliability": reliability,
        "score": score,
        "score_per_dollar": score_per_dollar,
        "verified": verdict == Verdict.VERIFIED,
        "verdict": verdict,
        "runtime": runtime,
        "platform_fee_percent": fee_percent,
        "benchmark": benchmark_summary(summary),
        "disk_price_per_gb_month": usd_text(disk_price),
        "cpu_model": cpu_model,
        "cpu_cores": cpu_cores,
        "ram_gb": ram_gb,
        "disk_free_gb": disk_free_gb,
        "disk_bandwidth_mbs": disk_bandwidth_mbs,
        "driver_version": driver_version,
        "cuda_version": cuda_version_text(cuda_version),
        "pcie_gen": pcie_gen,
        "pcie_width": pcie_width,
        "platform_to_node_mbps": net_mbps,
        "host_checked_at": _datetime_text(host_checked_at),
        "nvlink": bool(((summary or {}).get("nvlink") or {}).get("connected")),
        "mig_slices": mig_slices(slug, mig_prices, (slices or {}).get(pk)),
    }
