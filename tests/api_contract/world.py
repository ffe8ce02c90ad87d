"""Rows owned by one user, made straight through services and the ORM (no SSH, no Celery, no Stripe):
the contract suite needs one object of a kind, the query counts need N of every kind."""
import itertools
from datetime import date, timedelta

from django.db import transaction
from django.utils import timezone

from billing.models import (
    AccountKind,
    BillingEvent,
    Card,
    Dispute,
    EventKind,
    Payout,
    Refund,
    StripeEvent,
    TopUp,
    TransactionKind,
)
from billing.services.customers import profile_for
from billing.services.ledger import ledger_post, platform_account, user_account
from billing.services.metering import usage_close
from billing.services.top_ups import top_up_credit
from marketplace.models import ApiKey, Image, Instance, Interruption, InterruptionCause, Node, SshKey, User, Volume
from marketplace.services import instances as svc
from marketplace.services.accounts import api_key_create
from marketplace.services.ssh_keys import ssh_key_create
from marketplace.services.volumes import volume_create, volume_mark_available
from provisioning.models import NodeEvent, VerificationRun
from tests.billing.helpers import book, run, stop
from tests.factories import UserFactory, make_listed_node, make_node
from tests.marketplace.mig_helpers import make_mig_node
from tests.marketplace.renting_helpers import ed25519_key

_seq = itertools.count(1)


def api_key(user: User) -> ApiKey:
    return api_key_create(user=user, name=f"extra {next(_seq)}")[0]


def ssh_key(user: User) -> SshKey:
    return ssh_key_create(user=user, public_key=ed25519_key(), name=f"key {next(_seq)}")


def card(user: User) -> Card:
    n = next(_seq)
    return Card.objects.create(user=user, stripe_payment_method_id=f"pm_contract_{n}", brand="visa",
                               last4=f"{n % 10000:04d}", exp_month=12, exp_year=2040)


def top_up(user: User) -> TopUp:
    """A top-up credited through the ledger, as Stripe's success makes it: a line of the month's statement (before,
    a bare row, no line, so the query counts never measured the statement's top-up lines: review r54)."""
    saved = card(user)
    made = TopUp.objects.create(user=user, amount_micros=25_000_000, card=saved, card_label=str(saved))
    with transaction.atomic():
        top_up_credit(top_up_id=made.pk, payment_intent_id=f"pi_contract_{made.pk}", amount_micros=made.amount_micros)
    made.refresh_from_db()
    return made


def node(user: User) -> Node:
    """A pending node of `user` (the provider)."""
    return make_node(user)


def benchmarked_node(user: User) -> Node:
    found = make_node(user)
    VerificationRun.objects.create(node=found, verdict="verified", score=90.0, figures={"mode": "simulated"})
    return found


def listed_node(user: User) -> Node:
    return make_listed_node(user, gpu_count=16)


def instance(user: User, on: Node | None = None) -> Instance:
    """A requested instance of `user` (the renter), on `on` or on another provider's listed node."""
    return book(user, on or listed_node(UserFactory()))


def mig_instance(user: User) -> Instance:
    """A running instance of `user` holding two MIG slices of another provider's split A100."""
    split = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=1)
    booked, _ = svc.instance_create(renter=user, node_id=split.pk, num_gpus=2, mig_profile="3g.40gb",
                                    image=Image.objects.get(slug="pytorch-2-5"), ssh_public_keys=[ed25519_key()])
    return run(booked)


def running_instance(user: User, on: Node | None = None) -> Instance:
    return run(instance(user, on))


def stopped_instance(user: User, on: Node | None = None) -> Instance:
    return stop(running_instance(user, on))


def volume(user: User, on: Node | None = None) -> Volume:
    """An available volume of `user` on `on` or on another provider's listed node."""
    created = volume_create(owner=user, node_id=(on or listed_node(UserFactory())).pk, size_gb=10)
    available = volume_mark_available(volume_id=created.pk)
    assert available is not None
    return available


def usage(user: User, on: Node | None = None):
    """A running instance of `user` with one metered interval (a ledger charge)."""
    running = running_instance(user, on)
    return usage_close(instance=running, until=running.started_at + timedelta(seconds=600))


def event(user: User) -> BillingEvent:
    return BillingEvent.objects.create(user=user, kind=EventKind.CREDIT, message="A credit.", data={"n": 1})


def payout(user: User) -> Payout:
    """A pending payout of a week of `user`'s earnings (a balanced ledger posting, as payout_create makes)."""
    n = next(_seq)
    amount = 10_000_000
    earnings = user_account(user_id=user.pk, kind=AccountKind.PROVIDER_EARNINGS)
    txn, _ = ledger_post(idempotency_key=f"contract-payout:{user.pk}:{n}", kind=TransactionKind.PAYOUT,
                         lines=[(earnings, -amount), (platform_account(kind=AccountKind.PAYOUT_CLEARING), amount)])
    start = date(2020, 1, 6) + timedelta(weeks=n)
    return Payout.objects.create(provider=user, period_start=start, period_end=start + timedelta(days=6),
                                 amount_micros=amount, destination="acct_1Contract", transaction=txn,
                                 created_at=timezone.now())


def extras(user: User, *, running_on: Node) -> None:
    """One more row of each model only the admin lists: refunds, disputes, Stripe events, node events,
    interruptions, and a user with a billing profile."""
    n = next(_seq)
    now = timezone.now()
    refunded = top_up(user)
    Refund.objects.create(top_up=refunded, amount_micros=1_000_000, reason="admin list", created_by=user)
    Dispute.objects.create(stripe_dispute_id=f"dp_contract_{n}", top_up=refunded, amount_micros=1_000_000)
    StripeEvent.objects.create(event_id=f"evt_contract_{n}", type="customer.created", payload={"id": n})
    NodeEvent.objects.create(node=running_on, kind="note", message="admin list")
    Interruption.objects.create(instance=running_on.instances.first(), cause=InterruptionCause.values[0],
                                started_at=now, detected_at=now)
    profile_for(user=UserFactory())


def notification(user: User):
    from notifications.services.notify import Kind, notify

    return notify(user=user, kind=Kind.CREDIT_POSTED, payload={"amount": "1.00", "message": "A credit."},
                  dedupe_key=f"contract:{next(_seq)}")


def webhook_endpoint(user: User):
    from notifications.services.webhooks import endpoint_create

    return endpoint_create(user=user, url=f"http://127.0.0.1:9/contract/{next(_seq)}")[0]


def webhook_delivery(user: User):
    from notifications.services.webhooks import endpoint_test

    return endpoint_test(endpoint=webhook_endpoint(user))


MAKERS = {f.__name__: f for f in (api_key, ssh_key, card, top_up, node, benchmarked_node, listed_node, instance,
                                   running_instance, stopped_instance, usage, event, payout, notification,
                                   webhook_endpoint, webhook_delivery, volume)}


def make(kind: str, user: User):
    return MAKERS[kind](user)


def populate(user: User, n: int) -> None:
    """n more of every kind `user` can own: keys, cards, top-ups, events, payouts, nodes listed as offers with
    benchmarks (all on the first node), and instances (running, each with a usage interval) on them."""
    for _ in range(n):
        api_key(user)
        ssh_key(user)
        top_up(user)
        event(user)
        payout(user)
        offered = listed_node(user)
        usage(user, on=offered)
        volume(user, on=offered)
        extras(user, running_on=offered)
        mig_instance(user)
        notification(user)
        delivery = webhook_delivery(user)
        delivery.attempt_log.create(number=1, status_code=500, error="Answered 500")
        first = Node.objects.filter(provider=user).order_by("pk").first()
        VerificationRun.objects.create(node=first, verdict="verified", score=90.0, figures={"mode": "simulated"})
