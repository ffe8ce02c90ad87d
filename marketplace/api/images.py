"""The images renters start instances from. Public, like the offers they go with."""
from drf_spectacular.utils import extend_schema, extend_schema_field, extend_schema_view
from rest_framework import permissions, serializers, viewsets

from core.api.scopes import PUBLIC
from marketplace.models import Image, Runtime


class ImageSerializer(serializers.ModelSerializer):
    runtimes = serializers.SerializerMethodField(
        help_text="The node runtimes that can run this image; an offer's `runtime` must be one of them."
    )

    class Meta:
        model = Image
        fields = ["slug", "name", "description", "runtimes", "docker_image", "libvirt_image", "min_disk_gb"]
        read_only_fields = fields

    @extend_schema_field({"type": "array", "items": {"type": "string", "enum": list(Runtime.values)}})
    def get_runtimes(self, image) -> list[str]:
        return image.runtimes


@extend_schema_view(
    list=extend_schema(summary="Images to start an instance from"),
    retrieve=extend_schema(summary="One image"),
)
@extend_schema(tags=["images"])
class ImageViewSet(viewsets.ReadOnlyModelViewSet):
    """Templates for instances (CUDA, PyTorch, TensorFlow), with what each node runtime needs. Public."""

    api_scope = PUBLIC  # core/api/scopes.py
    queryset = Image.objects.filter(active=True)
    serializer_class = ImageSerializer
    permission_classes = [permissions.AllowAny]
    lookup_field = "slug"
    pagination_class = None
