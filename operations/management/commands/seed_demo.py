"""Seed the demo: an operator, a provider whose servers are simulated GPU nodes on this machine
(registered, keyed and queued for verification like real ones), and a customer with a starting credit
(billing's demo_credit_grant, an ordinary ledger credit). Safe to run again, whatever the last demo left on
servers that are gone since (volumes, stopped instances, destroyed ones awaiting clean-up: _retire_gone). It calls
the services of every app, so it lives in `operations`, above them."""
import contextlib
import json
from decimal import Decimal

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from billing.services.ledger import demo_credit_grant, wallet_balance
from marketplace.models import GpuModel, Instance, InstanceStatus, Node, NodeState, User
from marketplace.models.renting import LIVE_STATUSES
from marketplace.money import micros_to_usd
from marketplace.services.instances import instance_mark_failed
from marketplace.services.nodes import node_register, node_retire, node_unreachable
from provisioning import sim
from provisioning.services.fleet_record import node_record_health
from provisioning.services.verification import node_verify_request

DEMO_USERS = {
    "operator": ("operator@example.com", "demo-operator-pass", True),
    "provider": ("provider@example.com", "demo-provider-pass", False),
    "customer": ("customer@example.com", "demo-customer-pass", False),
}

# (name, sim profile, declared gpu model, count, USD per GPU-hour, country, city)
DEMO_NODES = [
    ("fra-a100-01", "a100-80gb-sxm-x4", "a100-80gb-sxm", 4, "1.390000", "DE", "Frankfurt"),
    ("ams-a6000-01", "rtx-a6000-x8", "rtx-a6000", 8, "0.490000", "NL", "Amsterdam"),
    ("waw-a4000-01", "rtx-a4000-x2", "rtx-a4000", 2, "0.170000", "PL", "Warsaw"),
    ("iad-h100-01", "h100-sxm-x1", "h100-sxm", 1, "2.490000", "US", "Ashburn"),
]


class Command(BaseCommand):
    help = "Create the demo accounts and start, register and verify the demo provider's simulated servers."

    def add_arguments(self, parser):
        parser.add_argument("--i-am-a-demo", action="store_true",
                            help="Seed even though settings.SIM_NODES_ALLOWED is off (never on a real platform).")

    def handle(self, *args, **options):
        # Its accounts' passwords are in the repository: on a platform that takes no simulated servers (production)
        # it made a superuser with a published password, and failed only after, at the first node (review r54).
        if not settings.SIM_NODES_ALLOWED and not options["i_am_a_demo"]:
            raise CommandError("seed_demo creates accounts with published passwords: it runs only where simulated "
                               "servers are allowed (SIM_NODES_ALLOWED), or with --i-am-a-demo.")
        # One transaction: a failure leaves no demo account behind (the users were committed before the nodes).
        with transaction.atomic():
            users = {role: self._user(email, password, staff)
                     for role, (email, password, staff) in DEMO_USERS.items()}
            running_ports = {n["ssh_port"] for n in sim.nodes_list() if n["running"]}
            for name, profile, model, count, price, country, city in DEMO_NODES:
                self._node(users["provider"], running_ports, name, profile, model, count, price, country, city)
            demo_credit_grant(user=users["customer"])  # once: its idempotency key is per user
        self.stdout.write(json.dumps({
            "logins": {role: {"email": e, "password": p} for role, (e, p, _) in DEMO_USERS.items()},
            "customer_balance_usd": str(micros_to_usd(wallet_balance(user_id=users["customer"].pk))),
            "nodes": list(Node.objects.filter(provider=users["provider"]).exclude(state=NodeState.RETIRED)
                          .values("id", "name", "ssh_port", "state")),
        }, indent=2))

    def _user(self, email, password, staff):
        user = User.objects.filter(email=email).first()
        if user is None:
            make = User.objects.create_superuser if staff else User.objects.create_user
            user = make(email=email, password=password)
        return user

    def _node(self, provider, running_ports, name, profile, model, count, price, country, city):
        node = Node.objects.filter(provider=provider, name=name).exclude(state=NodeState.RETIRED).first()
        if node is not None and node.ssh_port in running_ports:
            return  # its simulated server still runs: keep it
        info = sim.node_up(profile)
        try:
            # One transaction for the old node's end and the new one's registration: if anything fails, the old
            # node is as it was and the new server is stopped again (below), so that the next run starts afresh.
            with transaction.atomic():
                if node is not None:
                    _retire_gone(node)
                node = node_register(
                    provider=provider, name=name, address=info["address"], ssh_port=info["ssh_port"],
                    ssh_user=info["ssh_user"], host_key_fingerprint=info["host_key_fingerprint"], country=country,
                    city=city, datacenter=f"{city[:3].upper()}1", gpu_model=GpuModel.objects.get(slug=model),
                    gpu_count=count, price_per_gpu_hour=Decimal(price), runtime="sim",
                )
                # What a provider does by hand: install the platform's key on the server, then ask for verification.
                sim.node_authorize(info["ssh_port"], node.ssh_public_key)
                node_verify_request(node=node)
        except BaseException:
            with contextlib.suppress(Exception):  # what failed is what the operator needs to read
                sim.node_down(info["ssh_port"])
            raise


GONE = "its simulated server was stopped when the last demo ended (simnodes down), and it never comes back"


def _retire_gone(node: Node) -> None:
    """Retire a demo node whose simulated server went away with the last demo, whatever its renters left on it.

    The server is gone for good, so it is recorded as such, through the fleet's own health record (failed checks
    until node_unreachable: its running instances are interrupted, credited from its last healthy moment), and then
    retired as unreachable (node_retire's money rules: interrupted instances failed with their credit, stopped ones
    failed with their disks billed up to its last healthy moment, the GPUs of destroyed ones awaiting their VM's
    removal released, volumes deleted and billed up to its last healthy moment, their renters told). Those caught
    between two states (requested, provisioning, starting, stopping, destroying) are failed first, as no job can
    finish them. Before, the node was retired as reachable (no failed check had been recorded while the demo was
    down), which refused for a volume, a stopped instance or a destroyed one awaiting clean-up, and the next
    `make demo` stopped halfway. Call inside a transaction."""
    for _ in range(settings.NODE_INTERRUPT_AFTER_FAILED_CHECKS + 1):
        if node_unreachable(node):
            break
        node_record_health(node_id=node.pk, ok=False, error=f"The demo's server is gone: {GONE}.")
        node.refresh_from_db()
    caught = (Instance.objects.filter(node=node, status__in=LIVE_STATUSES)
              .exclude(status=InstanceStatus.INTERRUPTED).order_by("pk").values_list("pk", flat=True))
    for instance_id in list(caught):
        instance_mark_failed(instance_id=instance_id, message=f"Failed: {GONE}.")
    node_retire(node=node)
