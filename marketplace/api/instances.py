"""Instances: book GPUs of an offer, follow the instance, stop / start / restart / destroy it.

Thin: the serializers check the input, marketplace.services.instances holds every rule
(allocation, idempotency, the state machine), and errors come back through api.errors.
"""

from typing import Any

import django_filters
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiResponse,
    extend_schema,
    extend_schema_field,
    extend_schema_view,
)
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from billing.services.metering import fee_percent, instance_cost_so_far
from core.api.fields import StrictFieldsMixin, UsdField
from core.api.filtering import reject_unknown_params
from core.api.idempotency import idempotency_key as idempotency_key_of
from core.api.idempotency import idempotency_parameter
from core.api.schema import ErrorDetailSerializer
from core.api.scopes import RENTER_ONLY
from core.validators import no_control_characters
from marketplace.models import GpuModel, Image, Instance, InstanceStatus, SshKey
from marketplace.selectors import instance_ssh_command
from marketplace.services import instances as svc
from marketplace.services import ssh_keys as ssh_svc
from marketplace.validators import NAME_MAX_LENGTH, validate_instance_keys


class _BlankAsNullCharField(serializers.CharField):
    def to_representation(self, value):
        return value or None


class InstanceVolumeSerializer(serializers.Serializer):
    volume = serializers.IntegerField(source="volume_id", help_text="The volume's id (/api/v1/volumes/).")
    name = serializers.CharField(source="volume.name", required=False)
    mount = serializers.CharField(help_text="Where it is mounted in the instance.")


class VolumeAttachSerializer(StrictFieldsMixin, serializers.Serializer):
    volume = serializers.IntegerField(min_value=1, max_value=2**63 - 1, help_text="One of your volumes, on the "
                                                                                  "offer's node, available.")
    mount = serializers.CharField(max_length=255, trim_whitespace=False, help_text=(
        "An absolute, normalised path in the instance, e.g. /data: not /, not under /proc, /sys or /dev."))


class VolumesField(serializers.ListField):
    """A list of VolumeAttachSerializer objects whose errors come back flat, as the API's error shape says:
    {"volumes": ["volumes[0].mount: This field is required."]}, not nested per item."""

    child = VolumeAttachSerializer()

    def to_internal_value(self, data):
        try:
            return super().to_internal_value(data)
        except serializers.ValidationError as exc:
            raise serializers.ValidationError(_flat_errors(exc.detail)) from None


def _flat_errors(detail, prefix="volumes") -> list[str]:
    if isinstance(detail, dict):
        return [m for key, value in detail.items()
                for m in _flat_errors(value, f"{prefix}[{key}]" if str(key).isdigit() else f"{prefix}.{key}")]
    if isinstance(detail, list):
        return [m for item in detail for m in _flat_errors(item, prefix)]
    return [f"{prefix}: {detail}"]


class InstanceSerializer(serializers.ModelSerializer):
    node = serializers.IntegerField(source="node_id", read_only=True, help_text="The offer (node) it runs on.")
    gpu_model: serializers.SlugRelatedField[GpuModel] = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    gpus = serializers.SerializerMethodField(help_text="Indices (on the node) of the GPUs it holds now.")
    image: serializers.SlugRelatedField[Image] = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    ssh_host = _BlankAsNullCharField(read_only=True, allow_null=True)
    ssh_user = _BlankAsNullCharField(read_only=True, allow_null=True)
    ssh_command = serializers.SerializerMethodField(help_text="How to log in, once running.")
    ssh_public_keys = serializers.ListField(child=serializers.CharField(), read_only=True,
                                            help_text="The keys put on the instance at creation.")
    price_per_hour = UsdField(source="price_per_hour_micros", read_only=True,
                              help_text="USD per hour for all its GPUs, fixed at booking.")
    price_per_gpu_hour = UsdField(source="price_per_gpu_hour_micros", read_only=True,
                                  help_text="USD per GPU-hour, fixed at booking.")
    platform_fee_percent = serializers.SerializerMethodField(
        help_text="The platform's share of the price, fixed at booking (a decimal string, e.g. \"15.00\"); "
                  "the provider earns the rest.")
    cost_so_far = serializers.SerializerMethodField(
        help_text="USD charged so far for its GPU time, including this run's seconds not metered yet. Billed "
                  "per second while running; a stopped instance's disk is billed apart (`disk_cost_so_far`).")
    disk_price_per_gb_month = UsdField(
        source="disk_price_per_gb_month_micros", read_only=True,
        help_text="USD per GB per 30-day month for its disk while it is stopped: the node's published disk price "
                  "at booking. Billed per second from the stop until it starts again or is destroyed.")
    disk_cost_so_far = UsdField(source="disk_cost_micros", read_only=True, max_digits=18,
                                help_text="USD charged so far for its disk while stopped (metered every minute).")
    volumes = serializers.SerializerMethodField(help_text="The volumes mounted in it: [{volume, name, mount}].")

    class Meta:
        model = Instance
        fields = [
            "id", "status", "status_message", "node", "gpu_model", "num_gpus", "gpus", "image", "label", "disk_gb",
            "ssh_host", "ssh_port", "ssh_user", "ssh_command", "ssh_public_keys", "price_per_hour",
            "price_per_gpu_hour", "platform_fee_percent", "cost_so_far", "disk_price_per_gb_month",
            "disk_cost_so_far", "volumes",
            "created_at", "started_at", "stopped_at", "destroyed_at", "updated_at",
        ]
        read_only_fields = fields

    def get_platform_fee_percent(self, instance) -> str:
        return str(fee_percent(instance.platform_fee_bps))

    @extend_schema_field(UsdField(read_only=True, max_digits=18))
    def get_cost_so_far(self, instance):
        return UsdField(max_digits=18).to_representation(instance_cost_so_far(instance=instance))

    @extend_schema_field(InstanceVolumeSerializer(many=True))
    def get_volumes(self, instance):
        return InstanceVolumeSerializer(instance.volume_mounts.all(), many=True).data

    def get_gpus(self, instance) -> list[int]:
        return svc.instance_gpu_indices(instance=instance)

    def get_ssh_command(self, instance) -> str | None:
        return instance_ssh_command(instance)


@extend_schema_field(OpenApiTypes.INT)
class _OwnKeys(serializers.PrimaryKeyRelatedField):
    def get_queryset(self):
        request = self.context.get("request")
        if request is None or not request.user.is_authenticated:
            return SshKey.objects.none()
        return SshKey.objects.filter(user=request.user)


class InstanceCreateSerializer(StrictFieldsMixin, serializers.Serializer):
    offer = serializers.IntegerField(min_value=1, max_value=2**63 - 1,
                                     help_text="The offer's `id` from /api/v1/offers/ (a node).")
    num_gpus = serializers.IntegerField(min_value=1, max_value=64,
                                        help_text="How many of the offer's free GPUs to rent.")
    image = serializers.SlugRelatedField(slug_field="slug", queryset=Image.objects.filter(active=True),
                                         help_text="An image `slug` from /api/v1/images/.")
    ssh_keys = _OwnKeys(many=True, required=False, help_text="Ids of your SSH keys (/api/v1/ssh-keys/).")
    ssh_public_key = serializers.CharField(
        max_length=ssh_svc.MAX_KEY_CHARS, required=False,
        help_text="One more OpenSSH public key, not stored among your keys. "
                  "At least one of `ssh_keys` and `ssh_public_key` is required.",
    )
    disk_gb = serializers.IntegerField(min_value=1, max_value=svc.MAX_DISK_GB, required=False,
                                       help_text="Disk size; at least the image's `min_disk_gb` (the default).")
    volumes = VolumesField(required=False, max_length=8, help_text=(
        "Your volumes to mount (at most 8), all on the offer's node: [{\"volume\": id, \"mount\": \"/data\"}]. "
        "Kept across stop/start and after the instance is destroyed."))
    label = serializers.CharField(  # type: ignore[assignment]  # a declared field (DRF's metaclass takes it)
        max_length=NAME_MAX_LENGTH, required=False, default="", allow_blank=True, validators=[no_control_characters])
    schema_presence = {"anyOf": [{"required": ["ssh_keys"], "properties": {"ssh_keys": {"minItems": 1}}},
                                 {"required": ["ssh_public_key"]}]}  # validate() below

    def validate_ssh_keys(self, keys):
        validate_instance_keys(keys)
        return keys

    def validate_ssh_public_key(self, value):
        try:
            return ssh_svc.parse_public_key(value).public_key
        except ssh_svc.InvalidSshKey as exc:
            raise serializers.ValidationError(str(exc)) from None

    def validate(self, attrs):
        if not attrs.get("ssh_keys") and not attrs.get("ssh_public_key"):
            raise serializers.ValidationError(
                {"ssh_keys": ["Give at least one SSH key: `ssh_keys` (ids of your keys) and/or `ssh_public_key`."]}
            )
        return attrs


class InstanceFilter(django_filters.FilterSet):
    status = django_filters.MultipleChoiceFilter(choices=InstanceStatus.choices,
                                                 help_text="Repeat the parameter for several.")

    class Meta:
        model = Instance
        fields: list[str] = []


_CONFLICT = OpenApiResponse(ErrorDetailSerializer, "The instance's (or its node's) state forbids this; "
                                                   "`detail` says why.")
_VERB: dict[str, Any] = {"request": None, "responses": {202: InstanceSerializer, 409: _CONFLICT}}


@extend_schema_view(
    list=extend_schema(summary="Your instances"),
    retrieve=extend_schema(summary="One of your instances"),
    create=extend_schema(
        summary="Rent GPUs: create an instance",
        request=InstanceCreateSerializer,
        parameters=[idempotency_parameter(
            "Makes retries safe: the same key and body return the same instance (200); "
            "the same key with another body is a 422. 1-100 printable ASCII characters.",
        )],
        responses={
            201: InstanceSerializer,
            200: OpenApiResponse(InstanceSerializer, "The instance an earlier request with this Idempotency-Key "
                                                     "created."),
            402: OpenApiResponse(ErrorDetailSerializer, "Your balance is less than one hour of what your running "
                                                        "and starting instances cost with this one; `detail` gives "
                                                        "the burn rate counted and how much to top up."),
            409: OpenApiResponse(ErrorDetailSerializer, "Not enough free GPUs on the node, or the offer is not "
                                                        "available now."),
            422: OpenApiResponse(ErrorDetailSerializer, "The Idempotency-Key was used for a different request."),
        },
    ),
    destroy=extend_schema(summary="Destroy an instance (its disk too)", responses={
        202: OpenApiResponse(InstanceSerializer, "Destroying; again while destroying is a no-op."),
        409: OpenApiResponse(ErrorDetailSerializer, "Already destroyed."),
    }),
    stop=extend_schema(summary="Stop a running instance (keeps the disk, frees the GPUs)",
                       description="Billing for GPU time ends when you ask to stop. While stopped, its disk is "
                                   "billed per second at `disk_price_per_gb_month` (the node's published disk "
                                   "price at booking).", **_VERB),
    start=extend_schema(summary="Start a stopped instance (on the same GPUs when free)",
                        description="Needs one hour of what your running and starting instances cost with this "
                                    "one in your balance (else 402). Billing resumes once it is running.",
                        request=None, responses={202: InstanceSerializer, 409: _CONFLICT,
                                                 402: OpenApiResponse(ErrorDetailSerializer, "Your balance is less "
                                                                      "than one hour of what your running and "
                                                                      "starting instances cost with this one.")}),
    restart=extend_schema(summary="Restart (reboot) a running instance", **_VERB),
)
@extend_schema(tags=["instances"])
class InstanceViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Your instances; another user's instance is a 404. Verbs answer 202 while a worker acts."""

    api_scope = RENTER_ONLY  # core/api/scopes.py
    serializer_class = InstanceSerializer
    filterset_class = InstanceFilter
    queryset = Instance.objects.none()  # for the schema; get_queryset scopes to the user

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return self.queryset
        return svc.instances_for_user(user=self.request.user)

    def _render(self, instance, code=status.HTTP_200_OK):
        fresh = self.get_queryset().get(pk=instance.pk)
        return Response(InstanceSerializer(fresh).data, status=code)

    def list(self, request, *args, **kwargs):
        reject_unknown_params(request, InstanceFilter.base_filters)
        return super().list(request, *args, **kwargs)

    def create(self, request):
        idempotency_key, fingerprint = idempotency_key_of(request)
        if idempotency_key:  # a retry gets what the first request made, even if its input would not validate now
            earlier = svc.instance_for_idempotency_key(renter=request.user, idempotency_key=idempotency_key,
                                                       request_fingerprint=fingerprint)
            if earlier is not None:
                return self._render(earlier)
        data = InstanceCreateSerializer(data=request.data, context=self.get_serializer_context())
        data.is_valid(raise_exception=True)
        v = data.validated_data
        public_keys = [k.public_key for k in v.get("ssh_keys", [])]
        if v.get("ssh_public_key"):
            public_keys.append(v["ssh_public_key"])
        instance, created = svc.instance_create(
            renter=request.user, node_id=v["offer"], num_gpus=v["num_gpus"], image=v["image"],
            ssh_public_keys=public_keys, disk_gb=v.get("disk_gb"), label=v["label"],
            idempotency_key=idempotency_key, request_fingerprint=fingerprint, volumes=v.get("volumes"),
        )
        return self._render(instance, status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    def destroy(self, request, pk=None):
        return self._render(svc.instance_destroy(instance=self.get_object()), status.HTTP_202_ACCEPTED)

    @action(detail=True, methods=["post"])
    def stop(self, request, pk=None):
        return self._render(svc.instance_stop(instance=self.get_object()), status.HTTP_202_ACCEPTED)

    @action(detail=True, methods=["post"])
    def start(self, request, pk=None):
        return self._render(svc.instance_start(instance=self.get_object()), status.HTTP_202_ACCEPTED)

    @action(detail=True, methods=["post"])
    def restart(self, request, pk=None):
        return self._render(svc.instance_restart(instance=self.get_object()), status.HTTP_202_ACCEPTED)

