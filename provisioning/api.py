"""`GET /api/v1/nodes/{id}/benchmarks/`: a node's verification history, newest first: the verdict, the
reasons (findings), the score and the measured figures of each run.

`GET /api/v1/nodes/{id}/events/`: what happened to the node (offline, back online, host key, GPUs, spot checks,
VMs, volumes, ...), newest first: the kinds its provider may see, each with a title, and its message only where it
is safe to show (provisioning/node_event_kinds.py).

The node's provider sees them, and operators allowed to see the node and its runs (or events) in the admin
(`marketplace.view_node` or `change_node`, and `provisioning.view_verificationrun`, or `view_nodeevent`); for
anyone else the node does not exist (404), as for the node itself. Renters see a summary on the offer instead.
"""
from dataclasses import asdict

import django_filters
from django.http import Http404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field
from rest_framework import generics, serializers

from core.api.filtering import StrictFilterSet
from core.api.scopes import PROVIDER_ONLY
from marketplace import selectors
from marketplace.models import Node
from marketplace.stored_figures import run_figures, run_findings
from provisioning.models import NodeEvent, VerificationRun
from provisioning.node_event_kinds import node_events_for_provider, provider_message, provider_title
from provisioning.verification.model import DEGRADE, REJECT
from provisioning.verification.platform_figures import platform_checks

SEVERITIES = (REJECT, DEGRADE)  # a finding's, as the policy writes them


class ReadableFindingsSerializer(serializers.ListSerializer):
    """A run's stored findings (JSON of any shape, written from a node's answers; a row from before they were
    checked may hold a string, a list of strings, a finding whose message is no text) as the schema says them:
    only those stored_figures.run_findings reads whose severity is one of SEVERITIES; the rest left out, not a
    500 (found by review)."""

    def to_representation(self, data):
        return super().to_representation(
            [finding for finding in run_findings(data) if finding.get("severity") in SEVERITIES])


class FindingSerializer(serializers.Serializer):
    severity = serializers.ChoiceField(choices=list(SEVERITIES),
                                       help_text="reject: the node is not listed; degrade: listed, flagged.")
    code = serializers.CharField(help_text="Stable code, e.g. bf16_low, power_capped, wrong_results.")
    message = serializers.CharField(help_text="What was found and what to do about it.")
    gpu_index = serializers.IntegerField(allow_null=True, help_text="The GPU concerned (nvidia-smi index).")

    class Meta:
        list_serializer_class = ReadableFindingsSerializer


class PlatformCheckSerializer(serializers.Serializer):
    device = serializers.CharField(help_text="GPU <index>, or MIG <profile> <UUID> for a MIG slice.")
    challenge_tflops = serializers.FloatField(
        allow_null=True, help_text="BF16 TFLOP/s of the platform's secret matrix challenge, timed on the platform's "
                                   "clock (its SSH round trip taken off). Null: it did not answer.")
    challenge_share = serializers.FloatField(allow_null=True, help_text="challenge_tflops / the datasheet's BF16.")
    challenge_s = serializers.FloatField(allow_null=True, help_text="The challenge's seconds on the platform's clock.")
    challenge_correct = serializers.BooleanField(
        allow_null=True, help_text="Whether the products the platform recomputed itself were right.")
    memory_s = serializers.FloatField(
        allow_null=True, help_text="Seconds to re-read the whole memory-proof fill under a fresh salt, on the "
                                   "platform's clock. Null: not run or no answer.")
    memory_held = serializers.ChoiceField(
        choices=["yes", "late", "wrong"], allow_null=True,
        help_text="yes: the card holds its fill (re-read in time, every opening right); late: part of it is not on "
                  "the card; wrong: an opening did not prove it. Null: not run or no answer.")


class PlatformChecksSerializer(serializers.Serializer):
    gpus = PlatformCheckSerializer(many=True, help_text="Each GPU checked, then each MIG slice.")
    memory_gib = serializers.FloatField(allow_null=True, help_text="The memory proof's fill per GPU, GiB.")
    memory_deadline_s = serializers.FloatField(allow_null=True, help_text="Its re-read's deadline, seconds.")
    memory_not_run = serializers.CharField(help_text="Why the memory proof was not run; empty when it was.")


class StoredFiguresField(serializers.JSONField):
    """A run's stored figures as stored when they are an object; {} otherwise (a list or a string stored before the
    node's answers were checked reads as nothing measured)."""

    def to_representation(self, value):
        return super().to_representation(value if isinstance(value, dict) else {})


class BenchmarkRunSerializer(serializers.ModelSerializer):
    findings = FindingSerializer(many=True, read_only=True)
    figures = StoredFiguresField(
        read_only=True, help_text="Measured figures per GPU (TFLOP/s, GB/s, images/s), their share of the "
                                  "datasheet, telemetry, and the node's medians. Empty when nothing was measured.")
    score = serializers.FloatField(allow_null=True, read_only=True,
                                   help_text="Per GPU; 100 = an A100 80GB SXM at its datasheet figures.")
    platform_checks = serializers.SerializerMethodField(
        help_text="What the platform measured itself (figures.challenge, summarised): nothing the node reports "
                  "about itself. Null for a run without the challenge (every GPU rented, the server unreachable).")
    job_id = serializers.IntegerField(allow_null=True, read_only=True)

    class Meta:
        model = VerificationRun
        fields = ["id", "created_at", "verdict", "score", "findings", "platform_checks", "figures", "job_id"]
        read_only_fields = fields

    @extend_schema_field(PlatformChecksSerializer(allow_null=True))
    def get_platform_checks(self, run: VerificationRun) -> dict | None:
        # Read well-typed (stored_figures.run_figures): figures that are a list, a challenge GPU key that is no
        # index ("x"), a figure that is text were a 500 (found by review).
        checks = platform_checks(run_figures(run.figures))
        return asdict(checks) if checks is not None else None


# The admin shows verification runs to either (ModelAdmin.has_view_permission).
RUNS_PERMISSIONS = ("provisioning.view_verificationrun", "provisioning.change_verificationrun")


@extend_schema(
    tags=["nodes"], summary="The node's benchmark checks, newest first",
    parameters=[OpenApiParameter("id", OpenApiTypes.INT, OpenApiParameter.PATH, description="The node's id.")],
)
class NodeBenchmarksView(generics.ListAPIView):
    """Every verification of one of your nodes: verdict, reasons a provider can act on, score and figures."""

    api_scope = PROVIDER_ONLY  # core/api/scopes.py
    serializer_class = BenchmarkRunSerializer
    queryset = VerificationRun.objects.none()  # for the schema; get_queryset scopes to the node

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return self.queryset
        node = _node_shown(self.request.user, self.kwargs["id"], RUNS_PERMISSIONS)
        return VerificationRun.objects.filter(node=node).order_by("-created_at", "-id")


def _node_shown(user, raw_id, permissions: tuple[str, ...]) -> Node:
    """The node `raw_id` names, when `user` is its provider (a retired one too), or a live one to an operator who
    sees nodes and holds one of `permissions` (what the admin asks to show the rows); Http404 otherwise, and for an
    id that is no number. A retired node's record stays its provider's to read: its retirement's events
    (retired_by_operator, retired_unreachable: what was ended and deleted) are shown nowhere else (review r55)."""
    node_id = str(raw_id)
    if not (node_id.isascii() and node_id.isdigit()) or len(node_id) > 18:  # isdigit alone takes "²"
        raise Http404
    # Only whether the caller may see it: not its GPUs.
    node = (Node.objects.filter(pk=int(node_id), provider_id=user.pk).first()
            or selectors.nodes_for_user(user=user).prefetch_related(None).filter(pk=int(node_id)).first())
    if node is None or (node.provider_id != user.pk and not any(map(user.has_perm, permissions))):
        raise Http404  # another provider's rows: to operators the admin shows them to (found by review)
    return node


# The admin shows node events to either (NodeEventAdmin is read-only: the view permission).
EVENTS_PERMISSIONS = ("provisioning.view_nodeevent", "provisioning.change_nodeevent")


class NodeEventSerializer(serializers.ModelSerializer):
    title = serializers.SerializerMethodField(help_text="What happened, in a few words.")
    message = serializers.SerializerMethodField(
        help_text="The details as recorded, where they are safe to show the provider; empty otherwise (a message "
                  "naming an operator, or quoting the node agent's error text, which may quote a renter's VM).")

    class Meta:
        model = NodeEvent
        fields = ["id", "created_at", "level", "kind", "title", "message"]
        read_only_fields = fields

    def get_title(self, event: NodeEvent) -> str:
        return provider_title(event.kind)

    def get_message(self, event: NodeEvent) -> str:
        return provider_message(event)


class NodeEventFilter(StrictFilterSet):
    level = django_filters.ChoiceFilter(choices=NodeEvent.Level.choices, help_text="Only events of this level.")

    class Meta:
        model = NodeEvent
        fields: list[str] = []


@extend_schema(
    tags=["nodes"], summary="What happened to the node, newest first",
    parameters=[OpenApiParameter("id", OpenApiTypes.INT, OpenApiParameter.PATH, description="The node's id.")],
)
class NodeEventsView(generics.ListAPIView):
    """The events of one of your nodes that concern you (offline and back online, host key, GPUs lost and back,
    spot checks, inventory changes, VMs and volumes found missing or lost, instances interrupted, verification
    retries, ...): the platform's record of what it saw and did on the server."""

    api_scope = PROVIDER_ONLY  # core/api/scopes.py
    serializer_class = NodeEventSerializer
    filterset_class = NodeEventFilter
    queryset = NodeEvent.objects.none()  # for the schema; get_queryset scopes to the node

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return self.queryset
        node = _node_shown(self.request.user, self.kwargs["id"], EVENTS_PERMISSIONS)
        return node_events_for_provider(node_id=node.pk)
