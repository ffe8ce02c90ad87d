"""The public offers search: one row per bookable node, filtered and ordered in SQL."""
import copy
from decimal import Decimal
from typing import Any

import django_filters
from django import forms
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import Case, Count, Exists, F, OuterRef, Q, QuerySet, Subquery, Value, When
from django.db.models.functions import Greatest
from django.db.models.lookups import GreaterThanOrEqual, LessThanOrEqual
from django.http import QueryDict
from django_countries import countries
from django_filters.fields import ChoiceField
from django_filters.utils import translate_validation
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import permissions, serializers, viewsets

from billing.services.metering import fee_percent, platform_fee_bps
from core.api.fields import UsdField
from core.api.filtering import FilterBackend, StrictFilterSet
from core.api.renderers import FastJSONRenderer
from core.api.scopes import PUBLIC
from core.money import usd_bound_to_micros
from marketplace import selectors, stored_figures
from marketplace.mig import all_profile_names
from marketplace.models import Gpu, GpuModel, GpuStatus, Node, Verdict
from marketplace.models.host import CUDA_VERSION_RE, cuda_version_code, cuda_version_text
from marketplace.models.nodes import slice_price_micros, slice_score_per_dollar
from marketplace.services.instances.booking import RUNTIME_REFUSED_OPTIONS
from marketplace.services.volumes import VOLUMELESS_RUNTIMES
from marketplace.stored_figures import finite_float, finite_int, nvlink_islands

from .offer_query import OfferQuery
from .offer_rows import OFFER_COLUMNS, mig_slices, offer_row


class FiniteFloatField(serializers.FloatField):
    """A figure of the stored benchmark summary: null where it is no finite float (stored_figures.finite_float)."""

    def to_representation(self, value: Any) -> Any:  # float | None (the stubs say str)
        return finite_float(value)


class FiniteIntegerField(serializers.IntegerField):
    """A whole-number figure of the stored summary: null where it is none within 64 bits (stored_figures.finite_int)."""

    def to_representation(self, value: Any) -> Any:  # int | None
        return finite_int(value)


class MedianFiguresSerializer(serializers.Serializer):
    bf16_tflops = FiniteFloatField(allow_null=True, required=False)
    tf32_tflops = FiniteFloatField(allow_null=True, required=False)
    fp32_tflops = FiniteFloatField(allow_null=True, required=False)
    memory_bandwidth_gbs = FiniteFloatField(allow_null=True, required=False)
    h2d_gbs = FiniteFloatField(allow_null=True, required=False, help_text="Pinned host-to-device GB/s.")
    cnn_train_images_s = FiniteFloatField(allow_null=True, required=False,
                                          help_text="The small CNN's training throughput, images/s.")
    cnn_infer_images_s = FiniteFloatField(allow_null=True, required=False)
    power_draw_w = FiniteFloatField(allow_null=True, required=False,
                                    help_text="The most a GPU drew under the benchmark's load, watts.")
    bf16_tflops_per_w = FiniteFloatField(
        allow_null=True, required=False,
        help_text="Measured BF16 TFLOP/s per watt drawn under that load (null until measured; never the datasheet).")


class NvlinkSummarySerializer(serializers.Serializer):
    connected = serializers.BooleanField(help_text="nvidia-smi shows NVLink between GPUs of the node.")
    islands = serializers.ListField(child=serializers.ListField(child=serializers.IntegerField()),
                                    help_text="GPU indices joined by NVLink, one list per island.")
    links_per_gpu = FiniteIntegerField(allow_null=True,
                                       help_text="The fewest active NVLink links of a GPU in an island.")
    p2p_gbs = FiniteFloatField(allow_null=True, help_text=(
        "Measured peer-to-peer copy GB/s: the median over NVLink pairs (over PCIe pairs without NVLink)."))
    pcie_p2p_gbs = FiniteFloatField(allow_null=True, help_text="The median over pairs not on NVLink.")

    def to_representation(self, instance: Any) -> Any:
        # Only GPU indices of the stored islands (stored_figures.nvlink_islands): one node's must not fail the offers.
        if isinstance(instance, dict):
            instance = {**instance, "islands": nvlink_islands(instance.get("islands"))}
        return super().to_representation(instance)


class OfferSliceSerializer(serializers.Serializer):
    gpu_model = serializers.CharField(help_text="The card's model slug.")
    mig_profile = serializers.CharField(help_text="The MIG profile, e.g. 3g.40gb (/api/v1/gpu-models/).")
    memory_gb = serializers.IntegerField(allow_null=True, help_text="The profile's nominal memory.")
    num_free = serializers.IntegerField(help_text="Free slices of this profile on the node.")
    price_per_slice_hour = UsdField(help_text="USD per slice-hour.")


class BenchmarkSummarySerializer(serializers.Serializer):
    checked_at = serializers.DateTimeField(required=False)
    verdict = serializers.CharField(required=False)
    median_per_gpu = MedianFiguresSerializer(required=False)
    nvlink = NvlinkSummarySerializer(required=False, allow_null=True, help_text=(
        "The GPUs' interconnect as the check read and measured it; null for one GPU or before it was read."))
    findings = serializers.ListField(child=serializers.CharField(), required=False)

    def to_representation(self, instance: Any) -> Any:
        # The stored summary's well-typed values only (stored_figures.summary, offer_rows.benchmark_summary's): a
        # value of the wrong kind is null, never a 500 (found by review).
        read = stored_figures.summary(instance)
        return None if read is None else super().to_representation(read)


def _runtime_help() -> str:
    """The offer's `runtime`'s help: what a booking on each runtime may not ask for (found by review: the booking
    refuses env, onstart, ports and volumes on a libvirt offer, b066232, and neither the field nor the schema said
    so). Written from the booking's and the volumes' own lists, so that it says what they refuse."""
    words = ["How the node runs instances."]  # the schema lists the runtimes (its enum's descriptions)
    for runtime, fields in RUNTIME_REFUSED_OPTIONS.items():
        named = [f"`{field}`" for field in fields]
        listed = named[0] if len(named) == 1 else f"{', '.join(named[:-1])} or {named[-1]}"
        words.append(f"A `{runtime}` offer takes no {listed} (its VMs cannot honour them yet): a booking "
                     "(POST /api/v1/instances/) giving any of them is refused with a 400 naming each, nothing booked.")
    for runtime in sorted(VOLUMELESS_RUNTIMES):
        words.append(f"No volume can be created on a `{runtime}` offer (POST /api/v1/volumes/: a 400 on `offer`).")
    return " ".join(words)


class OfferSerializer(serializers.ModelSerializer):
    gpu_model: serializers.SlugRelatedField[GpuModel] = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    gpu_model_name = serializers.CharField(source="gpu_model.name", read_only=True)
    num_gpus_free = serializers.IntegerField(read_only=True)
    num_gpus_total = serializers.IntegerField(source="gpu_count", read_only=True)
    gpu_memory_gb = serializers.IntegerField(source="gpu_model.memory_gb", read_only=True)
    price_per_gpu_hour = UsdField(source="price_per_gpu_hour_micros", read_only=True, help_text=(
        "USD per whole GPU-hour. Bookable only where num_gpus_free > 0: an offer with num_gpus_free 0 rents MIG "
        "slices only (mig_slices, priced per slice-hour), and no whole GPU can be booked at this price."))
    score_per_dollar = serializers.FloatField(read_only=True, help_text=(
        "score per USD per GPU-hour (the whole GPU's price: see price_per_gpu_hour)."))
    verified = serializers.SerializerMethodField(help_text="true when verified; false when listed as degraded.")
    country = serializers.CharField(read_only=True, help_text="ISO 3166-1 alpha-2.")
    benchmark = BenchmarkSummarySerializer(source="benchmark_summary", read_only=True, help_text=(
        "The last benchmark check: when, its verdict, the measured medians per GPU (null until measured) "
        "and the codes of its findings. Providers see the full history at /api/v1/nodes/{id}/benchmarks/."))
    platform_fee_percent = serializers.SerializerMethodField(
        help_text="The platform's share of the price (a decimal string, e.g. \"15.00\"): the renter pays "
                  "price_per_gpu_hour, the provider earns it minus this share. Fixed for a rental at booking.")
    disk_price_per_gb_month = UsdField(
        source="disk_price_per_gb_month_micros", read_only=True,
        help_text="USD per GB per 30-day month for volumes on this node and for an instance's disk while it is "
                  "stopped, billed per second; fixed for each volume and instance when created.")
    cpu_model = serializers.CharField(read_only=True, help_text="Read by the check from /proc/cpuinfo.")
    cpu_cores = serializers.IntegerField(read_only=True, allow_null=True, help_text="Logical CPUs of the host.")
    ram_gb = serializers.IntegerField(read_only=True, allow_null=True, help_text="Host RAM, GiB.")
    disk_free_gb = serializers.IntegerField(
        source="disk_left_gb", read_only=True, allow_null=True,
        help_text="GB of disk a booking or a volume can still ask for: what the server last reported free where "
                  "instances and volumes live, less the disks and volumes promised there since, and at most that "
                  "disk's size less every disk and volume live there (they fill as they are used). A larger "
                  "`disk_gb` is refused (409). Null until the server reports its disk (not judged then).")
    disk_bandwidth_mbs = serializers.FloatField(
        read_only=True, allow_null=True,
        help_text="MB/s measured by the check on that disk: the slower of a write (with fsync) and a read back.")
    driver_version = serializers.CharField(read_only=True, help_text="NVIDIA driver version.")
    cuda_version = serializers.SerializerMethodField(
        help_text="The highest CUDA version the node's driver runs (\"12.2\"); null until read.")
    pcie_gen = serializers.IntegerField(read_only=True, allow_null=True,
                                        help_text="PCIe generation of the GPUs' links (the lowest GPU's maximum).")
    pcie_width = serializers.IntegerField(read_only=True, allow_null=True,
                                          help_text="PCIe link width, lanes (the lowest GPU's maximum).")
    platform_to_node_mbps = serializers.FloatField(
        source="net_mbps", read_only=True, allow_null=True,
        help_text="Mbit/s measured by the platform itself, sending to the node over SSH during the check "
                  "(an encrypted stream from the platform's site: a floor for the node's own network, not its "
                  "internet bandwidth).")
    host_checked_at = serializers.DateTimeField(read_only=True, allow_null=True,
                                                help_text="When the host facts were measured.")
    nvlink = serializers.SerializerMethodField(help_text=(
        "true when at least two of the free GPUs share an NVLink island (nvlink_gpus_free >= 2), so that a booking "
        "of up to nvlink_gpus_free GPUs can get them on one island (require_nvlink in POST /api/v1/instances/). "
        "The server's own interconnect, free GPUs or not, is benchmark.nvlink."))
    nvlink_gpus_free = serializers.IntegerField(read_only=True, help_text=(
        "The most free GPUs on one NVLink island of the server (benchmark.nvlink.islands, as the check read them): "
        "a booking of that many or fewer can get GPUs all joined by NVLink; more span islands (PCIe between them). "
        "0 where the check found no NVLink."))
    mig_slices = serializers.SerializerMethodField(help_text=(
        "MIG slices rentable on their own (POST /api/v1/instances/ with mig_profile), per profile with a free one."))

    class Meta:
        model = Node
        fields = [
            "id", "gpu_model", "gpu_model_name", "num_gpus_free", "num_gpus_total", "gpu_memory_gb",
            "price_per_gpu_hour", "country", "city", "datacenter", "reliability", "score", "score_per_dollar",
            "verified", "verdict", "runtime", "platform_fee_percent", "benchmark", "disk_price_per_gb_month",
            "cpu_model", "cpu_cores", "ram_gb", "disk_free_gb", "disk_bandwidth_mbs", "driver_version", "cuda_version",
            "pcie_gen", "pcie_width", "platform_to_node_mbps", "host_checked_at", "nvlink", "nvlink_gpus_free",
            "mig_slices",
        ]
        read_only_fields = fields
        extra_kwargs = {"runtime": {"help_text": _runtime_help()}}

    def get_platform_fee_percent(self, node) -> str:
        if not hasattr(self, "_fee_percent"):  # once per response, not per row
            self._fee_percent = str(fee_percent(platform_fee_bps()))
        return self._fee_percent

    def get_cuda_version(self, node) -> str | None:
        return cuda_version_text(node.cuda_version)

    @extend_schema_field(OfferSliceSerializer(many=True))
    def get_mig_slices(self, node):
        free = selectors.free_slices_by_node([node.pk]) if node.mig_prices_micros else {}
        return mig_slices(node.gpu_model.slug, node.mig_prices_micros, free.get(node.pk))

    def get_nvlink(self, node) -> bool:
        return node.nvlink_gpus_free >= 2  # offer_row's

    def get_verified(self, node) -> bool:
        return node.verdict == Verdict.VERIFIED


@extend_schema_field(OpenApiTypes.STR)
class GpuModelSlugFilter(django_filters.ModelMultipleChoiceFilter):
    """GPU model slugs (an array of strings in the schema; the catalogue lives in the database)."""

    def filter(self, qs, value):
        # Without the parameter the value is an empty queryset (`.none()`), and django-filter's `not value`
        # would compile a query to learn it is empty: on every offers request that names no model.
        if isinstance(value, QuerySet) and value.query.is_empty():
            return qs
        return super().filter(qs, value)


class IntegerFilter(django_filters.NumberFilter):
    """A whole number: "0.5" is a 400, as the schema's `integer` says."""

    field_class = forms.IntegerField  # type: ignore[assignment]  # django-filter takes any form field class


# ordering name -> node column, for the host facts (nullable: ordered with nulls last)
HOST_ORDERINGS = {
    "cpu_cores": "cpu_cores", "ram_gb": "ram_gb", "disk_free_gb": "disk_left_gb",
    "disk_bandwidth_mbs": "disk_bandwidth_mbs", "cuda_version": "cuda_version", "pcie_gen": "pcie_gen",
    "pcie_width": "pcie_width", "platform_to_node_mbps": "net_mbps",
}
_NULLABLE_COLUMNS = set(HOST_ORDERINGS.values())


def _nulls_last(order):
    if not isinstance(order, str) or order.lstrip("-") not in _NULLABLE_COLUMNS:
        return order
    column = F(order.lstrip("-"))
    return column.desc(nulls_last=True) if order.startswith("-") else column.asc(nulls_last=True)


# The price orders, by a slice's price under `mig_profile` (OfferFilter.filter_queryset).
_SLICE_ORDERS = {"price_per_gpu_hour_micros": slice_price_micros, "score_per_dollar": slice_score_per_dollar}


def _per_slice(order, profile: str):
    """`order` by the price per slice-hour of `profile` where it orders by a price; others as they are."""
    if not isinstance(order, str) or order.lstrip("-") not in _SLICE_ORDERS:
        return order
    expression = _SLICE_ORDERS[order.lstrip("-")](profile)
    return expression.desc(nulls_last=True) if order.startswith("-") else expression.asc(nulls_last=True)


# A whole GPU of the node is free (OuterRef: the node). Without one the node rents MIG slices only, and its whole
# GPU's price is no price anyone can book (found by review: a card priced $0.10 whose slices cost $0.90 came first
# as the cheapest offer, and matched max_price_per_gpu_hour=0.2).
_WHOLE_GPU_FREE = Exists(Gpu.objects.filter(node=OuterRef("pk"), status=GpuStatus.FREE))
# The whole-GPU price order without mig_profile: by the whole GPU's price where a whole GPU is free; an offer of
# MIG slices only has none (null) and comes after every whole-GPU offer, ascending or descending. Not the
# score_per_dollar orders (the default among them): they are read in the order of an index (node_offer_spd_idx)
# and stop at the page's end, where this expression made PostgreSQL work out every candidate node's free GPUs and
# sort them all (bench/offers_search.py, the same run: no-filter p50 27.8 -> 47.2 ms). A slice-only offer keeps
# its whole GPU's score per dollar there; its row says it rents slices only (offers page: "MIG slices only").
_WHOLE_GPU_ORDERS = ("price_per_gpu_hour_micros",)


def _per_whole_gpu(order):
    """`order` by the whole GPU's price only where a whole GPU is free (slice-only offers last); others as they are."""
    if not isinstance(order, str) or order.lstrip("-") not in _WHOLE_GPU_ORDERS:
        return order
    expression = Case(When(_WHOLE_GPU_FREE, then=F(order.lstrip("-"))), default=Value(None))
    return expression.desc(nulls_last=True) if order.startswith("-") else expression.asc(nulls_last=True)


def profile_memory_gb(profile: str) -> int:
    """A MIG profile's memory per slice, GB: nominal, from its name ("3g.40gb": 40), as the catalogue gives it
    (marketplace.mig.MigProfile.memory_gb; the same on every model that has the profile)."""
    return int(profile.rsplit(".", 1)[1].removesuffix("gb"))


# Servers the check found NVLink-connected (containment: a node never read, no "nvlink" key, is not one).
_NVLINK_NODE = Q(benchmark_summary__contains={"nvlink": {"connected": True}})


def validate_cuda_version(value: str) -> None:
    if cuda_version_code(value) is None:
        raise DjangoValidationError("A CUDA version is major.minor, e.g. 12.2.")


@extend_schema_field({"type": "string", "pattern": CUDA_VERSION_RE.pattern, "example": "12.2"})
class CudaVersionFilter(django_filters.CharFilter):
    """A CUDA version, major.minor."""


COUNTRY_CHOICES = [(code, name) for code, name in countries]
COUNTRY_CODES = frozenset(code for code, _ in COUNTRY_CHOICES)
COUNTRY_HELP = "ISO 3166-1 alpha-2 code."


class CountryChoiceField(ChoiceField):
    """A set lookup, not Django's walk over ~250 normalized choices per validation."""

    def valid_value(self, value) -> bool:
        return str(value) in COUNTRY_CODES


def _country_choices():
    return COUNTRY_CHOICES


@extend_schema_field({"type": "string", "enum": [code for code, _ in COUNTRY_CHOICES], "description": COUNTRY_HELP})
class CountryFilter(django_filters.ChoiceFilter):
    """A country code. The choices are given as a callable so that the deep copies django-filter and
    Django forms make of every filter and form field on every request share the ~250 countries
    instead of copying them (that copying was over 1 ms of each offers request); the schema lists
    the codes all the same."""

    field_class = CountryChoiceField


@extend_schema_field(OpenApiTypes.BOOL)
class TrueFalseFilter(django_filters.ChoiceFilter):
    """`true` or `false`, nothing else: django-filter's BooleanFilter would read `maybe` as no filter at all."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, choices=[("true", "true"), ("false", "false")], **kwargs)


class SharedFields(dict):
    """A form's base_fields whose deep copy (Django's, once per form) is a new dict of the same field instances."""

    def __deepcopy__(self, memo):
        return dict(self)


class OfferFilter(StrictFilterSet):
    gpu_model = GpuModelSlugFilter(
        field_name="gpu_model__slug", to_field_name="slug", queryset=GpuModel.objects.all(),
        # A node has one model: the join cannot repeat rows, and the default DISTINCT would make
        # PostgreSQL sort every match on every column instead of reading the order off an index.
        distinct=False,
        help_text="GPU model slug; repeat the parameter for several.",
    )
    min_gpus = IntegerFilter(field_name="num_gpus_free", method="filter_min_gpus", min_value=1,
                             max_value=1000, help_text=(
                                 "At least this many free GPUs; with mig_profile, at least this many free slices of "
                                 "that profile (what num_gpus books then)."))
    min_gpu_memory_gb = IntegerFilter(
        field_name="gpu_model__memory_gb", method="filter_min_gpu_memory", min_value=0, max_value=100_000,
        help_text="GB of memory per GPU, at least; with mig_profile, per slice: that profile's memory (3g.40gb: 40), "
                  "what a booking with it gets.")
    max_price_per_gpu_hour = django_filters.NumberFilter(
        method="filter_max_price", min_value=0, max_value=Decimal("1000000"),
        help_text="USD per GPU-hour, matched by offers with a whole GPU free at that price or less: an offer of MIG "
                  "slices only (num_gpus_free 0) has no GPU-hour price and does not match (give mig_profile to "
                  "compare slices). With mig_profile, per slice-hour: that profile's price, what booking a slice "
                  "charges.")
    country = CountryFilter(choices=_country_choices, method="filter_country", help_text=COUNTRY_HELP)
    city = django_filters.CharFilter(field_name="city", lookup_expr="iexact", max_length=100)
    min_reliability = django_filters.NumberFilter(field_name="reliability", lookup_expr="gte", min_value=0,
                                                  max_value=1)
    min_score = django_filters.NumberFilter(field_name="score", lookup_expr="gte", min_value=0,
                                            max_value=1_000_000)
    # The host's facts, as the check measured them (a node not measured yet has null and matches no minimum).
    min_cpu_cores = IntegerFilter(field_name="cpu_cores", lookup_expr="gte", min_value=0, max_value=100_000)
    min_ram_gb = IntegerFilter(field_name="ram_gb", lookup_expr="gte", min_value=0, max_value=100_000_000)
    min_disk_free_gb = IntegerFilter(field_name="disk_left_gb", lookup_expr="gte", min_value=0,
                                     max_value=100_000_000, help_text="GB of disk left to book (disk_free_gb).")
    min_disk_bandwidth_mbs = django_filters.NumberFilter(field_name="disk_bandwidth_mbs", lookup_expr="gte",
                                                         min_value=0, max_value=1_000_000)
    min_pcie_gen = IntegerFilter(field_name="pcie_gen", lookup_expr="gte", min_value=1, max_value=10)
    min_pcie_width = IntegerFilter(field_name="pcie_width", lookup_expr="gte", min_value=1, max_value=64)
    min_platform_to_node_mbps = django_filters.NumberFilter(
        field_name="net_mbps", lookup_expr="gte", min_value=0, max_value=10_000_000,
        help_text="Mbit/s the platform measured to the node over SSH.")
    min_cuda_version = CudaVersionFilter(
        method="filter_min_cuda_version", max_length=5, validators=[validate_cuda_version],
        help_text="Nodes whose driver runs at least this CUDA version, e.g. 12.2.")
    mig_profile = django_filters.ChoiceFilter(method="filter_mig_profile", choices=[
        (name, name) for name in all_profile_names()], help_text=(
        "Only nodes with a free MIG slice of this profile, e.g. 3g.40gb (/api/v1/gpu-models/)."))
    nvlink = TrueFalseFilter(method="filter_nvlink", help_text=(
        "true: only offers with at least min_gpus (at least 2) free GPUs on one NVLink island (nvlink_gpus_free), "
        "which a booking of that many with require_nvlink gets; false: only offers whose `nvlink` is false (fewer "
        "than 2 free GPUs share an island). true with mig_profile is a 400: MIG slices have no NVLink "
        "(peer-to-peer) between them, and a booking refuses require_nvlink with mig_profile."))
    ordering = django_filters.OrderingFilter(
        fields=(
            ("price_per_gpu_hour_micros", "price_per_gpu_hour"),
            ("score", "score"),
            ("score_per_dollar", "score_per_dollar"),
            ("reliability", "reliability"),
            *((field, name) for name, field in HOST_ORDERINGS.items()),
        ),
        help_text="Prefix with - for descending. Default: -score_per_dollar. price_per_gpu_hour orders by the whole "
                  "GPU's price where a whole GPU is free; offers of MIG slices only (num_gpus_free 0) have no GPU-hour "
                  "price and come after the others, either way (score_per_dollar keeps the whole GPU's figure for "
                  "them). With mig_profile, price_per_gpu_hour and score_per_dollar order by that profile's price per "
                  "slice-hour.",
    )

    class Meta:
        model = Node
        fields: list[str] = []

    def __init__(self, data=None, queryset=None, *, request=None, prefix=None):
        # django-filter's own __init__, but each filter is copied shallowly instead of all deep-copied (the deep
        # copy, of querysets, choices and validators, was the largest single cost of an offers request left in
        # Python): a request's filters differ only in the model and parent set on them and in the FilterMethod
        # that a `method` filter binds to itself, which `method`'s setter makes anew for the copy.
        if queryset is None:
            queryset = self._meta.model._default_manager.all()
        self.is_bound = data is not None
        self.data = data or QueryDict()
        self.queryset = queryset
        self.request = request
        self.form_prefix = prefix
        self.filters = {}
        for name, base in self.base_filters.items():
            filter_ = copy.copy(base)
            if filter_.method is not None:
                filter_.method = filter_.method  # a FilterMethod bound to the copy, not to the base filter
            filter_.model = queryset.model
            filter_.parent = self
            self.filters[name] = filter_

    # The form fields are the same on every request: the form class is built once per FilterSet class, not 17
    # form fields with their labels and validators per request. The API's own form also shares its field
    # instances between requests instead of deep-copying them (validation only reads them); a subclass (the web
    # page's, which relabels and rewidgets its form's fields) keeps Django's deep copy.
    _form_classes: dict[type, type] = {}

    def get_form_class(self):
        cls = type(self)
        if cls not in OfferFilter._form_classes:
            form_class = super().get_form_class()
            if cls is OfferFilter:
                form_class.base_fields = SharedFields(form_class.base_fields)
            OfferFilter._form_classes[cls] = form_class
        return OfferFilter._form_classes[cls]

    def is_valid(self) -> bool:
        valid = super().is_valid()
        cleaned = getattr(self.form, "cleaned_data", {})
        if cleaned.get("nvlink") == "true" and cleaned.get("mig_profile"):
            # Slices have no P2P, and booking refuses require_nvlink with mig_profile (found by review: the pair
            # narrowed the list by whole free GPUs on an island, which a slice booking never gets).
            message = "nvlink=true and mig_profile cannot go together: MIG slices have no NVLink between them."
            self.form.add_error("nvlink", message)
            self.form.add_error("mig_profile", message)
            valid = False
        return valid

    def filter_min_gpu_memory(self, queryset, name, value: int):
        profile = self.form.cleaned_data.get("mig_profile")
        if profile:
            # Per slice: what a booking with the profile gets (found by review: 10 GB slices matched "at least
            # 40"). The profile's memory is a constant; compared in SQL so that the value stays a parameter.
            return queryset.filter(GreaterThanOrEqual(Value(profile_memory_gb(profile)), value))
        return queryset.filter(gpu_model__memory_gb__gte=value)

    def filter_min_gpus(self, queryset, name, value: int):
        profile = self.form.cleaned_data.get("mig_profile")
        if not profile and self.form.cleaned_data.get("nvlink") == "true":
            # That many free on one island (filter_nvlink leaves it to this, so that the request's min_gpus is one
            # parameter of the SQL: offer_query's slots). It implies num_gpus_free >= value.
            return queryset.filter(_NVLINK_NODE, nvlink_gpus_free__gte=Greatest(Value(value), Value(2)))
        if profile:
            # Slices, as num_gpus counts them in a booking with mig_profile (found by review: whole free GPUs hid a
            # server whose cards are all split). Counted for the nodes with a free slice of it (filter_mig_profile).
            free = selectors.free_slices(profile).order_by().values("node").annotate(n=Count("*")).values("n")
            return queryset.filter(GreaterThanOrEqual(Subquery(free), value))
        # Not num_gpus_free >= value: that counts the free GPUs of every candidate node one by one.
        return selectors.offers_with_free_gpus(queryset, at_least=value)

    def filter_max_price(self, queryset, name, value):
        profile = self.form.cleaned_data.get("mig_profile")
        if profile:
            # The price per slice-hour of that profile, what booking a slice charges (found by review: the whole
            # GPU's price hid the cheap slices). A node that does not price the profile books none (null here),
            # and filter_mig_profile leaves it out anyway.
            return queryset.filter(LessThanOrEqual(slice_price_micros(profile), usd_bound_to_micros(value)))
        # The whole GPU's price, where a whole GPU is free: a node of MIG slices only books none at it.
        return queryset.filter(_WHOLE_GPU_FREE, price_per_gpu_hour_micros__lte=usd_bound_to_micros(value))

    def filter_country(self, queryset, name, value):
        return queryset.filter(country=value)

    def filter_mig_profile(self, queryset, name, value):
        return queryset.filter(Exists(selectors.free_slices(value)))

    def filter_nvlink(self, queryset, name, value):
        # About the free GPUs, not the server (found by review: islands [[0,1],[2,3]] with GPUs 1 and 2 free was
        # listed for min_gpus=2, and its booking got two GPUs over PCIe). The containment first: only NVLink
        # servers' free GPUs are counted against their islands.
        if value == "true":
            if self.form.cleaned_data.get("min_gpus") and not self.form.cleaned_data.get("mig_profile"):
                return queryset  # filter_min_gpus: that many on one island
            return queryset.filter(_NVLINK_NODE, nvlink_gpus_free__gte=2)
        return queryset.exclude(_NVLINK_NODE & Q(nvlink_gpus_free__gte=2))

    def filter_min_cuda_version(self, queryset, name, value):
        return queryset.filter(cuda_version__gte=cuda_version_code(value))

    def filter_queryset(self, queryset):
        queryset = super().filter_queryset(queryset)
        if not self.form.cleaned_data.get("ordering"):
            queryset = queryset.order_by("-score_per_dollar")
        else:  # nodes not measured yet (null) come last either way, not first in descending orders
            queryset = queryset.order_by(*(_nulls_last(o) for o in queryset.query.order_by))
        profile = self.form.cleaned_data.get("mig_profile")
        if profile:  # by what a slice of it costs, as max_price_per_gpu_hour then (found by review)
            queryset = queryset.order_by(*(_per_slice(o, profile) for o in queryset.query.order_by))
        else:  # by the whole GPU's price where one is free; slice-only offers last
            queryset = queryset.order_by(*(_per_whole_gpu(o) for o in queryset.query.order_by))
        # A unique tie-breaker keeps pages stable.
        return queryset.order_by(*queryset.query.order_by, "id")


@extend_schema(tags=["offers"])
class OfferViewSet(viewsets.ReadOnlyModelViewSet):
    """Bookable GPUs: active, verified (or degraded) nodes with free GPUs. Public."""

    api_scope = PUBLIC  # core/api/scopes.py
    serializer_class = OfferSerializer
    filterset_class = OfferFilter
    permission_classes = [permissions.AllowAny]
    renderer_classes = [FastJSONRenderer]  # the same JSON as JSONRenderer, a few times faster

    def get_queryset(self):
        return selectors.offers_search()

    def list(self, request, *args, **kwargs):
        # The page is read as tuples and written by offer_row: OfferSerializer's JSON (and still its schema,
        # through serializer_class) without two model instances per row. Same COUNT and filters.
        # The COUNT and the page run from SQL compiled once per query shape (offer_query.py), with the filters'
        # parameters; the filterset still validates every request (its 400s).
        base = selectors.offers_search(values_list=OFFER_COLUMNS)
        backend = FilterBackend()
        backend.reject_unknown_params(request, base, self)  # not through filter_queryset: said here
        filterset = backend.get_filterset(request, base, self)
        if not filterset.is_valid():
            raise translate_validation(filterset.errors)
        rows = self.paginate_queryset(OfferQuery(filterset, base))
        fee = str(fee_percent(platform_fee_bps()))
        # The free MIG slices of the page's nodes that have MIG prices: one query, none on a page without MIG.
        mig_prices = OFFER_COLUMNS.index("mig_prices_micros")
        slices = selectors.free_slices_by_node([row[0] for row in rows if row[mig_prices]])
        return self.get_paginated_response([offer_row(row, fee, slices) for row in rows])
