"""Providers' nodes: register, read, change price / maintenance / listing / SSH address, retire."""
from django_countries import countries
from django_countries.serializer_fields import CountryField
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_field, extend_schema_view
from rest_framework import exceptions, permissions, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from core.api.fields import StrictFieldsMixin, UsdField
from core.api.schema import CodedErrorSerializer, ErrorDetailSerializer, error_response
from core.api.scopes import PROVIDER_ONLY
from core.api.throttling import ScopedRateThrottle, scoped_rate_wait
from core.validators import no_control_characters
from marketplace import selectors
from marketplace.mig import all_profile_names
from marketplace.models import Gpu, GpuModel, Node, NodeState, Runtime
from marketplace.services import nodes as svc
from marketplace.validators import (
    ADDRESS_MAX_LENGTH,
    DISK_PRICE_LIMITS,
    FINGERPRINT_MAX_LENGTH,
    MAX_GPUS_PER_NODE,
    NAME_MAX_LENGTH,
    PRICE_LIMITS,
    SSH_PORT_MAX,
    SSH_PORT_MIN,
    SSH_USER_MAX_LENGTH,
    canonical_address,
    validate_address,
    validate_host_key_fingerprint,
    validate_ssh_user,
)
from provisioning.selectors import latest_jobs
from provisioning.services.endpoint_change import node_change, node_endpoint_changes
from provisioning.services.verification import VerifyCooldown, node_verify_request


def _django_validator(fn):
    """Run a Django validator, reporting its message as a DRF error."""
    from django.core.exceptions import ValidationError

    def run(value):
        try:
            fn(value)
        except ValidationError as exc:
            raise serializers.ValidationError(exc.messages) from None

    return run


class GpuSerializer(serializers.ModelSerializer):
    gpu_model: serializers.SlugRelatedField[GpuModel] = serializers.SlugRelatedField(slug_field="slug", read_only=True)

    class Meta:
        model = Gpu
        fields = ["index", "uuid", "gpu_model", "memory_mib", "pci_bus_id", "status"]
        read_only_fields = fields


class JobSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    kind = serializers.CharField()
    status = serializers.CharField()
    step = serializers.CharField(help_text="What the job is doing now.")
    error = serializers.CharField(help_text="Why it failed, if it did.")
    attempts = serializers.IntegerField()
    created_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)


class MigLayoutEntrySerializer(serializers.Serializer):
    gpu = serializers.IntegerField(min_value=0, help_text="The GPU's index on the node.")
    profiles = serializers.ListField(child=serializers.CharField(max_length=20), min_length=1,
                                     help_text="Its MIG instances by profile name, e.g. [\"3g.40gb\", \"3g.40gb\"].")


class MigSliceSerializer(serializers.Serializer):
    gpu = serializers.IntegerField(source="gpu.index")
    device = serializers.IntegerField()
    profile = serializers.CharField()
    uuid = serializers.CharField()
    memory_mib = serializers.IntegerField()
    status = serializers.CharField()


@extend_schema_field({
    "type": "array", "maxItems": 64, "items": {
        "type": "object", "required": ["gpu", "profiles"], "additionalProperties": False,
        "properties": {"gpu": {"type": "integer", "minimum": 0, "maximum": 63},
                       "profiles": {"type": "array", "minItems": 1, "maxItems": 7,
                                    "items": {"type": "string", "minLength": 1, "maxLength": 20}}}}})
class MigLayoutField(serializers.JSONField):
    """A MIG layout as JSON: its shape is in the schema; the catalogue's rules (marketplace.mig) are the
    service's, answered as 400s on `mig_layout`."""


class MigPricesField(serializers.DictField):
    """{profile: USD per slice-hour}: each price a UsdField, its errors said as one list of strings."""

    def __init__(self, **kwargs):
        super().__init__(child=UsdField(**PRICE_LIMITS), **kwargs)

    def to_internal_value(self, data):
        # The cap first: DRF parses every price before the service refuses the names no layout uses, so a body of
        # ~130,000 made-up names cost about a second of CPU before its 400 (found by review, r49). Only a profile
        # of the catalogue can be priced, so more entries than it has profiles are refused as they are.
        most = len(all_profile_names())
        if isinstance(data, dict) and len(data) > most:
            raise serializers.ValidationError(
                f"At most {most} prices (one per MIG profile of mig_layout); you gave {len(data)}.")
        return super().to_internal_value(data)

    def run_child_validation(self, data):
        try:
            return super().run_child_validation(data)
        except serializers.ValidationError as exc:
            detail = exc.detail if isinstance(exc.detail, dict) else {}
            raise serializers.ValidationError(
                [f"{key}: {' '.join(map(str, errors))}" for key, errors in detail.items()]) from None


_MIG_LAYOUT_HELP = ("MIG layout per GPU: [{\"gpu\": 0, \"profiles\": [\"3g.40gb\", ...]}] with profiles of the model "
                    "(/api/v1/gpu-models/); per card at most 7 compute and 8 memory slices. The check holds it against "
                    "nvidia-smi; each proven slice is rented on its own. Only container nodes (docker, sim) split "
                    "cards: a libvirt node's layout is a 400 (MIG in a VM needs vGPU).")
_MIG_PRICES_HELP = "USD per slice-hour for each profile of mig_layout, e.g. {\"3g.40gb\": \"1.10\"}."


class NodeSerializer(serializers.ModelSerializer):
    gpu_model: serializers.SlugRelatedField[GpuModel] = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    country = CountryField(read_only=True)
    price_per_gpu_hour = UsdField(source="price_per_gpu_hour_micros", read_only=True)
    disk_price_per_gb_month = UsdField(source="disk_price_per_gb_month_micros", read_only=True,
                                       help_text="USD per GB per 30-day month for volumes and stopped instances' "
                                                 "disks on this node.")
    maintenance = serializers.SerializerMethodField()
    public_key = serializers.CharField(source="ssh_public_key", read_only=True,
                                       help_text="The platform's key for this node; install it for ssh_user.")
    install_command = serializers.SerializerMethodField(help_text="Run this on the node as ssh_user.")
    gpus = GpuSerializer(many=True, read_only=True)
    mig_layout = MigLayoutEntrySerializer(many=True, read_only=True, help_text=_MIG_LAYOUT_HELP)
    mig_prices = serializers.SerializerMethodField(help_text=_MIG_PRICES_HELP)
    mig_slices = MigSliceSerializer(many=True, read_only=True, help_text="The slices the last check proved.")
    current_job = serializers.SerializerMethodField(help_text="The node's most recent job (verification, ...).")

    class Meta:
        model = Node
        fields = [
            "id", "name", "address", "ssh_port", "ssh_user", "host_key_fingerprint", "country", "city",
            "datacenter", "gpu_model", "gpu_count", "nvlink_declared", "price_per_gpu_hour", "disk_price_per_gb_month",
            "mig_layout", "mig_prices", "mig_slices", "runtime", "state", "state_changed_at",
            "verdict", "listed", "maintenance", "score", "reliability", "last_error", "public_key",
            "install_command", "gpus", "current_job", "last_seen_at", "created_at", "updated_at",
        ]
        read_only_fields = fields

    @extend_schema_field(serializers.DictField(child=UsdField()))
    def get_mig_prices(self, node):
        return {name: UsdField().to_representation(micros) for name, micros in sorted(node.mig_prices_micros.items())}

    def get_maintenance(self, node) -> bool:
        return node.state == NodeState.MAINTENANCE

    @extend_schema_field(JobSerializer(allow_null=True))
    def get_current_job(self, node):
        jobs = self.context.get("latest_jobs")
        job = jobs.get(node.pk) if jobs is not None else latest_jobs([node.pk]).get(node.pk)
        return JobSerializer(job).data if job else None

    def get_install_command(self, node) -> str:
        return svc.node_install_command(node=node)


_FINGERPRINT_HELP = ("The fingerprint of the server's ed25519 host key, SHA256:... as `ssh-keygen -lf "
                     "/etc/ssh/ssh_host_ed25519_key.pub` prints it on the server (the platform checks that key; "
                     "an RSA or ECDSA key's fingerprint fails the first check).")


@extend_schema_field({"anyOf": [{"type": "string", "format": "ipv4"}, {"type": "string", "format": "ipv6"},
                                 {"type": "string", "format": "hostname"}], "maxLength": 253})
class AddressField(serializers.CharField):
    """A hostname or an IP address (validate_address), which the schema says with formats."""


class NodeCreateSerializer(StrictFieldsMixin, serializers.Serializer):
    name = serializers.CharField(max_length=NAME_MAX_LENGTH, validators=[no_control_characters])
    address = AddressField(
        max_length=ADDRESS_MAX_LENGTH, validators=[_django_validator(validate_address)],
        help_text="The server's public IP address, or a name that resolves only to public addresses (or to networks "
                  "the platform's operator allows): the platform connects there over SSH. A loopback, private, "
                  "link-local or reserved address, or a name that does not resolve, is a 400 on `address`.")
    ssh_port = serializers.IntegerField(min_value=SSH_PORT_MIN, max_value=SSH_PORT_MAX, default=22)
    ssh_user = serializers.CharField(max_length=SSH_USER_MAX_LENGTH, validators=[validate_ssh_user])
    # Exactly an alpha-2 code: django-countries' CountryField would also take "Germany", "DEU" or 276.
    country = serializers.ChoiceField(choices=list(countries), help_text="ISO 3166-1 alpha-2 code, e.g. DE.")
    city = serializers.CharField(max_length=NAME_MAX_LENGTH, required=False, default="", allow_blank=True,
                                 validators=[no_control_characters])
    datacenter = serializers.CharField(max_length=NAME_MAX_LENGTH, required=False, default="", allow_blank=True,
                                       validators=[no_control_characters])
    gpu_model = serializers.SlugRelatedField(slug_field="slug", queryset=GpuModel.objects.all(),
                                             help_text="Slug from /api/v1/gpu-models/.")
    gpu_count = serializers.IntegerField(min_value=1, max_value=MAX_GPUS_PER_NODE)
    nvlink_declared = serializers.BooleanField(
        required=False, default=False,
        help_text="The GPUs are NVLink-connected; the check degrades the node if nvidia-smi shows otherwise.")
    price_per_gpu_hour = UsdField(help_text="USD per GPU-hour.", **PRICE_LIMITS)
    mig_layout = MigLayoutField(required=False, help_text=_MIG_LAYOUT_HELP)
    mig_prices = MigPricesField(required=False, default=dict, help_text=_MIG_PRICES_HELP)
    disk_price_per_gb_month = UsdField(required=False, help_text=(
        "USD per GB per 30-day month for renters' volumes and stopped instances' disks, billed per second "
        "(default 0.10)."), **DISK_PRICE_LIMITS)
    runtime = serializers.ChoiceField(choices=Runtime.choices)
    host_key_fingerprint = serializers.CharField(
        max_length=FINGERPRINT_MAX_LENGTH, required=False, default="", allow_blank=True,
        validators=[validate_host_key_fingerprint],
        help_text=_FINGERPRINT_HELP + " If omitted, the key seen on first contact is pinned.",
    )

    def validate_address(self, value):
        return canonical_address(value)  # one spelling of an IP: the duplicate-endpoint 409 compares the text

    def validate(self, attrs):
        if attrs.get("nvlink_declared") and attrs.get("gpu_count", 0) < 2:
            raise serializers.ValidationError({"nvlink_declared": "NVLink joins two or more GPUs; this node has one."})
        return attrs


_ENDPOINT_HELP = (" Changing the address, SSH port or SSH user is checked as at registration (the same address "
                  "rules and 409), then, for a node the platform has reached, proven: the platform logs in at the new "
                  "endpoint and takes it only if the server there presents the node's pinned SSH host key and "
                  "accepts the node's key (a 400 naming what failed otherwise: unreachable, another host key, the key "
                  "refused; nothing is changed). A pending node never contacted changes at once: its `last_error` "
                  "(of the old endpoint) is cleared and its first contact at the new one is queued, as by POST "
                  ".../verify/ (the answer's `state` is `verifying`, its `current_job` that check). Not while the "
                  "node's verification or spot check runs (409), nor when another change of it was stored while "
                  "this one was checked (409: check the node, then try again). With other fields, all are checked "
                  "first, then the new endpoint is proven, then all are stored together: any refusal stores "
                  "nothing. At most NODE_ENDPOINT_THROTTLE_RATE (10 a minute) changes, with the server's settings "
                  "page (429).")


class NodeUpdateSerializer(StrictFieldsMixin, serializers.Serializer):
    read_only_elsewhere = NodeSerializer.Meta.fields  # e.g. runtime: "cannot be changed here", not "unknown"

    address = AddressField(
        max_length=ADDRESS_MAX_LENGTH, required=False, validators=[_django_validator(validate_address)],
        help_text="The server's new public IP address or name (the rules of registration)." + _ENDPOINT_HELP)
    ssh_port = serializers.IntegerField(min_value=SSH_PORT_MIN, max_value=SSH_PORT_MAX, required=False,
                                        help_text="The server's SSH port." + _ENDPOINT_HELP)
    ssh_user = serializers.CharField(max_length=SSH_USER_MAX_LENGTH, required=False, validators=[validate_ssh_user],
                                     help_text="The user the platform logs in as." + _ENDPOINT_HELP)
    name = serializers.CharField(max_length=NAME_MAX_LENGTH, required=False, validators=[no_control_characters])
    city = serializers.CharField(max_length=NAME_MAX_LENGTH, required=False, allow_blank=True,
                                 validators=[no_control_characters])
    datacenter = serializers.CharField(max_length=NAME_MAX_LENGTH, required=False, allow_blank=True,
                                       validators=[no_control_characters])
    price_per_gpu_hour = UsdField(required=False, help_text="USD per GPU-hour; booked instances keep their price.",
                                  **PRICE_LIMITS)
    disk_price_per_gb_month = UsdField(required=False, help_text="USD per GB-month; existing volumes and booked "
                                                                 "instances keep their price.", **DISK_PRICE_LIMITS)
    listed = serializers.BooleanField(required=False, help_text="false takes the node off the offers.")
    maintenance = serializers.BooleanField(required=False)
    mig_layout = MigLayoutField(required=False, help_text=_MIG_LAYOUT_HELP + " Takes effect at the next check "
                                                                             "(POST .../verify/).")
    mig_prices = MigPricesField(required=False, help_text=_MIG_PRICES_HELP)
    host_key_fingerprint = serializers.CharField(
        max_length=FINGERPRINT_MAX_LENGTH, required=False, allow_blank=True,
        validators=[validate_host_key_fingerprint],
        help_text=_FINGERPRINT_HELP + " Only until the node's first contact (a 409 after, or while a check runs): "
                                      "to correct the one given at registration; empty, the key seen on first "
                                      "contact is pinned.")

    def validate_address(self, value):
        return canonical_address(value)  # as node_register stores it: the duplicate-endpoint 409 compares the text


_CONFLICT = OpenApiResponse(ErrorDetailSerializer, "The node's state forbids this (or the address is taken).")
_EMAIL_NOT_VERIFIED = ("`code` `email_not_verified`: your e-mail address is not verified yet (POST "
                       "/api/v1/auth/verify-email/ sends the link again); or the API key lacks the `provider` "
                       "scope (a browser session: a missing CSRF token).")


_REGISTER_THROTTLED = ("More than NODE_REGISTER_THROTTLE_RATE (10 a minute) nodes registered by you, with the API "
                       "and the register page together; nothing was registered. Retry-After says when to try again.")
_ENDPOINT_THROTTLED = ("More than NODE_ENDPOINT_THROTTLE_RATE (10 a minute) changes of a node's address, SSH "
                       "port or user by you, with the API and the server's settings page together; nothing was "
                       "changed. Retry-After says when to try again.")
_VERIFY_COOLDOWN = ("`code` `verify_cooldown`: the node's last verification ended with a verdict (passed, degraded "
                    "or rejected) less than NODE_VERIFY_COOLDOWN_S (15 minutes) ago; nothing was queued. `detail` "
                    "names the node, when that check ended and when the next may be asked for; `node`, `verdict`, "
                    "`last_verified_at` and `verify_again_at` say the same for a program, and Retry-After gives the "
                    "seconds to wait. A check that ended without a verdict (unreachable, the key refused) starts no "
                    "cooldown; an operator's request is not bound by it.")
_REGISTER_CONFLICT = ("A live node of yours is already registered at this address and port, or you have "
                      "NODE_PENDING_MAX nodes that have not passed their first contact yet (verify or retire one).")


class ProviderChangesOwnNode(permissions.BasePermission):
    """Operators allowed to view or change nodes see every live node (selectors.nodes_for_user), those allowed to
    change them may ask for a re-check (the admin's "Re-verify" action's permission), but a node's price, listing,
    maintenance and retirement are its provider's: an operator acts on another provider's node in the admin, not as
    them here."""

    message = "Only the node's provider may change or retire it; operators use the admin panel."

    def has_object_permission(self, request, view, obj):
        if request.method in permissions.SAFE_METHODS or obj.provider_id == request.user.id:
            return True
        return view.action == "verify" and request.user.has_perm(selectors.NODE_CHANGE_PERMISSION)


@extend_schema_view(
    list=extend_schema(summary="Your nodes"),
    retrieve=extend_schema(summary="One of your nodes"),
    create=extend_schema(summary="Register a node", request=NodeCreateSerializer,
                         responses={201: NodeSerializer,
                                    409: OpenApiResponse(ErrorDetailSerializer, _REGISTER_CONFLICT),
                                    403: OpenApiResponse(CodedErrorSerializer, _EMAIL_NOT_VERIFIED),
                                    429: error_response(_REGISTER_THROTTLED)}),
    partial_update=extend_schema(summary="Change price, listing, maintenance, or the SSH address",
                                 request=NodeUpdateSerializer,
                                 responses={200: NodeSerializer, 409: _CONFLICT,
                                            429: error_response(_ENDPOINT_THROTTLED),
                                            403: OpenApiResponse(CodedErrorSerializer, "Putting the node back on the "
                                                                 "offers (`listed` true): " + _EMAIL_NOT_VERIFIED)}),
    destroy=extend_schema(summary="Retire a node", responses={204: None, 409: _CONFLICT}),
)
@extend_schema(tags=["nodes"])
class NodeViewSet(viewsets.ModelViewSet):
    """A provider sees and changes only its own nodes; another provider's node is a 404. Operators with
    `marketplace.view_node` or `marketplace.change_node` see every live node (403 on changing another provider's;
    a re-check needs `marketplace.change_node`)."""

    api_scope = PROVIDER_ONLY  # core/api/scopes.py
    permission_classes = [permissions.IsAuthenticated, ProviderChangesOwnNode]
    serializer_class = NodeSerializer
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]
    filterset_fields = ["state", "verdict", "runtime"]

    queryset = Node.objects.none()  # for the schema; get_queryset scopes to the user
    throttle_classes = [ScopedRateThrottle]
    throttle_scope = svc.REGISTER_SCOPE

    def get_throttles(self):
        # Registering only (it resolves the address's name, and its node is then tried over SSH): one budget with
        # the register page (marketplace.web.providers.node_register).
        return super().get_throttles() if self.action == "create" else []

    def throttled(self, request, wait):
        raise exceptions.Throttled(wait, detail=svc.register_throttled(wait or 1))

    def handle_exception(self, exc):
        response = super().handle_exception(exc)
        if isinstance(exc, VerifyCooldown):  # a 429 like the throttles': when to ask again, in whole seconds
            response["Retry-After"] = str(exc.retry_after)
        return response

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return self.queryset
        return selectors.nodes_for_user(user=self.request.user)

    def create(self, request):
        data = NodeCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        node = svc.node_register(provider=request.user, **data.validated_data)
        return Response(NodeSerializer(self.get_queryset().get(pk=node.pk)).data, status=status.HTTP_201_CREATED)

    def partial_update(self, request, pk=None):
        node = self.get_object()
        data = NodeUpdateSerializer(data=request.data, partial=True)
        data.is_valid(raise_exception=True)
        endpoint = {name: data.validated_data.pop(name) for name in svc.ENDPOINT_FIELDS if name in data.validated_data}
        if endpoint and node_endpoint_changes(node=node, **endpoint):
            # Before any check of the new endpoint: one budget with the server's settings page (svc.ENDPOINT_SCOPE).
            wait = scoped_rate_wait(request, svc.ENDPOINT_SCOPE)
            if wait is not None:
                raise exceptions.Throttled(wait, detail=svc.endpoint_throttled(wait))
        # Every field checked, then the endpoint proven, then all stored together: refused, nothing is stored.
        node_change(node=node, endpoint=endpoint, **data.validated_data)
        return Response(NodeSerializer(self.get_queryset().get(pk=node.pk)).data)

    def list(self, request, *args, **kwargs):
        # One query for the current jobs of the whole page, not one per node.
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        context = {**self.get_serializer_context(), "latest_jobs": latest_jobs([node.pk for node in page])}
        return self.get_paginated_response(NodeSerializer(page, many=True, context=context).data)

    def perform_destroy(self, node):
        svc.node_retire(node=node)

    @extend_schema(request=None, responses={202: NodeSerializer, 409: _CONFLICT,
                                            429: OpenApiResponse(CodedErrorSerializer, _VERIFY_COOLDOWN)},
                   summary="Verify the node now (after installing the platform's key)")
    @action(detail=True, methods=["post"])
    def verify(self, request, pk=None):
        """Queue the benchmark check. While one is queued or running, that one is shown (202). Its provider may ask
        again only NODE_VERIFY_COOLDOWN_S (15 minutes) after the node's last check that ended with a verdict
        (passed, degraded or rejected): sooner, a 429 saying when. A check that ended without a verdict
        (unreachable, the key refused) is no reason to wait: fix it and ask again at once."""
        node = self.get_object()
        # An operator's request (another provider's node: ProviderChangesOwnNode) is not bound by the cooldown, as
        # the admin's Re-verify is not. Its refusal, VerifyCooldown, is answered with Retry-After (handle_exception).
        node_verify_request(node=node, by_provider=node.provider_id == request.user.pk)
        return Response(NodeSerializer(self.get_queryset().get(pk=node.pk)).data, status=status.HTTP_202_ACCEPTED)
