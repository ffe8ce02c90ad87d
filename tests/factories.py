"""factory_boy factories for the marketplace's rows. Nodes go through the real service."""
from decimal import Decimal

import factory
from django.utils import timezone

from marketplace.models import GpuModel, Node, NodeState, User, Verdict
from marketplace.services.accounts import api_key_create
from marketplace.services.nodes import node_register


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = User
        skip_postgeneration_save = True

    email = factory.Sequence(lambda n: f"user{n}@example.com")
    # Verified, as every account that can log in by sign-up is; UserFactory(email_verified_at=None) for one that is not.
    email_verified_at = factory.LazyFunction(timezone.now)
    password = factory.PostGenerationMethodCall("set_password", "correct horse battery staple")

    @factory.post_generation
    def _save(obj, create, extracted, **kwargs):  # noqa: N805 (factory_boy passes the object)
        if create:
            obj.save()


def user_without_address() -> User:
    """An account whose address is empty in the database: no form, API or save() makes one (User.save refuses an
    address no e-mail reaches), but a row emptied by hand must still get no e-mail and no crash."""
    user = UserFactory()
    User.objects.filter(pk=user.pk).update(email="")
    user.refresh_from_db()
    return user


def api_key_for(user: User) -> str:
    return api_key_create(user=user, name="test")[1]


_port = iter(range(20000, 60000))


def make_node(
    provider: User | None = None,
    *,
    gpu_model: str = "a100-80gb-sxm",
    gpu_count: int = 4,
    price: str = "1.500000",
    state: str = NodeState.PENDING,
    verdict: str = Verdict.UNVERIFIED,
    **fields,
) -> Node:
    """A node registered through node_register, then put straight into `state`/`verdict`."""
    params = {
        "name": "node",
        "address": "10.0.0.1",
        "ssh_port": next(_port),
        "ssh_user": "gpu",
        "country": "DE",
        "city": "Frankfurt",
        "datacenter": "FRA1",
        "runtime": "sim",
    }
    extra = {k: fields.pop(k) for k in ("score", "reliability", "listed") if k in fields}
    params.update(fields)
    node = node_register(
        provider=provider or UserFactory(),
        gpu_model=GpuModel.objects.get(slug=gpu_model),
        gpu_count=gpu_count,
        price_per_gpu_hour=Decimal(price),
        **params,
    )
    Node.objects.filter(pk=node.pk).update(state=state, verdict=verdict, **extra)
    node.refresh_from_db()
    return node


def make_listed_node(provider: User | None = None, **kwargs) -> Node:
    kwargs.setdefault("score", 1.0)
    kwargs.setdefault("reliability", 0.99)
    return make_node(provider, state=NodeState.ACTIVE, verdict=Verdict.VERIFIED, **kwargs)
