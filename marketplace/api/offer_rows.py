"""Offer rows straight from the database's tuples: OfferSerializer's JSON without a Node and a GpuModel per row.

Issue 14: a page of offers spent about a quarter of its time in DRF serialization, building two model instances
per row and walking a field tree per value. `OFFER_COLUMNS` is what a row reads (`values_list`) and `offer_row`
writes exactly what OfferSerializer writes for it (tests/marketplace/test_offer_rows.py holds them equal, field by
field and byte by byte). OfferSerializer stays the documented schema and serves the single-offer read.
"""
from typing import Any

from rest_framework import serializers

from marketplace.mig import profiles_for
from marketplace.models import Verdict
from marketplace.models.host import cuda_version_text
from marketplace.stored_figures import finite_float as finite_float  # the stored summary's readers, moved there
from marketplace.stored_figures import nvlink_summary as nvlink_summary
from marketplace.stored_figures import summary as stored_summary

# The order of offer_row's unpacking.
OFFER_COLUMNS = (
    "id", "gpu_model__slug", "gpu_model__name", "num_gpus_free", "gpu_count", "gpu_model__memory_gb",
    "price_per_gpu_hour_micros", "country", "city", "datacenter", "reliability", "score", "score_per_dollar",
    "verdict", "runtime", "benchmark_summary", "disk_price_per_gb_month_micros", "cpu_model", "cpu_cores",
    "ram_gb", "disk_left_gb", "disk_bandwidth_mbs", "driver_version", "cuda_version", "pcie_gen", "pcie_width",
    "net_mbps", "host_checked_at", "mig_prices_micros", "nvlink_gpus_free",
)

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


def benchmark_summary(summary: Any) -> dict[str, Any] | None:
    """BenchmarkSummarySerializer's output: the stored summary's well-typed values (stored_figures.summary)."""
    return stored_summary(summary)


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
     mig_prices, nvlink_free) = row
    benchmark = benchmark_summary(summary)
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
        "benchmark": benchmark,
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
        "nvlink": nvlink_free >= 2,  # OfferSerializer.get_nvlink
        "nvlink_gpus_free": nvlink_free,
        "mig_slices": mig_slices(slug, mig_prices, (slices or {}).get(pk)),
    }
