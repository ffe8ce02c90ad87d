"""The project's admin site: Django's, with one rule for every list it shows, whichever app registers the model.

A list's query string filters it. Its own filters (list_filter, the date hierarchy) read their parameters and check
their values; Django applies every other parameter that names a field as a lookup, as written (core/admin_history.py
links `?node__id__exact=5` so). Django turns the errors raised while such a filter is built into its "invalid
lookup" answer (the list again, unfiltered, with ?e=1), but some values fail only when the SQL is compiled or run:
?created_at__year=99999 (a year past datetime's range), iso_year, an invalid regular expression (__regex, a
DataError), __range with other than two values, __contained_by on a plain column, text for a binary column; and
the date hierarchy's own year, month or day beyond a C long (an OverflowError where Django expects a ValueError).
Each was a 500 on every list with such a field. Those parameters are now tried once, in a savepoint, before the
list uses them, and any failure gets the same answer as a misspelt field. A subclass of the site, not a check per
lookup: the lookups are Django's and PostgreSQL's to judge, and whatever a later list or lookup adds is covered.

No list is filtered by a field that holds a secret (SECRET_FIELDS), whoever asks, superusers too: a lookup answers
whether a stored value matches, so a page that shows a value redacted or not at all still gave it away, one guess at a
time (?payload__data__object__client_secret__startswith=pi_..._secret_a read a client_secret that Stripe events stored
before webhooks were redacted held: found by review). Django accepts every lookup on a list's own fields
(ModelAdmin.lookup_allowed), so the site refuses these, on the list's model and through its relations, with Django's
answer to a lookup it forbids (DisallowedModelAdminLookup, a 400).

A list's action runs on the rows the post selects (`_selected_action`), which Django filters by as sent: a value
that is no key of the list's model (`abc`, `1.5` or an empty value for an integer key, a NUL) raised the field's
ValueError out of the filter, a 500 on every list with an action (found by review). The selection is now read first,
and a post naming anything other than keys of the model is refused as a whole, a 400 naming the value: no action
runs, on none of the rows (a number past the key's range is refused the same way; it selected nothing before).

Installed in place of django.contrib.admin (config/settings/base.py, INSTALLED_APPS: `AdminConfig` below), as
Django documents for overriding the default site: `admin.site` is this site.
"""
from __future__ import annotations

from functools import cache
from typing import Any

from django.apps import apps
from django.contrib import admin
from django.contrib.admin import helpers
from django.contrib.admin.apps import AdminConfig as DjangoAdminConfig
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.utils import build_q_object_from_lookup_parameters
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import FieldDoesNotExist, ImproperlyConfigured, SuspiciousOperation, ValidationError
from django.db import router, transaction
from django.db.models import Field, ForeignObjectRel
from django.db.models.constants import LOOKUP_SEP
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest

# "app_label.Model.field": what each holds. An app not installed is skipped; a model or field not found is an error.
SECRET_FIELDS = (
    # Stripe's events as received: those stored before webhooks were redacted held PaymentIntents' client_secrets
    # (billing migration 0019 redacted them; the payload's other keys are no list's business either).
    "billing.StripeEvent.payload",
    "marketplace.User.password",  # a password's hash (Django's UserAdmin refuses it on the users' list)
    "marketplace.ApiKey.key_hash",  # the SHA-256 of a bearer token
    "marketplace.Node.ssh_private_key_encrypted",  # the platform's key to the node (Fernet token)
    "marketplace.Instance.onstart",  # the renter's first-boot script, never shown: renters put tokens in it
    # The create's fingerprint: those stored before the script was key-hashed in it (marketplace/web/renters.py,
    # marketplace/api/instances.py) are a plain SHA-256 of the body with the script, the rest of it shown.
    "marketplace.Instance.request_fingerprint",
    "marketplace.Instance.env_encrypted",  # the renter's environment values (Fernet token)
    "marketplace.Instance.registry_auth_encrypted",  # the renter's registry login (Fernet token)
    "marketplace.AuthenticatorDevice.key_encrypted",  # a TOTP secret
    "marketplace.RecoveryCode.code_encrypted",  # a two-factor recovery code
    "notifications.WebhookEndpoint.secret_encrypted",  # a webhook's signing secret
    # django-otp's own devices keep their secrets in the clear (installed for marketplace migration 0017 only)
    "otp_totp.TOTPDevice.key",
    "otp_static.StaticToken.token",
    "sessions.Session.session_data",
)


@cache
def _secret_fields() -> frozenset[Field[Any, Any] | ForeignObjectRel]:
    fields: set[Field[Any, Any] | ForeignObjectRel] = set()
    for name in SECRET_FIELDS:
        app_label, model_name, field_name = name.split(".")
        try:
            app = apps.get_app_config(app_label)
        except LookupError:
            continue  # not installed: no list reaches its rows
        fields.add(app.get_model(model_name)._meta.get_field(field_name))
    return frozenset(fields)


def lookup_reads_a_secret(model: Any, lookup: str) -> bool:
    """Whether a list's lookup (`payload__data__object__client_secret__startswith`, `node__ssh_private_key_...`)
    names a field of SECRET_FIELDS, on `model` or through its relations: the path as Django's lookup_allowed walks
    it, up to the first part that is not a field (a transform, a lookup, a JSON key)."""
    secret = _secret_fields()
    for part in lookup.split(LOOKUP_SEP):
        try:
            field = model._meta.get_field(part)
        except FieldDoesNotExist:
            return False
        if field in secret:
            return True
        path_infos = getattr(field, "path_infos", None)
        if not path_infos:
            return False
        model = path_infos[-1].to_opts.model
    return False


class _TriedLookups:
    """A ChangeList that runs the query string's own lookups once before the list does (an EXISTS, in a savepoint:
    a failed statement does not abort the request's transaction). No parameter, no query."""

    model: Any
    root_queryset: Any

    def get_filters(self, request: HttpRequest) -> Any:
        try:
            filters = super().get_filters(request)  # type: ignore[misc]
        except OverflowError as exc:  # the date hierarchy's ?started_at__year=<30 digits>: Django takes ValueError
            raise IncorrectLookupParameters(exc) from exc
        remaining = filters[2]  # what no list filter took: applied as written
        if remaining and not getattr(self, "_lookups_tried", False):
            try:
                with transaction.atomic(using=router.db_for_read(self.model)):
                    self.root_queryset.filter(build_q_object_from_lookup_parameters(remaining)).exists()
            except (SuspiciousOperation, ImproperlyConfigured):
                raise  # as Django's own step: a lookup it forbids is a 400, a broken admin its error
            except Exception as exc:
                # As Django's own step, which catches every error of building the filter: there is no other way
                # of validating a lookup's value than the database's answer.
                raise IncorrectLookupParameters(exc) from exc
            self._lookups_tried = True
        return filters


@cache
def _tried(changelist: type[ChangeList]) -> type[ChangeList]:
    return type(changelist.__name__, (_TriedLookups, changelist), {"__module__": changelist.__module__})


def not_a_key(model: Any, value: str) -> bool:
    """Whether a posted value is no key of `model`: one its primary key does not read (`abc` for an integer), one its
    validators refuse (past the column's range), or one holding a NUL (no text column takes one)."""
    if "\x00" in value:
        return True
    field = model._meta.pk
    try:
        field.run_validators(field.to_python(value))
    except (ValidationError, TypeError, ValueError):
        return True
    return False


class _TriedLookupsAdmin:
    def response_action(self, request: HttpRequest, queryset: Any) -> HttpResponse | None:
        """Django's, after the selection is read: any value that is not a key of the list's model refuses the
        whole post (a 400 naming it), before the action sees a row."""
        model = self.model  # type: ignore[attr-defined]
        for value in request.POST.getlist(helpers.ACTION_CHECKBOX_NAME):
            if not_a_key(model, value):
                shown = value if len(value) <= 40 else value[:40] + "…"
                return HttpResponseBadRequest(
                    f"Not a key of a {model._meta.verbose_name}: {shown!r} among the selected rows. Nothing was "
                    "done; select the rows on the list again.", content_type="text/plain; charset=utf-8")
        response: HttpResponse | None = super().response_action(request, queryset)  # type: ignore[misc]
        return response

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest | None = None) -> bool:
        if lookup_reads_a_secret(self.model, lookup):  # type: ignore[attr-defined]
            return False  # whatever Django allows: its own fields, a list filter's path, a limit_choices_to popup
        return bool(super().lookup_allowed(lookup, value, request))  # type: ignore[misc]

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return _tried(super().get_changelist(request, **kwargs))  # type: ignore[misc]


class AdminSite(admin.AdminSite):
    def register(self, model_or_iterable: Any, admin_class: type[admin.ModelAdmin[Any]] | None = None,
                 **options: Any) -> None:
        """Every ModelAdmin with the tried lookups of its lists: a subclass made here, as Django's own register
        makes one for `options`."""
        base = admin_class or admin.ModelAdmin
        if not issubclass(base, _TriedLookupsAdmin):
            base = type(base.__name__, (_TriedLookupsAdmin, base),
                        {"__module__": base.__module__, "__qualname__": base.__qualname__, "__doc__": base.__doc__})
        return super().register(model_or_iterable, base, **options)


class AdminConfig(DjangoAdminConfig):
    default_site = "core.admin_site.AdminSite"
