"""Renters' SSH public keys: add, list, delete. Parsed strictly; the fingerprint is shown."""
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.response import Response

from core.api.fields import StrictFieldsMixin
from core.api.schema import ErrorDetailSerializer
from core.api.scopes import RENTER_ONLY
from core.validators import no_control_characters
from marketplace.models import SshKey
from marketplace.reauth import refuse_session_alone
from marketplace.services import ssh_keys as svc
from marketplace.validators import NAME_MAX_LENGTH


def validate_public_key(value: str) -> None:
    try:
        svc.parse_public_key(value)
    except svc.InvalidSshKey as exc:
        raise serializers.ValidationError(str(exc)) from None


class SshKeySerializer(StrictFieldsMixin, serializers.ModelSerializer):
    name = serializers.CharField(max_length=NAME_MAX_LENGTH, required=False, allow_blank=True,
                                 validators=[no_control_characters], help_text="Defaults to the key's comment.")
    public_key = serializers.CharField(
        max_length=svc.MAX_KEY_CHARS, validators=[validate_public_key],
        help_text="One OpenSSH public key: `<type> <base64> [comment]`, e.g. the contents of ~/.ssh/id_ed25519.pub. "
                  "ssh-ed25519, ecdsa-sha2-nistp256/384/521 or ssh-rsa (2048 bits or more); no options. "
                  "Stored (and shown) as `<type> <base64>`.",
    )
    key_type = serializers.SerializerMethodField()

    class Meta:
        model = SshKey
        fields = ["id", "name", "public_key", "key_type", "fingerprint", "created_at"]
        read_only_fields = ["id", "key_type", "fingerprint", "created_at"]

    def get_key_type(self, key) -> str:
        return key.public_key.split(" ", 1)[0]


@extend_schema_view(
    list=extend_schema(summary="Your SSH keys"),
    retrieve=extend_schema(summary="One of your SSH keys"),
    create=extend_schema(summary="Add an SSH key", request=SshKeySerializer, responses={
        201: SshKeySerializer,
        403: OpenApiResponse(ErrorDetailSerializer, "Asked with a browser session, not an API key: the SSH keys page "
                                                    "asks for the password; nothing was saved."),
        409: OpenApiResponse(ErrorDetailSerializer,
                             "You already added this key, or have 32 saved keys, the most an account keeps."),
    }),
    destroy=extend_schema(summary="Delete an SSH key (instances created with it keep it)"),
)
@extend_schema(tags=["ssh-keys"])
class SshKeyViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin,
                    viewsets.GenericViewSet):
    """Public keys to put on the instances you create. Another user's key is a 404."""

    api_scope = RENTER_ONLY  # core/api/scopes.py
    serializer_class = SshKeySerializer
    queryset = SshKey.objects.none()  # for the schema; get_queryset scopes to the user

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return self.queryset
        return SshKey.objects.filter(user=self.request.user)

    def create(self, request):
        # A saved key goes on every instance rented later: a session alone (a copied cookie) must not add one.
        refuse_session_alone(request, instead="on the SSH keys page (it asks for your password)")
        data = SshKeySerializer(data=request.data)
        data.is_valid(raise_exception=True)
        key = svc.ssh_key_create(user=request.user, **data.validated_data)
        return Response(SshKeySerializer(key).data, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance):
        svc.ssh_key_delete(ssh_key=instance)
