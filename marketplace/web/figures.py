"""Reads behind the pages' figures: the GPU comparison and a node's benchmark history. No writes.

Measured figures come from verification runs (provisioning.models.VerificationRun.figures, as the acceptance
policy summarises them: per GPU, the node's medians, and the datasheet they were judged against). They are JSON
written from a node's answers, and a run stored before those were checked may hold values of any kind: the runs
read here carry their figures and findings as marketplace.stored_figures reads them (_readable), well-typed only.
"""
import statistics
from dataclasses import dataclass, field

from django.db.models import OuterRef, QuerySet, Subquery

from marketplace import selectors
from marketplace.models import GpuModel, Node, NodeState, Verdict
from marketplace.models.nodes import LISTABLE_VERDICTS
from marketplace.money import micros_to_usd
from marketplace.stored_figures import run_figures, run_findings
from provisioning.models import VerificationRun
from provisioning.verification.tolerances import FIGURES, TOLERANCES

# Measured figures compared with the catalogue's: (key in a run's figures, catalogue field, label, unit).
COMPARED = [
    ("bf16_tflops", "bf16_tflops", "BF16/FP16 tensor", "TFLOP/s"),
    ("tf32_tflops", "tf32_tflops", "TF32 tensor", "TFLOP/s"),
    ("fp32_tflops", "fp32_tflops", "FP32", "TFLOP/s"),
    ("memory_bandwidth_gbs", "memory_bandwidth_gbps", "Memory bandwidth", "GB/s"),
]
# Throughput of a small CNN the benchmark trains and runs: the closest figure to "my PyTorch workload".
WORKLOAD = [
    ("cnn_train_images_s", "CNN training", "images/s"),
    ("cnn_infer_images_s", "CNN inference", "images/s"),
]


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _readable(run: VerificationRun) -> VerificationRun:
    """The run with its figures and findings as the pages read them (stored_figures.run_figures, run_findings): a
    figure that is text, a bool or a list, `gpus` that is no list, a finding that is no object... are left out, not
    a 500 or a figure read out of text as if measured (found by review). For showing only: never saved."""
    run.figures, run.findings = run_figures(run.figures), run_findings(run.findings)
    return run


def latest_runs(node_ids: list[int], *, listable_only: bool = False) -> dict[int, VerificationRun]:
    """The newest verification run of each node (optionally only runs that listed the node), in two queries;
    each _readable."""
    runs = VerificationRun.objects.filter(node=OuterRef("pk"))
    if listable_only:
        runs = runs.filter(verdict__in=LISTABLE_VERDICTS)
    latest = Node.objects.filter(pk__in=node_ids).annotate(
        run_id=Subquery(runs.order_by("-created_at", "-id").values("id")[:1])
    ).values_list("run_id", flat=True)
    found = VerificationRun.objects.filter(id__in=[r for r in latest if r is not None])
    return {run.node_id: _readable(run) for run in found}


@dataclass
class GpuColumn:
    """One GPU model in the comparison: datasheet, what the marketplace measured, what it costs."""

    model: GpuModel
    measured: dict = field(default_factory=dict)  # key -> median over the measured nodes (None: not measured)
    nodes_measured: int = 0
    score: float | None = None  # median Node.score of listed nodes (per GPU; 100 = A100 80GB SXM datasheet)
    offers: int = 0  # every bookable offer of the model, whole GPUs or MIG slices
    slice_only_offers: int = 0  # of those, offers of MIG slices only (no free whole GPU): not in the prices
    gpus_free: int = 0
    cheapest_micros: int | None = None
    median_micros: int | None = None
    best_value: bool = False
    # Measured BF16 TFLOP/s per watt: the median over verified nodes that measured it, and how many did.
    per_watt: float | None = None
    per_watt_nodes: int = 0

    @property
    def bf16_basis(self) -> tuple[float, str]:
        """The BF16 figure prices are divided by: measured when there is one, else the datasheet's."""
        measured = self.measured.get("bf16_tflops")
        return (measured, "measured") if measured else (self.model.bf16_tflops, "datasheet")

    def _per_tflop(self, micros):
        if micros is None:
            return None
        tflops, _ = self.bf16_basis
        return float(micros_to_usd(micros)) / tflops if tflops else None

    @property
    def cheapest_per_tflop(self) -> float | None:
        """USD per BF16 TFLOP/s per hour at the cheapest offer."""
        return self._per_tflop(self.cheapest_micros)

    @property
    def median_per_tflop(self) -> float | None:
        return self._per_tflop(self.median_micros)

    def measured_share(self, key: str, sheet_field: str) -> float | None:
        value, sheet = self.measured.get(key), getattr(self.model, sheet_field)
        return value / sheet if value and sheet else None

    @property
    def rows(self) -> list[dict]:
        """Datasheet beside measured, per compared figure (for templates)."""
        return [{"label": label, "unit": unit, "sheet": getattr(self.model, sheet_field),
                 "measured": self.measured.get(key), "share": self.measured_share(key, sheet_field)}
                for key, sheet_field, label, unit in COMPARED]


def gpu_comparison(models: QuerySet[GpuModel]) -> list[GpuColumn]:
    """Every model in `models` with its measured medians (latest listed run of each verified or degraded,
    live node), its median score, and the per-GPU prices of its offers with a free whole GPU (bookable now)."""
    columns = {m.pk: GpuColumn(model=m) for m in models}
    nodes = list(
        Node.objects.filter(gpu_model_id__in=columns, verdict__in=LISTABLE_VERDICTS)
        .exclude(state=NodeState.RETIRED).values_list("pk", "gpu_model_id", "score")
    )
    runs = latest_runs([pk for pk, _, _ in nodes], listable_only=True)
    per_model: dict[int, list[dict]] = {}
    per_watt: dict[int, list[float]] = {}
    scores: dict[int, list[float]] = {}
    for pk, model_id, score in nodes:
        if score:
            scores.setdefault(model_id, []).append(score)
        run = runs.get(pk)
        if run is not None and run.figures.get("median"):
            per_model.setdefault(model_id, []).append(run.figures["median"])
            # Per watt only from verified nodes: a degraded one (a power cap, a hot card) is no fair sample.
            if run.verdict == Verdict.VERIFIED and run.figures["median"].get("bf16_tflops_per_w"):
                per_watt.setdefault(model_id, []).append(run.figures["median"]["bf16_tflops_per_w"])
    prices: dict[int, list[tuple[int, int]]] = {}
    offers = selectors.offers_search().filter(gpu_model_id__in=columns).order_by()
    for model_id, micros, free in offers.values_list("gpu_model_id", "price_per_gpu_hour_micros", "num_gpus_free"):
        prices.setdefault(model_id, []).append((micros, free))
    for model_id, column in columns.items():
        medians = per_model.get(model_id, [])
        column.nodes_measured = len(medians)
        keys = [k for k, *_ in COMPARED] + [k for k, *_ in WORKLOAD]
        column.measured = {k: _median([m.get(k) for m in medians]) for k in keys}
        column.score = _median(scores.get(model_id, []))
        column.per_watt = _median(per_watt.get(model_id, []))
        column.per_watt_nodes = len(per_watt.get(model_id, []))
        rows = prices.get(model_id, [])
        column.offers = len(rows)
        column.gpus_free = sum(free for _, free in rows)
        # A node with no free whole GPU is an offer of MIG slices only (offers_search: free GPUs or bookable
        # slices), rented per slice-hour at mig_prices_micros: its per-GPU price is charged to no one, so it is
        # no price of a GPU-hour here (found by review: a split node's $0.10 shown as the cheapest A100).
        whole = [m for m, free in rows if free > 0]
        column.slice_only_offers = len(rows) - len(whole)
        if whole:
            column.cheapest_micros = min(whole)
            column.median_micros = int(statistics.median(whole))
    result = list(columns.values())
    priced = [c for c in result if c.cheapest_per_tflop is not None]
    if len(priced) > 1:
        min(priced, key=lambda c: c.cheapest_per_tflop or 0.0).best_value = True  # `or`: never None in `priced`
    return result


# ------------------------------------------------------------------------------------ a node's history

def node_runs(node: Node, limit: int = 12) -> list[VerificationRun]:
    """The node's newest verification runs, newest first, each _readable."""
    return [_readable(run) for run in VerificationRun.objects.filter(node=node).order_by("-created_at", "-id")[:limit]]


def figure_bands() -> dict:
    """The acceptance policy's bands per figure (share of the datasheet): reject below, degrade below, max."""
    return {key: {**TOLERANCES["figure_bands"][key], "label": label, "unit": unit}
            for key, (label, unit) in FIGURES.items()}


def run_shares(run: VerificationRun) -> dict[str, float | None]:
    """A run's median figures as shares of the datasheet it was judged against (its figures read well-typed)."""
    figures = run_figures(run.figures)
    median, sheet = figures.get("median") or {}, figures.get("datasheet") or {}
    return {key: (median[key] / sheet[key] if median.get(key) and sheet.get(key) else None) for key in FIGURES}

