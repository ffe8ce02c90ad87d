"""API key scopes: what a key may do, and the rule each API view declares.

A key holds one or more scopes:
- `read`: safe methods (GET, HEAD, OPTIONS) on every endpoint, nothing else;
- `renter`: every method on the renter's endpoints (instances, volumes, SSH keys, balance, cards, top-ups, usage,
  statements, offers): the wallet is the renter's, so a `provider`-only key reads neither its balance nor its
  statements;
- `provider`: every method on the provider's endpoints (nodes and their benchmarks, earnings, payouts).

Every API view declares `api_scope`, one of:
- PUBLIC: anyone may call it without a key (sign-up, log-in, the catalogue, offers search, terms); a key sent
  anyway still cannot write with only `read`;
- ANY: any key, whatever its scopes (who am I, your API keys, billing settings, operator actions);
  writing needs a scope other than `read`, but for a key revoking itself (the API keys' DELETE declares it a read
  for that one request: marketplace/api/accounts.py ApiKeyViewSet.initial);
- a tuple of scopes: the view is for holders of one of them (reads are open to `read` too).

A view whose POST only reads (a search sent as a POST by its protocol, as Vast.ai's offer search is) declares it
with `api_read_methods = frozenset({"POST"})`: those methods then count as reads here, so a `read` key may use them.

The check runs in the API key authentication (marketplace/api/authentication.py): a key authenticates a request
only for what its scopes allow, so no view can forget it. Logged-in browser sessions are not scoped.
"""
from collections.abc import Iterable

READ = "read"
RENTER = "renter"
PROVIDER = "provider"
ALL_SCOPES: tuple[str, ...] = (READ, RENTER, PROVIDER)
SCOPE_LABELS = {
    READ: "look at everything, change nothing",
    RENTER: "instances, volumes, SSH keys, balance, cards, top-ups, offers",
    PROVIDER: "nodes, benchmarks, earnings, payouts",
}

PUBLIC = "public"
ANY = "any"
RENTER_ONLY: tuple[str, ...] = (RENTER,)
PROVIDER_ONLY: tuple[str, ...] = (PROVIDER,)
RENTER_OR_PROVIDER: tuple[str, ...] = (RENTER, PROVIDER)

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def is_rule(rule: object) -> bool:
    """Is this a valid `api_scope` declaration?"""
    if rule in (PUBLIC, ANY):
        return True
    return isinstance(rule, tuple) and bool(rule) and all(s in (RENTER, PROVIDER) for s in rule)


def read_methods_of(view: object) -> frozenset[str]:
    """The methods a view declares to be reads besides the safe ones (`api_read_methods`), upper-cased."""
    return frozenset(m.upper() for m in getattr(view, "api_read_methods", ()))


def missing_scopes(*, scopes: Iterable[str], rule: object, method: str,
                   read_methods: Iterable[str] = ()) -> tuple[str, ...]:
    """The scopes of which the key needs one for `method` on a view with `rule`; () when it may go ahead.
    `read_methods`: the view's methods that only read (read_methods_of), allowed as the safe ones are."""
    held = set(scopes)
    safe = method.upper() in SAFE_METHODS or method.upper() in read_methods
    if rule in (PUBLIC, ANY):
        if safe or held - {READ}:
            return ()
        return RENTER_OR_PROVIDER
    assert isinstance(rule, tuple), f"not a scope rule: {rule!r}"
    if held & set(rule) or (safe and READ in held):
        return ()
    return ((READ,) if safe else ()) + rule


def refusal(*, scopes: Iterable[str], method: str, missing: tuple[str, ...]) -> str:
    held = ", ".join(sorted(scopes)) or "none"
    needed = " or ".join(f"`{s}`" for s in missing)
    return (f"This API key's scopes ({held}) do not allow {method.upper()} here: it needs the {needed} scope. "
            "Make a key with that scope on the API keys page or with POST /api/v1/api-keys/.")
