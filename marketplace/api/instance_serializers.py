"""The instances API's serializers: an instance as renters read it, what booking one accepts (offer, GPUs or a
MIG slice, image, keys, env, onstart, ports, volumes, a registry login) and an instance's log lines.

They check the input's shape and bounds only; every rule about what may be booked is
marketplace.services.instances' (the viewset is in instances.py).
"""

from decimal import Decimal

from django.core.validators import ProhibitNullCharactersValidator
from drf_spectacular.utils import (
    extend_schema_field,
)
from rest_framework import serializers

from billing.selectors import storage_given_back_micros, usage_given_back_micros
from billing.services.metering import fee_percent, instance_cost_so_far
from core.api.fields import StrictFieldsMixin, UsdField
from core.api.schema import CONTROL, NUL, string_pattern
from core.errors import ValidationFailed
from core.validators import no_control_characters
from marketplace.models import GpuModel, Image, Instance, SshKey
from marketplace.selectors import instance_ssh_command
from marketplace.services import instances as svc
from marketplace.services import ssh_keys as ssh_svc
from marketplace.services.instances import options as opts
from marketplace.validators import MAX_INSTANCE_KEYS, NAME_MAX_LENGTH, validate_instance_keys


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
        "An absolute, normalised path in the instance, e.g. /data: not /, not a system folder the instance's SSH "
        "server needs (/bin, /boot, /dev, /etc, /lib, /lib32, /lib64, /libx32, /proc, /run, /sbin, /sys, /usr, "
        "/var/empty, /var/run), under one or above one (/var), judged as the folder the path names (/usr/../etc is "
        "/etc), nor where the platform mounts its own files (/.gpumarket, /.gpumarket-state, "
        "/root/.ssh/authorized_keys)."))


class VolumesField(serializers.ListField):
    """A list of VolumeAttachSerializer objects whose errors come back flat, as the API's error shape says:
    {"volumes": ["volumes[0].mount: This field is required."]}, not nested per item."""

    child = VolumeAttachSerializer()

    def to_internal_value(self, data):
        # The cap first: DRF validates every item and only then the length, so a body of ~90,000 items cost a
        # second of CPU before its 400 (found by review).
        if isinstance(data, list) and self.max_length is not None and len(data) > self.max_length:
            self.fail("max_length", max_length=self.max_length)
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
    gpus = serializers.SerializerMethodField(help_text="Indices (on the node) of the GPUs it holds now (a MIG "
                                                       "instance: the GPUs its slices are on).")
    mig_slices = serializers.SerializerMethodField(help_text="The MIG-... UUIDs of the slices it holds now (an "
                                                             "instance with mig_profile; [] otherwise).")
    gpus_on_one_nvlink_island = serializers.SerializerMethodField(help_text=(
        "true when the GPUs it holds are all on one NVLink island of the node (booking prefers that); false "
        "when they span islands or PCIe; null for one GPU, a node without NVLink, or a MIG instance (MIG slices "
        "have no peer-to-peer between them, over NVLink or PCIe, even on cards of one island)."))
    require_nvlink = serializers.BooleanField(read_only=True, help_text=(
        "Booked with require_nvlink: its GPUs are all on one NVLink island, and a start of it when stopped that "
        "takes GPUs again keeps them on one island or is refused (409) rather than spanning islands."))
    image = serializers.CharField(source="image_name", read_only=True,
                                  help_text="The catalogue image's slug, or your own image's reference.")
    registry_auth = serializers.BooleanField(read_only=True, help_text="Whether a registry login was given (it is "
                                                                        "never shown again).")
    env = serializers.SerializerMethodField(
        help_text=f"The environment variables set in the instance, by name; every value is shown as "
                  f"\"{svc.ENV_VALUE_MASK}\" (values are encrypted at rest and never shown after creation).")
    ports_requested = serializers.ListField(child=serializers.IntegerField(), read_only=True,
                                            help_text="The container TCP ports asked for.")
    ports = serializers.DictField(
        child=serializers.DictField(), read_only=True,
        help_text='Where each asked-for port is reachable once running, as the node mapped it: '
                  '{"8888/tcp": {"host": "203.0.113.7", "port": 40123}}.')
    os = _BlankAsNullCharField(read_only=True, allow_null=True,
                               help_text="The instance's operating system as its node read it (null until known).")
    min_cuda_version = _BlankAsNullCharField(read_only=True, allow_null=True)
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
        help_text="USD paid so far for its GPU time, including this run's seconds not metered yet, up to now or, "
                  "while the node's health checks fail (or it is quarantined or retired), only up to its last "
                  "healthy moment, since later time is not billed: what was charged, less what was given back of it "
                  "since (an adjustment line of your statement: e.g. time billed after its VM was last seen, found "
                  "lost just as it stopped). Billed per second while running; a stopped instance's disk is billed "
                  "apart (`disk_cost_so_far`).")
    disk_price_per_gb_month = UsdField(
        source="disk_price_per_gb_month_micros", read_only=True,
        help_text="USD per GB per 30-day month for its disk while it is stopped: the node's published disk price "
                  "at booking. Billed per second from the stop until it starts again or is destroyed.")
    disk_cost_so_far = serializers.SerializerMethodField(
        help_text="USD paid so far for its disk while stopped (metered every minute): what was charged, less what "
                  "was given back of it since (an adjustment line of your statement).")
    volumes = serializers.SerializerMethodField(help_text="The volumes mounted in it: [{volume, name, mount}].")
    vm_gone = serializers.BooleanField(
        read_only=True,
        help_text="True once a failed instance's VM is known to be gone from its server: its disk space there and "
                  "the volumes it mounted are released (such a volume can be mounted by another instance or "
                  "deleted now). False for a failed one whose VM may still be there, stopped, with your data: it "
                  "keeps its disk and volumes until you destroy it.")

    class Meta:
        model = Instance
        fields = [
            "id", "status", "status_message", "node", "gpu_model", "mig_profile", "num_gpus", "gpus", "mig_slices",
            "gpus_on_one_nvlink_island", "require_nvlink", "image", "registry_auth",
            "env", "onstart", "ports_requested", "ports", "min_cuda_version", "os", "label", "disk_gb",
            "ssh_host", "ssh_port", "ssh_user", "ssh_command", "ssh_public_keys", "price_per_hour",
            "price_per_gpu_hour", "platform_fee_percent", "cost_so_far", "disk_price_per_gb_month",
            "disk_cost_so_far", "volumes", "vm_gone",
            "created_at", "started_at", "stopped_at", "destroyed_at", "updated_at",
        ]
        read_only_fields = fields

    @extend_schema_field({"type": "object", "additionalProperties": {"type": "string", "enum": [svc.ENV_VALUE_MASK]},
                          "example": {"API_KEY": svc.ENV_VALUE_MASK}})
    def get_env(self, instance) -> dict[str, str]:
        return svc.env_masked(instance)

    def get_platform_fee_percent(self, instance) -> str:
        return str(fee_percent(instance.platform_fee_bps))

    @extend_schema_field(UsdField(read_only=True, max_digits=18))
    def get_cost_so_far(self, instance):
        # Net of what was given back (reversals of its usage charges), as the ledger, the usage API and the instance
        # page say; before, what was charged (found by review). The viewset's queryset carries the sum
        # (marketplace.selectors.instances_with_given_back: no query per instance); one query otherwise.
        given_back = getattr(instance, "usage_given_back_micros", None)
        if given_back is None:
            given_back = usage_given_back_micros(instance_ids=[instance.pk]).get(instance.pk, 0)
        return UsdField(max_digits=18).to_representation(instance_cost_so_far(instance=instance) - given_back)

    @extend_schema_field(UsdField(read_only=True, max_digits=18))
    def get_disk_cost_so_far(self, instance):
        # Net of an operator's reversals of its disk's storage charges, as the ledger and the instance page say;
        # before, disk_cost_micros (what was charged). Carried by the viewset's queryset
        # (marketplace.selectors.instances_with_given_back); one query otherwise.
        given_back = getattr(instance, "disk_given_back_micros", None)
        if given_back is None:
            given_back = storage_given_back_micros("disk", ids=[instance.pk]).get(instance.pk, 0)
        return UsdField(max_digits=18).to_representation(instance.disk_cost_micros - given_back)

    @extend_schema_field(InstanceVolumeSerializer(many=True))
    def get_volumes(self, instance):
        return InstanceVolumeSerializer(instance.volume_mounts.all(), many=True).data

    def get_gpus(self, instance) -> list[int]:
        return svc.instance_gpu_indices(instance=instance)

    def get_mig_slices(self, instance) -> list[str]:
        return svc.instance_slice_uuids(instance=instance) if instance.mig_profile else []

    def get_gpus_on_one_nvlink_island(self, instance) -> bool | None:
        return svc.instance_on_one_nvlink_island(instance=instance)

    def get_ssh_command(self, instance) -> str | None:
        return instance_ssh_command(instance)


class _OwnKeys(serializers.PrimaryKeyRelatedField):
    def get_queryset(self):
        request = self.context.get("request")
        if request is None or not request.user.is_authenticated:
            return SshKey.objects.none()
        return SshKey.objects.filter(user=request.user)


@extend_schema_field({"type": "array", "items": {"type": "integer"}, "maxItems": MAX_INSTANCE_KEYS})
class _KeyIds(serializers.ManyRelatedField):
    """A JSON list of at most MAX_INSTANCE_KEYS integer key ids, found in one query, in the order given.

    DRF's own field took any iterable (`{}` read as `[]`), answered `[null]` with 'Invalid pk "None"', looked each
    id up in a query of its own before the cap was checked (a body of a million ids held a worker for minutes),
    and took 1.5 or "1" for key 1 (int() of the value): all found by review."""

    def to_internal_value(self, data):
        if not isinstance(data, list):
            self.fail("not_a_list", input_type=type(data).__name__)
        if not self.allow_empty and not data:
            self.fail("empty")
        if len(data) > MAX_INSTANCE_KEYS:
            raise serializers.ValidationError(f"At most {MAX_INSTANCE_KEYS} keys.")
        for n, item in enumerate(data):
            if item is None:
                raise serializers.ValidationError("An SSH key id may not be null.")
            if type(item) is not int:  # bool is an int subclass: refused too
                raise serializers.ValidationError(
                    f"ssh_keys[{n}] must be an integer (the id of one of your SSH keys), not {str(item)[:20]!r}.")
        found = self.child_relation.get_queryset().in_bulk(data)
        for item in data:
            if item not in found:
                self.child_relation.fail("does_not_exist", pk_value=item)
        return [found[item] for item in data]


# The options' JSON shapes as the schema publishes them; marketplace.services.instances.options checks them all
# (and what a schema cannot say: env names and the reserved NVIDIA_ ones, the environment's total size).
@extend_schema_field({"type": "object", "required": ["username", "password"], "additionalProperties": False,
                      "properties": {
                          "username": {"type": "string", "minLength": 1, "maxLength": opts.USERNAME_MAX,
                                       "pattern": string_pattern(refused=CONTROL + ":", nonblank=False)},
                          "password": {"type": "string", "minLength": 1, "maxLength": opts.PASSWORD_MAX,
                                       "pattern": string_pattern(refused=CONTROL, nonblank=False)}}})
class _RegistryAuthField(serializers.JSONField):
    pass


@extend_schema_field({"type": "object", "maxProperties": opts.ENV_MAX_NAMES,
                      "additionalProperties": {"type": "string", "maxLength": opts.ENV_MAX_VALUE,
                                               # one line, as the node's agent takes it
                                               "pattern": string_pattern(refused=NUL + r"\n\r", nonblank=False)}})
class _EnvField(serializers.JSONField):
    pass


@extend_schema_field({"type": "string", "maxLength": opts.ONSTART_MAX,
                      "pattern": string_pattern(refused=NUL, nonblank=False)})
class _OnstartField(serializers.JSONField):
    pass


@extend_schema_field({"type": "array", "maxItems": opts.PORTS_MAX, "uniqueItems": True,
                      "items": {"type": "integer", "minimum": 1, "maximum": 65535, "not": {"enum": [22]}}})
class _PortsField(serializers.JSONField):
    pass


@extend_schema_field({"type": "string", "pattern": "^" + opts.CUDA_VERSION_RE.pattern + "$"})
class _CudaVersionField(serializers.JSONField):
    pass


@extend_schema_field({"type": "string", "minLength": 1, "maxLength": opts.REFERENCE_MAX,
                      "pattern": opts.IMAGE_PATTERN})
class _ImageField(serializers.CharField):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # One message for a NUL as for any control character (core.validators), not DRF's own as well.
        self.validators = [v for v in self.validators if not isinstance(v, ProhibitNullCharactersValidator)]


class InstanceCreateSerializer(StrictFieldsMixin, serializers.Serializer):
    offer = serializers.IntegerField(min_value=1, max_value=2**63 - 1,
                                     help_text="The offer's `id` from /api/v1/offers/ (a node).")
    num_gpus = serializers.IntegerField(min_value=1, max_value=64,
                                        help_text="How many of the offer's free GPUs to rent (with mig_profile: "
                                                  "how many slices of that profile).")
    mig_profile = serializers.CharField(required=False, default="", max_length=20, help_text=(
        "Rent MIG slices of this profile instead of whole GPUs (the offer's `mig_slices`), priced per slice-hour."))
    max_price_per_gpu_hour = UsdField(required=False, min_value=Decimal("0"), help_text=(
        "The most you agree to pay in USD per GPU-hour (with mig_profile: per slice-hour), e.g. \"0.79\": the "
        "offer's `price_per_gpu_hour` (or its slice's `price_per_slice_hour`) as you saw it. When the offer's price "
        "is higher at the moment of booking (its provider raised it since), the booking is refused with a 409 whose "
        "`code` is `price_changed`, naming the price now (`price_per_gpu_hour`) and yours "
        "(`max_price_per_gpu_hour`), and nothing is booked. A lower price books at the lower price. Without it, "
        "the booking takes the offer's price at that moment, whatever it is."))
    max_disk_price_per_gb_month = UsdField(required=False, min_value=Decimal("0"), help_text=(
        "The most you agree to pay in USD per GB-month for the instance's disk while it is stopped, e.g. \"0.10\": "
        "the offer's `disk_price_per_gb_month` as you saw it (the booking fixes it on the instance). When the offer's "
        "disk price is higher at the moment of booking, the booking is refused with a 409 whose `code` is "
        "`price_changed`, naming the price now (`disk_price_per_gb_month`) and yours (`max_disk_price_per_gb_month`), "
        "and nothing is booked. A lower price books at the lower price. Without it, the booking takes the offer's "
        "disk price at that moment, whatever it is."))
    require_nvlink = serializers.BooleanField(required=False, default=False, help_text=(
        "Book only GPUs all on one NVLink island of the node: when no island has num_gpus free GPUs (the offer's "
        "nvlink_gpus_free is less), the booking is refused with a 409 and nothing is booked, instead of taking GPUs "
        "of several islands (PCIe between them). Needs num_gpus of 2 or more, without mig_profile (else a 400). "
        "Without it, booking still takes one island when one has enough free."))
    image = _ImageField(
        max_length=opts.REFERENCE_MAX, trim_whitespace=False, validators=[no_control_characters],
        help_text="An image `slug` from /api/v1/images/, or any image reference of your own "
                  "(`[registry[:port]/]name[:tag][@sha256:<64 hex>]`; not on libvirt nodes).")
    registry_auth = _RegistryAuthField(
        required=False, help_text="Login to the registry of your own image: {\"username\": ..., \"password\": "
                                  "...} (a token goes in `password`). Encrypted at rest, used only for the pull, "
                                  "never shown again.")
    env = _EnvField(
        required=False, help_text=f"Environment variables: {{\"NAME\": \"value\"}}, names [A-Z_][A-Z0-9_]*, at "
                                  f"most {opts.ENV_MAX_NAMES} names, values up to {opts.ENV_MAX_VALUE} characters, "
                                  f"{opts.ENV_MAX_TOTAL} bytes in all. Set for what you run: your SSH sessions, the "
                                  "`onstart` script and, with your own image, its command (as `docker run -e`); "
                                  "not for the platform's SSH server nor a catalogue image's command.")
    onstart = _OnstartField(
        required=False, help_text=f"A script run once by /bin/sh at the first boot, inside the instance (at most "
                                  f"{opts.ONSTART_MAX} characters); its output is in the logs.")
    ports = _PortsField(
        required=False, help_text=f"Container TCP ports to expose (at most {opts.PORTS_MAX}, distinct, 1-65535, not "
                                  "22); each is mapped to a free port of the node, shown in the instance's `ports`.")
    min_cuda_version = _CudaVersionField(
        required=False, help_text="Refuse the offer (a 400 naming this field) if its driver supports a lower CUDA "
                                  "version, e.g. \"12.2\", or its CUDA version is not known.")
    ssh_keys = _KeyIds(child_relation=_OwnKeys(), required=False,
                       help_text="Ids of your SSH keys (/api/v1/ssh-keys/).")
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

    def validate_image(self, value):
        try:
            return opts.image_of(value)
        except ValidationFailed as exc:
            raise serializers.ValidationError(exc.message) from None

    def _clean(self, fn, value):
        try:
            return fn(value)
        except ValidationFailed as exc:
            raise serializers.ValidationError(exc.message) from None

    def validate_registry_auth(self, value):
        return self._clean(opts.clean_registry_auth, value)

    def validate_env(self, value):
        return self._clean(opts.clean_env, value)

    def validate_onstart(self, value):
        return self._clean(opts.clean_onstart, value)

    def validate_ports(self, value):
        return self._clean(opts.clean_ports, value)

    def validate_min_cuda_version(self, value):
        return self._clean(opts.clean_cuda_version, value)

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
        if attrs.get("registry_auth") is not None and isinstance(attrs.get("image"), Image):
            raise serializers.ValidationError(
                {"registry_auth": ["A catalogue image needs no registry login: give it only with your own image."]})
        return attrs

    def options(self) -> opts.InstanceOptions:
        v = self.validated_data
        return opts.InstanceOptions(env=v.get("env") or {}, onstart=v.get("onstart") or "",
                                    ports=v.get("ports") or [], min_cuda_version=v.get("min_cuda_version") or "",
                                    registry_auth=v.get("registry_auth"))


class InstanceLogsSerializer(serializers.Serializer):
    id = serializers.IntegerField(help_text="The instance.")
    lines = serializers.ListField(child=serializers.CharField(), help_text="The last lines of its log, oldest "
                                                                           "first: the image pull, boot and onstart.")
