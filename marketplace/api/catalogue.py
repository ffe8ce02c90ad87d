"""The public GPU catalogue."""
from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import permissions, serializers, viewsets

from core.api.scopes import PUBLIC
from marketplace.mig import profiles_for
from marketplace.models import GpuModel


class MigProfileSerializer(serializers.Serializer):
    name = serializers.CharField(help_text="As nvidia-smi prints it, e.g. 3g.40gb.")
    compute_slices = serializers.IntegerField(help_text="Compute slices of the card's 7.")
    memory_slices = serializers.IntegerField(help_text="Memory slices of the card's 8.")
    memory_gb = serializers.IntegerField(help_text="Nominal memory, from the name.")
    compute_fraction = serializers.FloatField()
    memory_fraction = serializers.FloatField()


class GpuModelSerializer(serializers.ModelSerializer):
    mig_supported = serializers.BooleanField(read_only=True)
    mig_profiles = serializers.SerializerMethodField(help_text="The MIG profiles a provider may declare (per card at "
                                                               "most 7 compute and 8 memory slices).")

    @extend_schema_field(MigProfileSerializer(many=True))
    def get_mig_profiles(self, model) -> list[dict]:
        return [p.as_dict() for p in profiles_for(model.slug).values()]

    class Meta:
        model = GpuModel
        fields = [
            "slug", "name", "smi_name", "architecture", "form_factor", "memory_gb", "memory_mib", "memory_type",
            "memory_bandwidth_gbps", "fp32_tflops", "tf32_tflops", "bf16_tflops", "figures_note", "tdp_w",
            "pcie_gen", "pcie_lanes", "cuda_cores", "tensor_cores", "mig_supported", "mig_max_instances",
            "mig_profiles",
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
