"""The images renters start instances from. Public, like the offers they go with."""
from drf_spectacular.utils import extend_schema, extend_schema_field, extend_schema_view
from rest_framework import permissions, serializers, viewsets

from core.api.scopes import PUBLIC
from marketplace.models import Image, Runtime
from marketplace.services.instances.options import catalogue_images, image_runtimes


class ImageSerializer(serializers.ModelSerializer):
    runtimes = serializers.SerializerMethodField(
        help_text="The node runtimes that can run this image; an offer's `runtime` must be one of them. `sim` "
                  "only where the platform offers simulated nodes (a demo)."
    )

    class Meta:
        model = Image
        fields = ["slug", "name", "description", "runtimes", "docker_image", "libvirt_image", "min_disk_gb"]
        read_only_fields = fields

    @extend_schema_field({"type": "array", "items": {"type": "string", "enum": list(Runtime.values)}})
    def get_runtimes(self, image) -> list[str]:
        return image_runtimes(image)


@extend_schema_view(
    list=extend_schema(summary="Images to start an instance from"),
    retrieve=extend_schema(summary="One image"),
)
@extend_schema(tags=["images"])
class ImageViewSet(viewsets.ReadOnlyModelViewSet):
    """Templates for instances (CUDA, PyTorch, TensorFlow), with what each node runtime needs. Public. Only images
    some offered runtime runs: where no simulated node is offered, not those with neither a container nor a VM
    image."""

    api_scope = PUBLIC  # core/api/scopes.py
    queryset = Image.objects.none()  # for the schema; get_queryset: catalogue_images (read per request: the setting)
    serializer_class = ImageSerializer
    permission_classes = [permissions.AllowAny]
    lookup_field = "slug"
    pagination_class = None

    def get_queryset(self):
        return catalogue_images()
