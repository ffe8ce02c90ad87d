"""E-mail verification on the pages: the link from the e-mail, and "Send the link again". Thin:
marketplace/services/email_verification.py."""
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpResponseRedirect
from django.shortcuts import redirect, render
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_GET, require_POST

from core.errors import ApplicationError, Conflict
from core.web_errors import message_error
from marketplace.services import email_verification as svc


@require_GET
def email_verify(request, uidb64: str, token: str):
    """The link in the e-mail. Opening it is enough: it proves only that the reader holds the mailbox, which is the
    point, and it gives nothing away."""
    try:
        user = svc.email_verify(uidb64=uidb64, token=token)
    except svc.InvalidVerificationLink as exc:
        return render(request, "marketplace/email_verify.html", {"error": exc.message}, status=400)
    return render(request, "marketplace/email_verify.html", {"verified_email": user.email})


@login_required
@require_POST
def email_verification_resend(request):
    user = request.user
    try:
        svc.email_verification_resend(user=user, base_url=request.build_absolute_uri("/"))
    except Conflict:
        messages.info(request, "Your e-mail address is verified already.")
    except ApplicationError as exc:  # too many for the hour, or the mail server refused it
        message_error(request, exc)
    else:
        messages.success(request, f"We e-mailed a verification link to {user.email}: open it, then come back.")
    next_url = request.POST.get("next") or ""
    if not url_has_allowed_host_and_scheme(next_url, allowed_hosts={request.get_host()},
                                           require_https=request.is_secure()):
        return redirect("account-security")
    # A URL, never a URL name: redirect() would reverse a bare word such as "ssh-key-delete" (a 500).
    return HttpResponseRedirect(next_url)
