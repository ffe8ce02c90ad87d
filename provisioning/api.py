"""`GET /api/v1/nodes/{id}/benchmarks/`: a node's verification history, newest first: the verdict, the
reasons (findings), the score and the measured figures of each run.

The node's provider and operators see it; for anyone else the node does not exist (404), as for the node
itself. Renters see a summary on the offer instead.
"""
from django.http import Http404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import generics, serializers

from core.api.scopes import PROVIDER_ONLY
from marketplace import selectors
from provisioning.models import VerificationRun


class FindingSerializer(serializers.Serializer):
    severity = serializers.ChoiceField(choices=["reject", "degrade"],
                                       help_text="reject: the node is not listed; degrade: listed, flagged.")
    code = serializers.CharField(help_text="Stable code, e.g. bf16_low, power_capped, wrong_results.")
    message = serializers.CharField(help_text="What was found and what to do about it.")
    gpu_index = serializers.IntegerField(allow_null=True, help_text="The GPU concerned (nvidia-smi index).")


class BenchmarkRunSerializer(serializers.ModelSerializer):
    findings = FindingSerializer(many=True, read_only=True)
    figures = serializers.JSONField(
        read_only=True, help_text="Measured figures per GPU (TFLOP/s, GB/s, images/s), their share of the "
                                  "datasheet, telemetry, and the node's medians. Empty when nothing was measured.")
    score = serializers.FloatField(allow_null=True, read_only=True,
                                   help_text="Per GPU; 100 = an A100 80GB SXM at its datasheet figures.")
    job_id = serializers.IntegerField(allow_null=True, read_only=True)

    class Meta:
        model = VerificationRun
        fields = ["id", "created_at", "verdict", "score", "findings", "figures", "job_id"]
        read_only_fields = fields


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
        node_id = str(self.kwargs["id"])
        if not node_id.isdigit() or len(node_id) > 18:
            raise Http404
        # Only whether the caller may see it: not its GPUs.
        node = selectors.nodes_for_user(user=self.request.user).prefetch_related(None).filter(pk=int(node_id)).first()
        if node is None:
            raise Http404
        return VerificationRun.objects.filter(node=node).order_by("-created_at", "-id")
