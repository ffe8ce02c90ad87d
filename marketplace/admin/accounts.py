"""The operators' panel for accounts: users (with two-factor turned off for one who lost both factors), API keys
and SSH keys, and the admin's own log-in and password pages. No secret is ever shown.

The admin checks no password outside the log-in lock-out: its log-in form and its own password change form are
the site's (marketplace/auth.py, marketplace/reauth.py), and a user's "set password" page does not take the
operator's own account (that needs the old password, on /account/password/). Every password set here is told to
its address.

Deactivating an account (unticking "active" on its page, or the list's action) and reactivating it go through
marketplace.services.account_status, with the reason typed next to it: its instances stop, its servers leave the
offers, its owner is told. Not the operator's own account.

No account is deleted here, a superuser's operator included: deactivate it instead (its admin log and the
deactivations it made would go with it).

Only a superuser grants: is_superuser, is_staff, groups and user_permissions are read-only to other staff, and so
are groups. Only a superuser changes, sets the password of or turns off the two-factor log-in of a staff
account (a superuser's or not): a staff account holds permissions its peer may lack, so taking it over (its
address, then a password reset; its password; its second factor) would be the same escalation. Holders of
change_user keep managing renters' and providers' accounts (a changed address, a lost second factor)."""
from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.admin.helpers import ActionForm
from django.contrib.admin.utils import unquote
from django.contrib.auth.admin import GroupAdmin as BaseGroupAdmin
from django.contrib.auth.admin import UserAdmin as BaseUserAdmin
from django.contrib.auth.forms import AdminPasswordChangeForm as BaseSetPasswordForm
from django.contrib.auth.forms import UserChangeForm as BaseUserChangeForm
from django.contrib.auth.models import Group
from django.contrib.auth.views import PasswordChangeView
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Count, OuterRef, Subquery
from django.db.models.functions import Coalesce
from django.http import HttpResponseRedirect
from django.urls import reverse
from django.utils import timezone
from django_otp.plugins.otp_static.models import StaticDevice
from django_otp.plugins.otp_totp.models import TOTPDevice

from core.admin_history import History, HistoryAdmin
from core.admin_paginator import EstimatedCountPaginator
from core.email_address import email_canonical
from core.errors import ApplicationError, ValidationFailed
from core.security_mail import operator_change_notify
from marketplace.admin.common import (
    NothingEditableAdmin,
    OwnChangesAdmin,
    OwnChangesForm,
    PageSetsAdmin,
    PageSetsForm,
    staff_of_a_non_superuser,
)
from marketplace.auth import ThrottledLoginFormMixin
from marketplace.auth_rate import auth_rate_refusal
from marketplace.models import (
    AccountStatusChange,
    ApiKey,
    Node,
    SshKey,
    User,
)
from marketplace.reauth import ThrottledPasswordChangeForm, with_form_status
from marketplace.services import passwords as password_svc
from marketplace.services.account_status import (
    REASON_MAX_LENGTH,
    account_deactivate,
    account_reactivate,
    status_reason_clean,
)
from marketplace.services.accounts import api_key_revoke, email_normalize
from marketplace.services.two_factor import two_factor_disable, two_factor_enabled


class UserAddForm(forms.ModelForm):
    """An operator adds an account by its e-mail address only, with no usable password: its owner sets one with
    "Forgot your password?", whose e-mail proves they hold the address before the account can log in, rent or list
    (sign-up proves it the same way). README, "Accounts"."""

    class Meta:
        model = User
        fields = ["email"]

    def clean_email(self):
        return _unused_email(self.cleaned_data["email"])

    def save(self, commit=True):
        user = super().save(commit=False)
        user.set_unusable_password()
        if commit:
            user.save()
        return user


def _unused_email(value: str, *, exclude_pk: int | None = None) -> str:
    """The address as sign-up keeps it (lower case), refused when another account's address reaches the same mailbox
    (any case, or a spelling that delivery encodes the same), when no e-mail can reach it, or when it is too long
    once in lower case (what was typed was checked; lower case can be longer, and saving it a 500)."""
    try:
        email = email_normalize(value)
    except ValidationFailed as exc:
        raise ValidationError(exc.message) from None
    # By the mailbox it reaches (core.email_address), as sign-up and the database's unique email_canonical do:
    # iexact (PostgreSQL's UPPER) took 'alice@gıthub.com', a mailbox of another domain, for alice@github.com.
    others = User.objects.filter(email_canonical=email_canonical(email))
    if exclude_pk is not None:
        others = others.exclude(pk=exclude_pk)
    if others.exists():
        raise ValidationError("An account has this address already.")
    return email


_REASON_HELP = "Told to the account's owner in the notice (e-mail, webhooks, their list)."


class UserChangeForm(PageSetsForm, BaseUserChangeForm):
    """Django's change form, with the add form's rule on the address: Renter@Example.com next to
    renter@example.com would be a second account for one mailbox; and the reason for a change of "active"."""

    status_reason = forms.CharField(
        label="Reason for (de)activating", required=False, max_length=REASON_MAX_LENGTH,
        help_text="When you change “Active”: " + _REASON_HELP + " Deactivating stops the account's running "
                  "instances (disks kept), cancels its bookings not running yet and takes its servers off the "
                  "offers; reactivating restarts nothing.")

    class Meta(BaseUserChangeForm.Meta):
        model = User

    # Fields whose change acts or grants: "active" (account_status stops or restarts what the account runs and tells
    # its owner), the address (its verification starts again, the old one is told), staff and superuser status. The
    # page sends back the value it was opened with (a hidden initial), and the save is refused when the stored value
    # moved since and the save would write over it: a page opened before another operator deactivated the account,
    # saved for an address, reactivated it and told the owner "Your account is active again" (found by review).
    GUARDED = ("email", "is_active", "is_staff", "is_superuser")
    # The grants' sets: the save makes only the operator's change to the set the page showed (PageSetsForm). Written
    # as shown, a page opened before another superuser revoked a permission or took the account out of a group
    # gave it back on a save made for the address (found by review).
    page_sets = ("groups", "user_permissions")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name in self.GUARDED:
            field = self.fields.get(name)
            if field is not None and not field.disabled:
                field.show_hidden_initial = True

    def clean_email(self):
        return _unused_email(self.cleaned_data["email"], exclude_pk=self.instance.pk)

    def clean(self):
        cleaned = super().clean()
        for name in self.GUARDED:
            field = self.fields.get(name)
            if field is None or not field.show_hidden_initial or name not in cleaned:
                continue
            initial_name = self[name].html_initial_name
            if initial_name not in self.data:
                continue  # a client that sends no page's value claims none (the value is judged as sent)
            try:
                seen = field.to_python(field.hidden_widget().value_from_datadict(self.data, self.files, initial_name))
            except ValidationError:
                seen = None
            stored = self.get_initial_for_field(field, name)
            if seen != stored and cleaned[name] != stored:
                now = ("on" if stored else "off") if isinstance(field, forms.BooleanField) else f"“{stored}”"
                self.add_error(name, f"Changed by someone else since you opened this page: it is {now} now. Nothing "
                                     "was saved; reload the page, and make your change again if it still holds.")
        return cleaned

    def clean_status_reason(self):
        try:
            return status_reason_clean(self.cleaned_data["status_reason"])
        except ApplicationError as exc:
            raise ValidationError(exc.message) from None


class UserSetPasswordForm(BaseSetPasswordForm):
    """Django's "set password" form, writing the password alone: it wrote the whole row as read before the new
    password was hashed (the slow step), over a log-in or the address proved by the owner meanwhile (found by
    review)."""

    def save(self, commit=True):
        user = super().save(commit=False)
        if commit:
            user.save(update_fields=["password"])
        return user


class UserActionForm(ActionForm):
    """The list's actions bar, with the reason the (de)activation actions tell the accounts' owners."""

    reason = forms.CharField(label="Reason:", required=False, max_length=REASON_MAX_LENGTH, help_text=_REASON_HELP)


status_changes = History(
    AccountStatusChange, "user", [("change", lambda c: "reactivated" if c.active else "deactivated"), "by", "reason",
                                  "at"],
    ordering=["-at", "-id"], select_related=["by"], title="Deactivations and reactivations")


@admin.register(User)
class UserAdmin(PageSetsAdmin, HistoryAdmin, BaseUserAdmin):
    ordering = ["email"]
    list_display = ["email", "is_staff", "is_active", "node_count", "date_joined", "last_login"]
    list_filter = ["is_staff", "is_active", "date_joined"]
    search_fields = ["email"]
    fieldsets = [
        (None, {"fields": ["email", "email_verified_at", "password"],
                "description": "A changed address must be verified again by its owner (the site's Security page "
                               "sends the link) before the account rents or lists."}),
        ("Permissions", {"fields": ["is_active", "is_staff", "is_superuser", "groups", "user_permissions"]}),
        ("Dates", {"fields": ["last_login", "date_joined"]}),
    ]
    # What the system writes is shown, never posted: an editable "last login" wrote the log-in the page had shown over
    # one made while it was open (found by review). The address's proof is the verification's.
    readonly_fields = ["email_verified_at", "last_login", "date_joined"]
    add_form = UserAddForm
    form = UserChangeForm
    change_password_form = UserSetPasswordForm
    add_fieldsets = [(None, {"classes": ["wide"], "fields": ["email"],
                             "description": "The account gets no password: its owner sets one from the log-in "
                                            "page's “Forgot your password?”, which e-mails this address."})]

    actions = ["turn_off_two_factor", "deactivate_accounts", "reactivate_accounts"]
    action_form = UserActionForm
    latest_status_changes = status_changes
    histories = ["latest_status_changes"]

    def get_queryset(self, request):
        # A subquery, not Count("nodes"): that aggregate made both of the list's counts of accounts join every node
        # under a GROUP BY; Django leaves an unused subquery out of count(), and runs it for the rows shown.
        nodes = (Node.objects.filter(provider=OuterRef("pk")).order_by().values("provider")
                 .annotate(n=Count("pk")).values("n"))
        return super().get_queryset(request).annotate(_nodes=Coalesce(Subquery(nodes), 0))

    GRANTS = ["is_staff", "is_superuser", "groups", "user_permissions"]

    def get_readonly_fields(self, request, obj=None):
        fields = list(super().get_readonly_fields(request, obj))
        if not request.user.is_superuser:
            fields += self.GRANTS  # shown, not editable: each grants permissions
        # Not the operator's own address: with it, a copied operator session would send the password reset to an
        # address of its choosing and keep the account for good (as the own password, user_change_password). Nor
        # its own "active": an operator locked out of the panel (account_status refuses it too).
        return [*fields, "email", "is_active"] if obj is not None and obj.pk == request.user.pk else fields

    def get_fieldsets(self, request, obj=None):
        fieldsets = super().get_fieldsets(request, obj)
        if obj is None or obj.pk == request.user.pk or not self.has_change_permission(request, obj):
            return fieldsets
        # The reason goes under "Active" for those who may change it (a form field, not the model's).
        return [(name, {**options, "fields": [*options["fields"], "status_reason"]}) if name == "Permissions"
                else (name, options) for name, options in fieldsets]

    # One rule for the change form, the password page and the actions (Django asks these with the account): a
    # staff account is a superuser's to change. Without change, a viewer gets the read-only page.
    def has_change_permission(self, request, obj=None):
        return super().has_change_permission(request, obj) and not _staff_of_a_non_superuser(request, obj)

    def has_delete_permission(self, request, obj=None):
        # Deactivate instead: deleting an account took the audit trail with it. Django's LogEntry.user is CASCADE
        # (every admin log line of a deleted operator: keys revoked, nodes retired, passwords set) and
        # AccountStatusChange.by is SET_NULL (who deactivated whom). No delete page, no delete_selected (review r53).
        return False

    def save_model(self, request, obj, form, change):
        # Against the stored values (form.initial, read with the row), not form.changed_data: that compares with the
        # page's values (the guarded fields' hidden initials, UserChangeForm.clean).
        old_address = form.initial.get("email", "") if change else ""
        if change and obj.email != old_address:
            obj.email_verified_at = None  # an operator typed it: its owner proves it (email_verification.py)
            # Ends the links e-mailed before (verification, reset), even to an address changed back to later.
            obj.email_changed_at = timezone.now()
        # "Active" is turned by account_status, not by this save: deactivating stops what the account runs.
        stored_active = bool(form.initial.get("is_active"))
        turned_on = change and bool(obj.is_active) and not stored_active
        turned_off = change and stored_active and not obj.is_active
        if turned_on or turned_off:
            obj.is_active = stored_active
        if change:
            # Only the columns the operator changed: the row was read when the form was sent, and a whole-row save
            # wrote back what its owner committed meanwhile (a new password, the sessions ended by sessions_epoch, a
            # log-in; found by review). Nothing when nothing changed.
            columns = self.changed_columns(form, obj)
            if columns:
                obj.save(update_fields=columns)
        else:
            super().save_model(request, obj, form, change)
        reason = form.cleaned_data.get("status_reason", "")
        if turned_off:
            account_deactivate(user=obj, by=request.user, reason=reason)
        elif turned_on:
            account_reactivate(user=obj, by=request.user, reason=reason)
        if old_address and old_address != obj.email:
            new_address = obj.email
            transaction.on_commit(lambda: password_svc.address_changed_by_operator_notify(
                old_address=old_address, new_address=new_address))

    @staticmethod
    def changed_columns(form, obj) -> list[str]:
        """The page's own columns whose value the save would change from the row as read (`form.initial`; "active"
        is account_status's to write, restored to the stored value above), and the address's proof with the
        address. The sets are PageSetsForm's."""
        columns = {f.name for f in obj._meta.concrete_fields if not f.primary_key}
        changed = [name for name, field in form.fields.items()
                   if name in columns and not field.disabled and getattr(obj, name) != form.initial.get(name)]
        return [*changed, "email_verified_at", "email_changed_at"] if "email" in changed else changed

    # Every action names the permission it needs: without one, an account that may only view the list could run it.
    @admin.action(description="Turn off two-factor log-in (after checking who is asking)", permissions=["change"])
    def turn_off_two_factor(self, request, queryset):
        refused = []
        for user in queryset:
            if self.has_change_permission(request, user):
                was_on = two_factor_enabled(user=user)
                two_factor_disable(user=user, base_url=request.build_absolute_uri("/"))
                if was_on:  # the admin's record of which operator did it, only where it was on
                    self.log_change(request, user, "Turned off two-factor log-in.")
            else:
                refused.append(user.email)
        if refused:
            messages.error(request, "Only a superuser turns off a staff account's two-factor log-in; left on for "
                                    + ", ".join(refused) + ".")
        if len(refused) < len(queryset):
            messages.success(request, "Two-factor log-in is off for the other selected accounts." if refused
                             else "Two-factor log-in is off for the selected accounts.")

    @admin.action(description="Deactivate selected accounts (stops their instances, takes their servers off the "
                               "offers; with the reason above)", permissions=["change"])
    def deactivate_accounts(self, request, queryset):
        self._turn(request, queryset, account_deactivate, "deactivated")

    @admin.action(description="Reactivate selected accounts (nothing is restarted; with the reason above)",
                  permissions=["change"])
    def reactivate_accounts(self, request, queryset):
        self._turn(request, queryset, account_reactivate, "reactivated")

    def _turn(self, request, queryset, service, done_word):
        """Each selected account through the service, as its page would; refused: a staff account for a
        non-superuser (has_change_permission), what the service refuses (the operator's own account, a reason)."""
        reason = request.POST.get("reason", "")
        done, unchanged, refused = [], [], []
        for user in queryset.order_by("pk"):
            if not self.has_change_permission(request, user):
                refused.append(f"{user.email}: only a superuser changes a staff account")
                continue
            try:
                change = service(user=user, by=request.user, reason=reason)
            except ApplicationError as exc:
                refused.append(f"{user.email}: {str(exc).rstrip('.')}")  # the service's sentence, one full stop
                continue
            if change is None:
                unchanged.append(user.email)
            else:
                done.append(user.email)
                self.log_change(request, user, f"{done_word.capitalize()}" + (f": {reason.strip()}" if reason.strip()
                                                                             else "") + ".")
        if done:
            messages.success(request, f"{done_word.capitalize()}: {', '.join(done)}.")
        if unchanged:
            messages.info(request, f"{done_word.capitalize()} already: {', '.join(unchanged)}.")
        for line in refused:
            messages.error(request, f"Left as it was: {line}.")

    @admin.display(ordering="_nodes", description="nodes")
    def node_count(self, user):
        return user._nodes

    def user_change_password(self, request, id, form_url=""):
        """Django's "set password" page, which asks no old password: not for the operator's own account (a copied
        operator session would take the account over for good; /account/password/ asks the old password behind
        the lock-out). For another account the owner is e-mailed; every session of theirs ends with the old
        password (its hash is in the session's), their API keys stay, as after a change on the site."""
        target = self.get_object(request, unquote(id))
        if target is not None and target.pk == request.user.pk:  # the object, not the URL: "01" is 1
            messages.error(request, "Change your own password on your Security page: it asks for the current one.")
            return HttpResponseRedirect(reverse("password-change"))
        response = super().user_change_password(request, id, form_url)
        if request.method == "POST" and target is not None:
            after = User.objects.filter(pk=target.pk).first()
            if after is not None and after.password != target.password:
                password_svc.password_set_by_operator_notify(user=after, base_url=request.build_absolute_uri("/"))
        return response


def _staff_of_a_non_superuser(request, obj) -> bool:
    return staff_of_a_non_superuser(request.user, obj)


# A group's permissions are granted to its members: editing one is granting, a superuser's alone (a member with
# change_group gave its own group every permission). Other staff may view groups.
if admin.site.is_registered(Group):
    admin.site.unregister(Group)


class GroupForm(OwnChangesForm, forms.ModelForm):
    """A group's permissions: only the operator's change to the set the page showed is made (PageSetsForm); written
    as shown, a page opened before another superuser revoked one gave it back to every member (found by review). Its
    name as every OwnChangesForm's field: written only when changed, refused when renamed meanwhile."""

    page_sets = ("permissions",)

    class Meta:
        model = Group
        fields = ["name", "permissions"]


@admin.register(Group)
class GroupAdmin(OwnChangesAdmin, BaseGroupAdmin):
    form = GroupForm

    def has_add_permission(self, request):
        return request.user.is_superuser

    def has_change_permission(self, request, obj=None):
        return request.user.is_superuser

    def has_delete_permission(self, request, obj=None):
        return request.user.is_superuser


@admin.register(ApiKey)
class ApiKeyAdmin(NothingEditableAdmin, admin.ModelAdmin):
    list_display = ["prefix", "user", "name", "created_at", "last_used_at", "revoked_at"]
    # Grows with the platform's life, read on every page: newest first by the primary key's index (the model's order,
    # newest first by its creation, has none and sorted the whole table), counted once, estimated when unfiltered and
    # large (core/admin_paginator.py; found by review).
    ordering = ["-id"]
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    list_filter = [("revoked_at", admin.EmptyFieldListFilter), "created_at"]
    search_fields = ["user__email", "prefix", "name"]
    # key_hash is left out on purpose: operators never need it.
    fields = ["user", "name", "prefix", "created_at", "last_used_at", "revoked_at"]
    readonly_fields = fields  # type: ignore[assignment]  # names only here; django-stubs types `fields` as groups
    list_select_related = ["user"]
    actions = ["revoke"]

    def has_add_permission(self, request):
        return False  # keys are created by their owners, who alone see the secret

    def has_delete_permission(self, request, obj=None):
        return False  # revoke instead (the action below): a revoked key keeps its record, when it was last used

    # A key follows its owner's rule (UserAdmin.has_change_permission): a staff account's keys are a superuser's to
    # revoke. Revoking them cuts the account off as deactivating it does; before, any staff account with
    # change_apikey revoked a superuser's keys (found by review). The key's page and the action ask this.
    def has_change_permission(self, request, obj=None):
        return (super().has_change_permission(request, obj)
                and not (obj is not None and _staff_of_a_non_superuser(request, obj.user)))

    @admin.action(description="Revoke selected API keys (their owners are told by e-mail)", permissions=["change"])
    def revoke(self, request, queryset):
        refused, revoked = [], 0
        told: dict[int, tuple[User, list[ApiKey]]] = {}
        # Keys revoked already (by their owner too) are left out: nothing is done to them, nobody is told.
        for key in queryset.filter(revoked_at__isnull=True).select_related("user").order_by("pk"):
            if not self.has_change_permission(request, key):
                refused.append(f"{key.prefix} ({key.user.email})")
                continue
            api_key_revoke(api_key=key)
            self.log_change(request, key, "Revoked.")  # the admin's record of which operator did it
            told.setdefault(key.user_id, (key.user, []))[1].append(key)
            revoked += 1
        # The owner is told, as of every operator's security change (password, address, two-factor, deactivation):
        # their automation starts getting 401s, with no word of why before (review r53). One e-mail per owner.
        for owner, keys in told.values():
            names = ", ".join(f"{key.name or 'no name'} ({key.prefix}…)" for key in keys)
            these, them = ("these API keys", "them") if len(keys) > 1 else ("this API key", "it")
            operator_change_notify(
                user=owner, subject="An operator revoked your API key" + ("s" if len(keys) > 1 else ""),
                change=(f"An operator of {settings.PLATFORM_NAME} just revoked {these} of your account: {names}. "
                        f"Requests made with {them} are refused from now on. Make a new key on the API keys page if "
                        "you still need one."))
        if refused:
            messages.error(request, "Only a superuser revokes a staff account's API keys; left as they are: "
                                    + ", ".join(refused) + ".")
        if revoked or not refused:
            messages.success(request, "Revoked the other selected keys." if refused else "Revoked.")


@admin.register(SshKey)
class SshKeyAdmin(NothingEditableAdmin, admin.ModelAdmin):
    list_display = ["__str__", "user", "key_type", "fingerprint", "created_at"]
    # Grows with the platform's life, read on every page: newest first by the primary key's index (the model's order,
    # newest first by its creation, has none and sorted the whole table), counted once, estimated when unfiltered and
    # large (core/admin_paginator.py; found by review).
    ordering = ["-id"]
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    search_fields = ["user__email", "name", "fingerprint"]
    list_select_related = ["user"]
    fields = ["user", "name", "public_key", "fingerprint", "created_at"]
    readonly_fields = fields  # type: ignore[assignment]  # names only here; django-stubs types `fields` as groups

    def has_add_permission(self, request):
        return False  # keys are added by their owners through the API, which parses them

    def has_delete_permission(self, request, obj=None):
        # Their owners' to remove (ssh_key_delete, from the API or their page): deleted here, a renter's next
        # instance silently lacked a key they had added, with no record of who removed it.
        return False

    @admin.display(description="type")
    def key_type(self, key):
        return key.public_key.split(" ", 1)[0]


class AdminLoginForm(ThrottledLoginFormMixin, AdminAuthenticationForm):
    """The admin's log-in, behind the same lock-out as the API's and the pages' (marketplace/auth.py). An account
    with two-factor log-in logs in on the site's page, which asks for the code, and comes back."""

    def confirm_login_allowed(self, user):
        super().confirm_login_allowed(user)
        if two_factor_enabled(user=user):
            raise ValidationError(
                "This account uses two-factor log-in: log in on the site's log-in page "
                "(/accounts/login/?next=/admin/), which asks for the code, then come back here.", code="two_factor")


admin.site.login_form = AdminLoginForm
_django_admin_login = admin.site.login


def _admin_login(request, extra_context=None):
    """AdminSite.login behind the per-client `auth` rate of the pages' and the API's log-in (one budget), as the
    site's log-in page: the lock-out (AdminLoginForm) counts only failures."""
    if request.method == "POST" and (refused := auth_rate_refusal(request)):
        return refused
    return _django_admin_login(request, extra_context)


# Read when the admin's URLs are built (config/urls.py), as password_change below.
admin.site.login = _admin_login  # type: ignore[method-assign]


class AdminPasswordChangeForm(ThrottledPasswordChangeForm):
    required_css_class = "required"  # as Django's admin form


class AdminPasswordChangeView(PasswordChangeView):
    """/admin/password_change/ with the site's form: the old password behind the log-in lock-out (a 429 once
    locked), the address told, every other session of the account ended (Django re-hashes this one)."""

    form_class = AdminPasswordChangeForm

    def get_form_kwargs(self):
        return {**super().get_form_kwargs(), "request": self.request}

    def form_valid(self, form):
        response = super().form_valid(form)
        password_svc.password_changed_notify(user=form.user, base_url=self.request.build_absolute_uri("/"))
        return response

    def form_invalid(self, form):
        return with_form_status(super().form_invalid(form), form)


def _admin_password_change(request, extra_context=None):
    """AdminSite.password_change with AdminPasswordChangeView in place of Django's view."""
    site = admin.site
    defaults = {
        "success_url": reverse("admin:password_change_done", current_app=site.name),
        "extra_context": {**site.each_context(request), **(extra_context or {})},
    }
    if site.password_change_template is not None:
        defaults["template_name"] = site.password_change_template
    request.current_app = site.name
    return AdminPasswordChangeView.as_view(**defaults)(request)


# Read when the admin's URLs are built (config/urls.py, after every admin module is imported).
admin.site.password_change = _admin_password_change  # type: ignore[method-assign]

# django-otp's own admin pages would show the TOTP secrets and the recovery codes (their tables are empty since the
# project's encrypted devices replaced them, marketplace/models/two_factor.py), and operators never see a secret:
# for a user who lost both the phone and the codes, the users' list has an action that turns two-factor off.
for _otp_model in (TOTPDevice, StaticDevice):
    if admin.site.is_registered(_otp_model):
        admin.site.unregister(_otp_model)
