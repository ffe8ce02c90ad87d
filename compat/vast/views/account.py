"""`show user` and the account's SSH keys."""
from typing import Any

from rest_framework.response import Response

from billing.selectors import balance_status
from core.api.scopes import ANY, RENTER_ONLY, missing_scopes
from core.errors import NotFound, ValidationFailed
from marketplace.models import SshKey
from marketplace.services import ssh_keys as ssh_svc

from .. import offers
from .base import VastView, _body, _epoch, _refuse_unknown


class CurrentUserView(VastView):
    """GET /api/v0/users/current: `vastai show user`. One prepaid wallet: `balance` and `credit` are both it, shown
    to keys that may read the balance on /api/v1/ (renter or read); null (the CLI's "-") to a provider-only key,
    which may still ask who it is (found by review: it read the balance /api/v1/ refuses it)."""

    api_scope = ANY  # core/api/scopes.py

    def get(self, request):
        user = request.user
        balance = None
        if not missing_scopes(scopes=request.auth.scopes, rule=RENTER_ONLY, method="GET"):
            balance = offers.usd(balance_status(user=user).balance_micros)
        return Response({"id": user.pk, "email": user.email, "username": user.email,
                         "balance": balance, "credit": balance})


def key_row(key: SshKey) -> dict[str, Any]:
    return {"id": key.pk, "name": key.name, "public_key": key.public_key, "ssh_key": key.public_key,
            "fingerprint": key.fingerprint, "created_at": _epoch(key.created_at)}


class SshKeysView(VastView):
    """GET/POST /api/v0/ssh/: `vastai show ssh-keys`, `vastai create ssh-key KEY`."""

    api_scope = RENTER_ONLY  # core/api/scopes.py

    def get(self, request):
        return Response([key_row(k) for k in SshKey.objects.filter(user=request.user).order_by("id")])

    def post(self, request):
        body = _body(request)
        _refuse_unknown(body, {"ssh_key"})
        text = body.get("ssh_key")
        if not isinstance(text, str) or not text.strip() or len(text) > ssh_svc.MAX_KEY_CHARS:
            raise ValidationFailed("Give one OpenSSH public key as `ssh_key`.", field="ssh_key")
        key = ssh_svc.ssh_key_create(user=request.user, public_key=text.strip())
        return Response({"success": True, **key_row(key)})


class SshKeyView(VastView):
    """DELETE /api/v0/ssh/ID/: `vastai delete ssh-key ID`."""

    api_scope = RENTER_ONLY  # core/api/scopes.py

    def delete(self, request, key_id: int):
        key = SshKey.objects.filter(user=request.user, pk=key_id).first()
        if key is None:
            raise NotFound(f"No SSH key {key_id}.")
        ssh_svc.ssh_key_delete(ssh_key=key)
        return Response({"success": True})
