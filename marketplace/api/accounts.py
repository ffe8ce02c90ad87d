"""Sign-up, login, the current user, and API keys."""
from django.contrib.auth import password_validation
from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import mixins, permissions, serializers, status, viewsets
from rest_framework.authentication import get_authorization_header
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api.fields import StrictFieldsMixin
from core.api.no_store import NoStoreMixin
from core.api.schema import error_response
from core.api.scopes import ALL_SCOPES, ANY, PUBLIC, SCOPE_LABELS
from core.client_address import client_ip
from core.errors import ValidationFailed
from core.validators import no_control_characters
from marketplace.auth import LoginLocked, lockout_message
from marketplace.auth_rate import _AuthRate
from marketplace.models import ApiKey, User
from marketplace.reauth import refuse_session_alone
from marketplace.services import accounts as svc
from marketplace.services import email_verification
from marketplace.validators import EMAIL_MAX_LENGTH, NAME_MAX_LENGTH, PASSWORD_MAX_LENGTH, SIGNUP_TOKEN_MAX_LENGTH

REGISTER_ANSWER = ("Check your e-mail: we sent this address a message to finish signing up. Nothing in this "
                   "answer says whether the address has an account.")


class CredentialsSerializer(StrictFieldsMixin, serializers.Serializer):
    email = serializers.EmailField(max_length=EMAIL_MAX_LENGTH)
    password = serializers.CharField(max_length=PASSWORD_MAX_LENGTH, write_only=True, trim_whitespace=False,
                                     style={"input_type": "password"})


class RegisterSerializer(CredentialsSerializer):
    def validate_email(self, value: str) -> str:
        # The limit on the address as it will be kept (lower case can be longer than what was typed).
        try:
            return svc.email_normalize(value)
        except ValidationFailed as exc:
            raise serializers.ValidationError(exc.message) from None

    def validate(self, attrs):
        # Django's validators: length, common passwords, similarity to the email.
        try:
            password_validation.validate_password(attrs["password"], User(email=attrs["email"]))
        except DjangoValidationError as exc:
            raise serializers.ValidationError({"password": exc.messages}) from None
        return attrs


class LoginSerializer(CredentialsSerializer):
    # No PASSWORD_MAX_LENGTH here: it bounds a password being set, and an account may hold a longer one set before
    # the bound held everywhere (core/password_validation.py); an absurd length is a wrong password (user_login).
    password = serializers.CharField(write_only=True, trim_whitespace=False, style={"input_type": "password"})
    key_name = serializers.CharField(
        max_length=NAME_MAX_LENGTH, required=False, allow_blank=True, validators=[no_control_characters],
        help_text=f"The name of the API key this log-in makes (default `{svc.LOGIN_KEY_NAME}`), e.g. the client's. "
                  "It replaces (revokes) your previous active key of that name; a key under a name with no active "
                  "key is e-mailed to your address.")
    otp_code = serializers.CharField(
        max_length=32, required=False, allow_blank=True,
        help_text="For an account with two-factor log-in: the code from the authenticator app, or a recovery code "
                  "(used up). Without it, or with a wrong one, such an account gets a 400 on `otp_code`.")


class ConfirmSerializer(StrictFieldsMixin, serializers.Serializer):
    token = serializers.CharField(max_length=SIGNUP_TOKEN_MAX_LENGTH, help_text="The token from the sign-up e-mail.")
    password = serializers.CharField(
        max_length=PASSWORD_MAX_LENGTH, write_only=True, trim_whitespace=False, style={"input_type": "password"},
        help_text="The password chosen at that sign-up (POST /api/v1/auth/register/). Another one is a 400 on "
                  "`password` and creates nothing: anyone can sign up with an address, so it may get the e-mail of "
                  "someone else's sign-up too.")


class UserSerializer(serializers.ModelSerializer):
    email_verified = serializers.SerializerMethodField(
        help_text="Whether the address is proven (renting and listing need it; POST /api/v1/auth/verify-email/ "
                  "e-mails the link when it is not).")

    class Meta:
        model = User
        fields = ["id", "email", "email_verified", "is_staff", "date_joined"]
        read_only_fields = fields

    def get_email_verified(self, user: User) -> bool:
        return user.email_verified_at is not None


class RegisterResultSerializer(serializers.Serializer):
    detail = serializers.CharField()


@extend_schema_field({"type": "array", "items": {"type": "string", "enum": list(ALL_SCOPES)}, "minItems": 1})
class ScopesField(serializers.MultipleChoiceField):
    """A list of scopes, in the order of ALL_SCOPES each way (MultipleChoiceField itself answers with a set)."""

    def to_internal_value(self, data):
        chosen = super().to_internal_value(data)
        return [s for s in ALL_SCOPES if s in chosen]

    def to_representation(self, value):
        return [s for s in ALL_SCOPES if s in value]


class ApiKeySerializer(StrictFieldsMixin, serializers.ModelSerializer):
    name = serializers.CharField(max_length=NAME_MAX_LENGTH, required=False, allow_blank=True,
                                 validators=[no_control_characters])
    scopes = ScopesField(
        choices=list(ALL_SCOPES), required=False, allow_empty=False,
        help_text="What the key may do, one or more of: " + "; ".join(f"`{s}`: {SCOPE_LABELS[s]}" for s in ALL_SCOPES)
                  + ". Default: all three. A key used to make a key cannot give it scopes it lacks.")
    expires_at = serializers.DateTimeField(
        required=False, allow_null=True,
        help_text="When the key stops working (401 from then on); null or absent: never. A key made with an "
                  "expiring key must expire no later than that key.")
    expired = serializers.BooleanField(source="is_expired", read_only=True)

    class Meta:
        model = ApiKey
        fields = ["id", "name", "prefix", "scopes", "expires_at", "expired", "created_at", "last_used_at"]
        read_only_fields = ["id", "prefix", "expired", "created_at", "last_used_at"]


class AuthResultSerializer(serializers.Serializer):
    user = UserSerializer()
    api_key = serializers.CharField(help_text="Shown once. Send it as `Authorization: Bearer <api_key>`.")
    key = ApiKeySerializer(help_text="The new key, as GET /api/v1/api-keys/ lists it.")


class LoginResultSerializer(AuthResultSerializer):
    replaced_keys = ApiKeySerializer(
        many=True, help_text="Your keys of the same name that this log-in revoked (requests with them now get 401).")


class _AuthView(NoStoreMixin, APIView):
    api_scope = PUBLIC  # core/api/scopes.py
    permission_classes = [permissions.AllowAny]
    authentication_classes: list = []
    throttle_classes = [_AuthRate]  # one budget with the pages' (marketplace/auth_rate.py), counted atomically
    throttle_scope = "auth"


class RegisterView(_AuthView):
    @extend_schema(request=RegisterSerializer, responses={202: RegisterResultSerializer}, tags=["auth"])
    def post(self, request):
        """Start a sign-up: the address gets an e-mail with a token that creates the account (POST it to
        /api/v1/auth/confirm/). The answer is the same whether or not the address already has an account."""
        data = RegisterSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        svc.user_register(**data.validated_data, base_url=request.build_absolute_uri("/"))
        return Response({"detail": REGISTER_ANSWER}, status=status.HTTP_202_ACCEPTED)


class ConfirmView(_AuthView):
    @extend_schema(request=ConfirmSerializer, responses={201: AuthResultSerializer}, tags=["auth"])
    def post(self, request):
        """Finish a sign-up with the token from its e-mail and the password chosen at that sign-up: creates the
        account and returns its first API key. A bad, expired or spent token is a 400 on `token`; another password
        than that sign-up's a 400 on `password` (the token is from someone else's sign-up with the address, or from
        another of yours); nothing is created either way. Each try counts in the `auth` rate."""
        data = ConfirmSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        # InvalidSignupToken, SignupPasswordMismatch: a 400
        user, key, raw_key = svc.user_register_confirm(**data.validated_data)
        return Response(AuthResultSerializer({"user": user, "api_key": raw_key, "key": key}).data,
                        status=status.HTTP_201_CREATED)


class LoginView(_AuthView):
    @extend_schema(request=LoginSerializer, responses={200: LoginResultSerializer}, tags=["auth"])
    def post(self, request):
        """Check email and password and return an API key named `key_name` (default `login`), replacing your
        previous key of that name. A key under a name that had no active key is e-mailed to your address (a
        log-in again under the same name is not). After repeated failures for an email or from an address, log-ins
        there are refused for a while, the right password too (429 with Retry-After). An account with two-factor
        log-in also needs `otp_code` (a 400 on it without it or with a wrong one; wrong codes count toward the same
        lock-out)."""
        data = LoginSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            result = svc.user_login(**data.validated_data, client_address=client_ip(request),
                                    base_url=request.build_absolute_uri("/"))
        except LoginLocked as locked:
            return Response({"detail": lockout_message(locked)}, status=status.HTTP_429_TOO_MANY_REQUESTS,
                            headers={"Retry-After": str(locked.retry_after)})
        except svc.InvalidCredentials:
            raise serializers.ValidationError({"detail": ["Invalid email or password."]}) from None
        return Response(LoginResultSerializer({"user": result.user, "api_key": result.raw_key, "key": result.key,
                                               "replaced_keys": result.replaced_keys}).data)


class MeView(APIView):
    api_scope = ANY  # core/api/scopes.py

    @extend_schema(responses=UserSerializer, tags=["auth"])
    def get(self, request):
        """The account the request is authenticated as."""
        return Response(UserSerializer(request.user).data)


class VerifyEmailView(APIView):
    api_scope = ANY  # core/api/scopes.py

    @extend_schema(request=None, tags=["auth"], responses={
        202: RegisterResultSerializer,
        409: error_response("Your address is verified already; nothing was sent."),
        429: error_response("The address had as many verification e-mails as an hour allows; nothing was sent."),
        503: error_response("The mail server could not take the e-mail; try again in a few minutes."),
    })
    def post(self, request):
        """E-mail the link that verifies your address again (renting and listing need a verified address: their
        403 `email_not_verified`). The link works for PASSWORD_RESET_TIMEOUT and stops working once the address
        changes or is verified."""
        email_verification.email_verification_resend(user=request.user, base_url=request.build_absolute_uri("/"))
        return Response({"detail": f"We e-mailed a verification link to {request.user.email}: open it, then try "
                                   "again."}, status=status.HTTP_202_ACCEPTED)


class ApiKeyCreatedSerializer(ApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="Shown once; only a hash is stored.")

    class Meta(ApiKeySerializer.Meta):
        fields = ApiKeySerializer.Meta.fields + ["key"]


@extend_schema(tags=["api-keys"])
class ApiKeyViewSet(NoStoreMixin, mixins.ListModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet):
    """Your API keys that are not revoked (expired ones too, marked `expired`), those made by log-ins (one per
    `key_name`) included. The secret is shown only in the answer to POST. Keys made before scopes existed, by
    sign-up and by log-ins hold all three scopes."""

    api_scope = ANY  # core/api/scopes.py
    serializer_class = ApiKeySerializer

    queryset = ApiKey.objects.none()  # for the schema; get_queryset scopes to the user

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return self.queryset
        return ApiKey.objects.active().filter(user=self.request.user)

    def initial(self, request, *args, **kwargs):
        # Any key may revoke itself, a `read` key too: it only takes access away, and it is the first thing to do
        # with a leaked key (a 403 told its finder to make a renter key first). The scope check runs in the
        # authentication that super().initial() starts (core/api/scopes.py), so DELETE of the very key the request
        # is made with is declared a read for this request. Revoking another key still needs a scope other than
        # `read`, and the other key's scopes (api_key_revoke).
        parts = get_authorization_header(request).split()
        own = (request.method == "DELETE" and len(parts) == 2 and parts[0].lower() == b"bearer"
               and svc.api_key_matches(raw_key=parts[1].decode("ascii", "replace"), pk=kwargs.get("pk")))
        self.api_read_methods = frozenset({"DELETE"}) if own else frozenset()
        super().initial(request, *args, **kwargs)

    @extend_schema(request=ApiKeySerializer, responses={
        201: ApiKeyCreatedSerializer,
        403: error_response("Asked with a browser session, not an API key: keys are made on the API keys page (it "
                            "asks for the password) or with POST /api/v1/auth/login/; nothing was made."),
        409: error_response("You hold API_KEYS_PER_USER_MAX keys (50 by default) already: revoke one first; "
                            "nothing was made.")})
    def create(self, request):
        # A key outlives the session and a password change. POST /api/v1/auth/login/ takes the password.
        refuse_session_alone(request, instead="on the API keys page (it asks for your password), with "
                                              "POST /api/v1/auth/login/")
        data = ApiKeySerializer(data=request.data)
        data.is_valid(raise_exception=True)
        made_with = request.auth
        api_key, raw = svc.api_key_create(user=request.user, **data.validated_data, made_with=made_with,
                                           base_url=request.build_absolute_uri("/"))
        api_key.key = raw
        return Response(ApiKeyCreatedSerializer(api_key).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={204: None, 403: error_response(
        "The key asked with lacks a scope of the key to revoke (a key revokes only keys within its own scopes, "
        "and itself); nothing was revoked.")})
    def destroy(self, request, *args, **kwargs):
        return super().destroy(request, *args, **kwargs)

    def perform_destroy(self, instance):
        svc.api_key_revoke(api_key=instance, revoked_with=self.request.auth)
