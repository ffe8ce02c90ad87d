"""Renters' volumes: create on an offer's node, list, read, delete (explicit, confirmed by the volume's name)."""
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_field, extend_schema_view
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.response import Response

from billing.selectors import storage_given_back_micros
from core.api.fields import StrictFieldsMixin, UsdField
from core.api.idempotency import idempotency_key as idempotency_key_of
from core.api.idempotency import idempotency_parameter
from core.api.schema import CodedErrorSerializer, ErrorDetailSerializer
from core.api.scopes import RENTER_ONLY
from core.validators import no_control_characters
from marketplace.models import Volume
from marketplace.models.volumes import MAX_VOLUME_GB
from marketplace.selectors import instances_awaiting_cleanup_by_node, volumes_with_given_back
from marketplace.services import volumes as svc
from marketplace.validators import NAME_MAX_LENGTH


class VolumeMountSerializer(serializers.Serializer):
    instance = serializers.IntegerField(source="instance_id")
    mount = serializers.CharField()
    instance_status = serializers.CharField(source="instance.status")


class VolumeSerializer(serializers.ModelSerializer):
    node = serializers.IntegerField(source="node_id", read_only=True, help_text="The node (offer id) it lives on.")
    price_per_gb_month = UsdField(source="price_per_gb_month_micros", read_only=True, help_text=(
        "USD per GB per 30-day month, the node's published disk price when the volume was created; billed per "
        "second while the volume exists (from `available_at` until its deletion is asked for)."))
    cost_so_far = serializers.SerializerMethodField(
        help_text="USD paid so far (metered every minute): what was charged, less what was given back of it since "
                  "(an adjustment line of your statement).")
    mounts = VolumeMountSerializer(many=True, read_only=True,
                                   help_text="The instances it was mounted in, and where (live or not).")
    in_use_by = serializers.SerializerMethodField(help_text=(
        "Ids of the instances that hold it: while any does, it cannot be deleted (409) or mounted elsewhere. An "
        "instance that mounts it holds it until it is destroyed; a failed one only if it ran (its VM is kept on "
        "the node, stopped, until you destroy the instance), and no longer once its VM is known gone from the node "
        "(the instance's `vm_gone`). Any of them, destroyed or failed, also holds it while "
        "its VM is still to be removed from the node (e.g. destroyed while the node could not be reached: until "
        "the node answers again)."))

    class Meta:
        model = Volume
        fields = ["id", "name", "label", "node", "size_gb", "state", "status_message", "price_per_gb_month",
                  "cost_so_far", "mounts", "in_use_by", "created_at", "available_at", "deleted_at"]
        read_only_fields = fields

    @extend_schema_field(UsdField(read_only=True, max_digits=18))
    def get_cost_so_far(self, volume):
        # Net of an operator's reversals of its storage charges, as the ledger says; before, cost_micros (what was
        # charged). Carried by the viewset's queryset (marketplace.selectors.volumes_with_given_back); one query
        # otherwise.
        given_back = getattr(volume, "given_back_micros", None)
        if given_back is None:
            given_back = storage_given_back_micros("volume", ids=[volume.pk]).get(volume.pk, 0)
        return UsdField(max_digits=18).to_representation(volume.cost_micros - given_back)

    def get_in_use_by(self, volume) -> list[int]:
        # What refuses its delete (services.volumes._live_mount), as the web page lists them: also the instances
        # over whose VM is still on the node, which volume_live_instance_ids leaves out (an empty list with a 409 on
        # delete: found by review). The list's context carries those for the page's nodes (one read); else
        # volume_holder_ids reads them for this volume's node (one read).
        return svc.volume_holder_ids(volume, awaiting_cleanup=self.context.get("awaiting_cleanup"))


class VolumeCreateSerializer(StrictFieldsMixin, serializers.Serializer):
    offer = serializers.IntegerField(min_value=1, max_value=2**63 - 1,
                                     help_text="The offer's `id` from /api/v1/offers/: the node the volume lives on.")
    size_gb = serializers.IntegerField(min_value=1, max_value=MAX_VOLUME_GB)
    label = serializers.CharField(  # type: ignore[assignment]  # a declared field (DRF's metaclass takes it)
        max_length=NAME_MAX_LENGTH, required=False, default="", allow_blank=True, validators=[no_control_characters])


class VolumeDeleteSerializer(StrictFieldsMixin, serializers.Serializer):
    # Not required by the schema: a missing or wrong name gets the service's answer, which says the name to send.
    confirm = serializers.CharField(max_length=40, required=False, allow_blank=True, default="",
                                    help_text="The volume's `name` (vol-...): deleting cannot be undone.")


_CONFLICT = OpenApiResponse(ErrorDetailSerializer, "An instance holds it (`in_use_by`), or its state forbids "
                                                   "this; `detail` says why.")


@extend_schema_view(
    list=extend_schema(summary="Your volumes (deleted ones are left out)"),
    retrieve=extend_schema(summary="One of your volumes"),
    create=extend_schema(summary="Create a volume on an offer's node", request=VolumeCreateSerializer, parameters=[
        idempotency_parameter("Makes retries safe: the same key and body return the same volume (200), billed "
                              "once; the same key with another body is a 422. 1-100 printable ASCII characters."),
    ], responses={
        201: VolumeSerializer,
        200: OpenApiResponse(VolumeSerializer, "The volume an earlier request with this Idempotency-Key created."),
        402: OpenApiResponse(ErrorDetailSerializer, "Your balance is less than one hour of what your running and "
                                                    "starting instances and your storage (volumes, those being "
                                                    "created too, and stopped instances' disks) cost with this "
                                                    "volume; `detail` names the figures and how much to top up."),
        403: OpenApiResponse(CodedErrorSerializer, "`code` `email_not_verified`: your e-mail address is not "
                                                   "verified yet (POST /api/v1/auth/verify-email/ sends the link "
                                                   "again); or the API key lacks the `renter` scope (a browser "
                                                   "session: a missing CSRF token)."),
        409: OpenApiResponse(ErrorDetailSerializer, "The offer takes no new rentals now; its server has less free "
                                                    "disk than the size; or you would pass your account's caps on "
                                                    "volumes (how many, how many GB in all). `detail` names it."),
        422: OpenApiResponse(ErrorDetailSerializer, "The Idempotency-Key was used for a different request."),
    }),
    destroy=extend_schema(
        summary="Delete a volume for good (confirmed by its name)",
        description="Send `{\"confirm\": \"<its name>\"}` as the body. Billing ends "
                    "now; a worker deletes it on its node (if the node cannot be reached, it stays `deleting` and "
                    "is deleted when the node answers again; only the node's refusal, a VM there still mounting "
                    "it, makes it `available` again). Refused (409) while an instance holds it (`in_use_by`): one "
                    "that mounts it and is neither destroyed nor failed, one that failed after it ran (its VM is "
                    "kept on the node until you destroy it, unless it is known gone: the instance's `vm_gone`), or "
                    "one destroyed or failed whose VM is still to be "
                    "removed from the node.",
        request=VolumeDeleteSerializer,
        responses={202: VolumeSerializer, 409: _CONFLICT},
    ),
)
@extend_schema(tags=["volumes"])
class VolumeViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Storage on one node that you mount into instances there at their creation (`volumes` of
    POST /api/v1/instances/); kept across stop/start and after the instances are destroyed. Another user's volume
    is a 404."""
    api_scope = RENTER_ONLY  # core/api/scopes.py

    serializer_class = VolumeSerializer
    queryset = Volume.objects.none()  # for the schema; get_queryset scopes to the user

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return self.queryset
        # cost_so_far is net of what was given back of its charges: carried in the list's own query.
        if self.action == "list":
            return volumes_with_given_back(svc.volumes_for_user(user=self.request.user))
        return volumes_with_given_back(svc.volumes_for_user(user=self.request.user, include_deleted=True))

    def list(self, request, *args, **kwargs):
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        assert page is not None  # the API's default pagination
        context = {**self.get_serializer_context(), "awaiting_cleanup": instances_awaiting_cleanup_by_node(
            node_ids={volume.node_id for volume in page})}
        return self.get_paginated_response(VolumeSerializer(page, many=True, context=context).data)

    def _render(self, volume, code=status.HTTP_200_OK):
        fresh = volumes_with_given_back(svc.volumes_for_user(user=self.request.user, include_deleted=True)).get(
            pk=volume.pk)
        return Response(VolumeSerializer(fresh).data, status=code)

    def create(self, request):
        idempotency_key, fingerprint = idempotency_key_of(request)
        if idempotency_key:  # a retry gets what the first request made, even if its input would not validate now
            earlier = svc.volume_for_idempotency_key(owner=request.user, idempotency_key=idempotency_key,
                                                     request_fingerprint=fingerprint)
            if earlier is not None:
                return self._render(earlier)
        data = VolumeCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        volume, created = svc.volume_create_once(
            owner=request.user, node_id=v["offer"], size_gb=v["size_gb"], label=v["label"],
            idempotency_key=idempotency_key, request_fingerprint=fingerprint)
        return self._render(volume, status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    def destroy(self, request, pk=None):
        volume = self.get_object()
        data = VolumeDeleteSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        return self._render(svc.volume_delete(volume=volume, confirm=data.validated_data["confirm"]),
                            status.HTTP_202_ACCEPTED)
