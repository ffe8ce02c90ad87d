"""Sign-up, login, the current user, and API keys."""
from django.contrib.auth import password_validation
from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, permissions, serializers, status, viewsets
from rest_framework.response import Response
from rest_framework.throttling import ScopedRateThrottle
from rest_framework.views import APIView

from marketplace.models import ApiKey, User
from marketplace.services import accounts as svc

from .fields import StrictFieldsMixin, no_control_characters


class CredentialsSerializer(StrictFieldsMixin, serializers.Serializer):
    email = serializers.EmailField(max_length=254)
    password = serializers.CharField(max_length=128, write_only=True, trim_whitespace=False,
                                     style={"input_type": "password"})


class RegisterSerializer(CredentialsSerializer):
    def validate(self, attrs):
        # Django's validators: length, common passwords, similarity to the email.
        try:
            password_validation.validate_password(attrs["password"], User(email=attrs["email"]))
        except DjangoValidationError as exc:
            raise serializers.ValidationError({"password": exc.messages}) from None
        return attrs


class UserSerializer(serializers.ModelSerializer):
    class Meta:
        model = User
        fields = ["id", "email", "is_staff", "date_joined"]
        read_only_fields = fields


class AuthResultSerializer(serializers.Serializer):
    user = UserSerializer()
    api_key = serializers.CharField(help_text="Shown once. Send it as `Authorization: Bearer <api_key>`.")


class _AuthView(APIView):
    permission_classes = [permissions.AllowAny]
    authentication_classes: list = []
    throttle_classes = [ScopedRateThrottle]
    throttle_scope = "auth"


class RegisterView(_AuthView):
    @extend_schema(request=RegisterSerializer, responses={201: AuthResultSerializer}, tags=["auth"])
    def post(self, request):
        """Create an account (email + password) and return its first API key."""
        data = RegisterSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            user, raw_key = svc.user_register(**data.validated_data)
        except svc.EmailTaken:
            raise serializers.ValidationError({"email": ["An account with this email already exists."]}) from None
        return Response(AuthResultSerializer({"user": user, "api_key": raw_key}).data, status=status.HTTP_201_CREATED)


class LoginView(_AuthView):
    @extend_schema(request=CredentialsSerializer, responses={200: AuthResultSerializer}, tags=["auth"])
    def post(self, request):
        """Check email and password and return a new API key."""
        data = CredentialsSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            user, raw_key = svc.user_login(**data.validated_data)
        except svc.InvalidCredentials:
            raise serializers.ValidationError({"detail": ["Invalid email or password."]}) from None
        return Response(AuthResultSerializer({"user": user, "api_key": raw_key}).data)


class MeView(APIView):
    @extend_schema(responses=UserSerializer, tags=["auth"])
    def get(self, request):
        """The account the request is authenticated as."""
        return Response(UserSerializer(request.user).data)


class ApiKeySerializer(StrictFieldsMixin, serializers.ModelSerializer):
    name = serializers.CharField(max_length=100, required=False, allow_blank=True,
                                 validators=[no_control_characters])

    class Meta:
        model = ApiKey
        fields = ["id", "name", "prefix", "created_at", "last_used_at"]
        read_only_fields = ["id", "prefix", "created_at", "last_used_at"]


class ApiKeyCreatedSerializer(ApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="Shown once; only a hash is stored.")

    class Meta(ApiKeySerializer.Meta):
        fields = ApiKeySerializer.Meta.fields + ["key"]


@extend_schema(tags=["api-keys"])
class ApiKeyViewSet(mixins.ListModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet):
    """Your active API keys. The secret is shown only in the answer to POST."""

    serializer_class = ApiKeySerializer

    queryset = ApiKey.objects.none()  # for the schema; get_queryset scopes to the user

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return self.queryset
        return ApiKey.objects.active().filter(user=self.request.user)

    @extend_schema(request=ApiKeySerializer, responses={201: ApiKeyCreatedSerializer})
    def create(self, request):
        data = ApiKeySerializer(data=request.data)
        data.is_valid(raise_exception=True)
        api_key, raw = svc.api_key_create(user=request.user, **data.validated_data)
        api_key.key = raw
        return Response(ApiKeyCreatedSerializer(api_key).data, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance):
        svc.api_key_revoke(api_key=instance)
