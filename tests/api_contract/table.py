"""Every verb of every path of /api/v1/, and who may call it. A path or verb in docs/openapi.yaml that is
missing here fails the suite (test_contract.py), so a new resource cannot be left out.

access:
  PUBLIC    anyone, no log-in: `ok` for an anonymous caller.
  USER      a logged-in user; anonymous is a 401. With `owned`, the object in the path belongs to the caller:
            anyone else gets a 404 (an operator: `operator_other`), never a 403 and never the object.
  OPERATOR  staff with the permission (refunds: billing.add_refund): anonymous 401, any other user 403.
  STRIPE    Stripe itself: no log-in, a signed body; unsigned is a 400.
"""
import hashlib
import hmac
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

PUBLIC, USER, OPERATOR, STRIPE = "public", "user", "operator", "stripe"

GOOD_PASSWORD = "a long enough pass 42"
USER_PASSWORD = "correct horse battery staple"  # what UserFactory sets


@dataclass(frozen=True)
class Call:
    method: str
    path: str  # as docs/openapi.yaml writes it
    access: str
    ok: int  # the answer to the owner (PUBLIC: to anyone; OPERATOR: to an operator)
    owned: str | None = None  # world.MAKERS kind of the object in the path, made for the owner
    lists: str | None = None  # a collection of the caller's rows of this world.MAKERS kind, nobody else's
    path_params: dict = field(default_factory=dict)  # path parameters that are not the owned object's
    body: Callable[[SimpleNamespace], dict] | None = None  # the owner's request body
    headers: Callable[[SimpleNamespace, bytes], dict] | None = None  # the owner's extra headers, given the body
    operator_other: int = 404  # an operator who does not own the object
    stripe: bool = False  # the owner's case talks to Stripe (localstripe)

    @property
    def id(self) -> str:
        return f"{self.method.upper()} {self.path}"

    def url(self, obj=None) -> str:
        params = dict(self.path_params)
        if obj is not None:
            params.setdefault("id", obj.pk)
        return re.sub(r"\{(\w+)\}", lambda m: str(params[m[1]]), self.path)


# --------------------------------------------------------------------------------- owners' request bodies


def _node_body(ctx):
    return {"name": "contract", "address": "10.9.9.9", "ssh_port": 2222, "ssh_user": "gpu", "country": "DE",
            "gpu_model": "a100-80gb-sxm", "gpu_count": 2, "price_per_gpu_hour": "1.250000", "runtime": "sim"}


def _instance_body(ctx):
    from tests.api_contract import world
    from tests.factories import UserFactory
    from tests.marketplace.renting_helpers import ed25519_key

    offer = world.listed_node(UserFactory())
    return {"offer": offer.pk, "num_gpus": 1, "image": "pytorch-2-5", "ssh_public_key": ed25519_key()}


def _volume_body(ctx):
    from tests.api_contract import world
    from tests.factories import UserFactory

    return {"offer": world.listed_node(UserFactory()).pk, "size_gb": 10}


def _volume_confirm(ctx):
    """The caller's newest volume's name (the owner's: made before the body; anyone else has none)."""
    from marketplace.models import Volume

    user = getattr(ctx.api, "user", None)
    name = Volume.objects.filter(owner=user).order_by("-pk").values_list("name", flat=True).first() if user else None
    return {"confirm": name or "vol-notyours00"}


def _ssh_key_body(ctx):
    from tests.marketplace.renting_helpers import ed25519_key

    return {"public_key": ed25519_key("contract")}


def _saved_card_id(ctx) -> int:
    """A card saved through the API at localstripe."""
    response = ctx.api.post("/api/v1/billing/cards/", {"payment_method": "pm_card_visa"}, format="json")
    assert response.status_code == 201, response.content
    return response.json()["id"]


def _top_up_body(ctx):
    return {"amount": "25.00", "card": _saved_card_id(ctx)}


def stripe_signature(body: bytes) -> str:
    from django.conf import settings

    at = int(time.time())
    digest = hmac.new(settings.STRIPE_WEBHOOK_SECRET.encode(), f"{at}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={at},v1={digest}"


def _refund_body(ctx):
    """A customer's top-up charged at localstripe and credited by its signed payment_intent.succeeded event."""
    import stripe

    from billing.models import TopUp
    from tests.factories import UserFactory

    customer = ctx.client_for(UserFactory())
    card = _saved_card_id(SimpleNamespace(api=customer))
    answer = customer.post("/api/v1/billing/top-ups/", {"amount": "40.00", "card": card}, format="json")
    assert answer.status_code == 202, answer.content
    top_up = TopUp.objects.get(pk=answer.json()["id"])
    client = stripe.StripeClient("sk_test_x", base_addresses={"api": ctx.localstripe.url}, max_network_retries=0)
    intent = client.v1.payment_intents.retrieve(top_up.payment_intent_id)
    event = json.dumps({"id": f"evt_{intent.id}", "type": "payment_intent.succeeded",
                        "data": {"object": intent.to_dict()}}).encode()
    delivered = customer.post("/api/v1/billing/stripe/webhook/", data=event, content_type="application/json",
                              HTTP_STRIPE_SIGNATURE=stripe_signature(event))
    assert delivered.json()["status"] == "processed", delivered.content
    return {"top_up": top_up.pk, "amount": "15.00", "reason": "contract test"}


def _webhook_body(ctx):
    return {"id": "evt_contract", "type": "customer.created", "data": {"object": {"id": "cus_contract"}}}


def _register_body(ctx):
    return {"email": "contract.new@example.com", "password": GOOD_PASSWORD}


def _confirm_body(ctx):
    from django.core import mail

    ctx.anon.post("/api/v1/auth/register/", _register_body(ctx), format="json")
    [message] = [m for m in mail.outbox if m.to == ["contract.new@example.com"]]
    return {"token": re.search(r"^The token: (\S+)$", message.body, re.M)[1], "password": GOOD_PASSWORD}


def _login_body(ctx):
    from tests.factories import UserFactory

    return {"email": UserFactory().email, "password": USER_PASSWORD}


# ---------------------------------------------------------------------------------------------- the table

V1 = "/api/v1"
B = f"{V1}/billing"

CALLS: list[Call] = [
    # accounts
    Call("post", f"{V1}/auth/register/", PUBLIC, 202, body=_register_body),
    Call("post", f"{V1}/auth/confirm/", PUBLIC, 201, body=_confirm_body),
    Call("post", f"{V1}/auth/login/", PUBLIC, 200, body=_login_body),
    Call("get", f"{V1}/auth/me/", USER, 200),
    # a UserFactory user is verified already: 409 (the 202 and 429: tests/web/test_email_verification.py)
    Call("post", f"{V1}/auth/verify-email/", USER, 409),
    Call("get", f"{V1}/api-keys/", USER, 200, lists="api_key"),
    Call("post", f"{V1}/api-keys/", USER, 201, body=lambda ctx: {"name": "contract"}),
    Call("delete", f"{V1}/api-keys/{{id}}/", USER, 204, owned="api_key"),
    # the public catalogue and offers
    Call("get", f"{V1}/gpu-models/", PUBLIC, 200),
    Call("get", f"{V1}/gpu-models/{{slug}}/", PUBLIC, 200, path_params={"slug": "a100-80gb-sxm"}),
    Call("get", f"{V1}/images/", PUBLIC, 200),
    Call("get", f"{V1}/images/{{slug}}/", PUBLIC, 200, path_params={"slug": "pytorch-2-5"}),
    Call("get", f"{V1}/offers/", PUBLIC, 200),
    Call("get", f"{V1}/offers/{{id}}/", PUBLIC, 200, owned="listed_node"),
    # providers' nodes: operators see every live node and may ask for a re-check, but only the provider changes
    # or retires it (marketplace.api.nodes.ProviderChangesOwnNode)
    Call("get", f"{V1}/nodes/", USER, 200, lists="node"),
    Call("post", f"{V1}/nodes/", USER, 201, body=_node_body),
    Call("get", f"{V1}/nodes/{{id}}/", USER, 200, owned="node", operator_other=200),
    Call("patch", f"{V1}/nodes/{{id}}/", USER, 200, owned="node", body=lambda ctx: {"name": "renamed"},
         operator_other=403),
    Call("delete", f"{V1}/nodes/{{id}}/", USER, 204, owned="node", operator_other=403),
    Call("post", f"{V1}/nodes/{{id}}/verify/", USER, 202, owned="node", operator_other=202),
    Call("get", f"{V1}/nodes/{{id}}/benchmarks/", USER, 200, owned="benchmarked_node", operator_other=200),
    # its events: operators need the admin's provisioning.view_nodeevent too (operator_api has the node and run
    # permissions only)
    Call("get", f"{V1}/nodes/{{id}}/events/", USER, 200, owned="node", operator_other=404),
    # renters' SSH keys and instances: operators see only their own here (the admin shows them all)
    Call("get", f"{V1}/ssh-keys/", USER, 200, lists="ssh_key"),
    Call("post", f"{V1}/ssh-keys/", USER, 201, body=_ssh_key_body),
    Call("get", f"{V1}/ssh-keys/{{id}}/", USER, 200, owned="ssh_key"),
    Call("delete", f"{V1}/ssh-keys/{{id}}/", USER, 204, owned="ssh_key"),
    Call("get", f"{V1}/instances/", USER, 200, lists="instance"),
    Call("post", f"{V1}/instances/", USER, 201, body=_instance_body),
    Call("get", f"{V1}/instances/{{id}}/", USER, 200, owned="instance"),
    Call("delete", f"{V1}/instances/{{id}}/", USER, 202, owned="running_instance"),
    Call("post", f"{V1}/instances/{{id}}/stop/", USER, 202, owned="running_instance"),
    Call("post", f"{V1}/instances/{{id}}/start/", USER, 202, owned="stopped_instance"),
    Call("post", f"{V1}/instances/{{id}}/restart/", USER, 202, owned="running_instance"),
    # The owner's answer is a 409 here: a requested instance has no VM to read logs from yet (reading a running
    # one's logs over SSH is tests/e2e/test_instance_options.py's).
    Call("get", f"{V1}/instances/{{id}}/logs/", USER, 409, owned="instance"),
    Call("get", f"{V1}/volumes/", USER, 200, lists="volume"),
    Call("post", f"{V1}/volumes/", USER, 201, body=_volume_body),
    Call("get", f"{V1}/volumes/{{id}}/", USER, 200, owned="volume"),
    Call("delete", f"{V1}/volumes/{{id}}/", USER, 202, owned="volume", body=_volume_confirm),
    # billing: the wallet
    Call("get", f"{B}/balance/", USER, 200),
    Call("get", f"{B}/usage/", USER, 200, lists="usage"),
    Call("get", f"{B}/events/", USER, 200, lists="event"),
    Call("get", f"{B}/profile/", USER, 200),
    Call("patch", f"{B}/profile/", USER, 200, body=lambda ctx: {"stripe_connect_account_id": "acct_1Contract"}),
    Call("get", f"{B}/statements/", USER, 200),
    Call("get", f"{B}/statements/{{month}}/", USER, 200, path_params={"month": "2026-03"}),
    Call("get", f"{B}/terms/", PUBLIC, 200),
    # billing: cards, top-ups, refunds, the webhook
    Call("get", f"{B}/cards/", USER, 200, lists="card"),
    Call("post", f"{B}/cards/", USER, 201, body=lambda ctx: {"payment_method": "pm_card_visa"}, stripe=True),
    Call("post", f"{B}/cards/setup-intent/", USER, 201, stripe=True),
    Call("delete", f"{B}/cards/{{id}}/", USER, 204, owned="card"),  # Stripe's detach may fail: only logged
    Call("get", f"{B}/top-ups/", USER, 200, lists="top_up"),
    Call("post", f"{B}/top-ups/", USER, 202, body=_top_up_body, stripe=True),
    Call("get", f"{B}/top-ups/{{id}}/", USER, 200, owned="top_up"),
    Call("post", f"{B}/refunds/", OPERATOR, 201, body=_refund_body, stripe=True),
    Call("post", f"{B}/stripe/webhook/", STRIPE, 200, body=_webhook_body,
         headers=lambda ctx, raw: {"HTTP_STRIPE_SIGNATURE": stripe_signature(raw)}),
    # billing: providers' money
    Call("get", f"{B}/earnings/", USER, 200),
    Call("get", f"{B}/payouts/", USER, 200, lists="payout"),
    # notifications: each user's own list, channels, webhook endpoints and their deliveries
    Call("get", f"{V1}/notifications/", USER, 200, lists="notification"),
    Call("get", f"{V1}/notifications/{{id}}/", USER, 200, owned="notification"),
    Call("post", f"{V1}/notifications/{{id}}/read/", USER, 200, owned="notification"),
    Call("post", f"{V1}/notifications/read-all/", USER, 200),
    Call("get", f"{V1}/notifications/unread-count/", USER, 200),
    Call("get", f"{V1}/notification-preferences/", USER, 200),
    Call("put", f"{V1}/notification-preferences/{{kind}}/", USER, 200, path_params={"kind": "low_balance"},
         body=lambda ctx: {"in_app": True, "email": False, "webhook": True}),
    Call("get", f"{V1}/webhook-endpoints/", USER, 200, lists="webhook_endpoint"),
    Call("post", f"{V1}/webhook-endpoints/", USER, 201, body=lambda ctx: {"url": "http://127.0.0.1:9/contract"}),
    Call("get", f"{V1}/webhook-endpoints/{{id}}/", USER, 200, owned="webhook_endpoint"),
    Call("patch", f"{V1}/webhook-endpoints/{{id}}/", USER, 200, owned="webhook_endpoint",
         body=lambda ctx: {"description": "renamed"}),
    Call("delete", f"{V1}/webhook-endpoints/{{id}}/", USER, 204, owned="webhook_endpoint"),
    Call("post", f"{V1}/webhook-endpoints/{{id}}/test/", USER, 202, owned="webhook_endpoint"),
    Call("get", f"{V1}/webhook-deliveries/", USER, 200, lists="webhook_delivery"),
    Call("get", f"{V1}/webhook-deliveries/{{id}}/", USER, 200, owned="webhook_delivery"),
]
