"""The public GPU catalogue."""
from drf_spectacular.utils import extend_schema
from rest_framework import permissions, serializers, viewsets

from core.api.scopes import PUBLIC
from marketplace.models import GpuModel


class GpuModelSerializer(serializers.ModelSerializer):
    mig_supported = serializers.BooleanField(read_only=True)

    class Meta:
        model = GpuModel
        fields = [
            "slug", "name", "smi_name", "architecture", "form_factor", "memory_gb", "memory_mib", "memory_type",
            "memory_bandwidth_gbps", "fp32_tflops", "tf32_tflops", "bf16_tflops", "figures_note", "tdp_w",
            "pcie_gen", "pcie_lanes", "cuda_cores", "tensor_cores", "mig_supported", "mig_max_instances",
        ]
        read_only_fields = fields


@extend_schema(tags=["catalogue"])
class GpuModelViewSet(viewsets.ReadOnlyModelViewSet):
    """Datasheet figures (dense, no sparsity) of every GPU model the marketplace knows."""

    api_scope = PUBLIC  # core/api/scopes.py
    queryset = GpuModel.objects.all()
    serializer_class = GpuModelSerializer
    permission_classes = [permissions.AllowAny]
    lookup_field = "slug"
    pagination_class = None
