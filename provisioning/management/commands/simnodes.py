"""`manage.py simnodes up|authorize|list|cut|restore|down`: simulated GPU servers for the demo and the tests."""
import json

from django.core.management.base import BaseCommand, CommandError

from provisioning import sim


class Command(BaseCommand):
    help = "Start, authorize, list and stop simulated GPU nodes (real sshd processes on this machine)."

    def add_arguments(self, parser):
        actions = parser.add_subparsers(dest="action", required=True)
        up = actions.add_parser("up", help="start nodes; prints one JSON object per node")
        up.add_argument("--profile", required=True, help="profile name (provisioning/agent/profiles) or file")
        up.add_argument("--count", type=int, default=1)
        up.add_argument("--listen", default="127.0.0.1", help="address the nodes' sshd listen on")
        up.add_argument("--public-address", default=None, help="address to advertise, when not --listen")
        authorize = actions.add_parser("authorize", help="install a platform public key on a node")
        authorize.add_argument("port", type=int)
        authorize.add_argument("public_key", nargs="+", help="the key line (quoted, or as separate words)")
        actions.add_parser("list", help="one JSON object per node")
        cut = actions.add_parser("cut", help="stop a node's sshd only (a network cut): its VMs keep running")
        cut.add_argument("--port", type=int, required=True)
        restore = actions.add_parser("restore", help="start a cut node's sshd again")
        restore.add_argument("--port", type=int, required=True)
        down = actions.add_parser("down", help="stop nodes and their VMs and remove their files")
        down.add_argument("--port", type=int, default=None, help="only this node (default: all)")

    def handle(self, *args, action, **options):
        try:
            getattr(self, f"_{action}")(**options)
        except (ValueError, LookupError, RuntimeError) as exc:
            raise CommandError(str(exc)) from exc

    def _emit(self, obj):
        self.stdout.write(json.dumps(obj, sort_keys=True))

    def _up(self, profile, count, listen, public_address, **_):
        if not 1 <= count <= 500:
            raise ValueError("--count must be between 1 and 500")
        for _ in range(count):
            self._emit(sim.node_up(profile, listen_address=listen, public_address=public_address))

    def _authorize(self, port, public_key, **_):
        added = sim.node_authorize(port, " ".join(public_key))
        self._emit({"ssh_port": port, "authorized": True, "added": added})

    def _list(self, **_):
        for node in sim.nodes_list():
            self._emit(node)

    def _cut(self, port, **_):
        self._emit({"ssh_port": port, "cut": sim.node_cut(port)})

    def _restore(self, port, **_):
        self._emit({"ssh_port": port, "restored": sim.node_restore(port)})

    def _down(self, port, **_):
        if port is None:
            self._emit({"stopped": sim.nodes_down()})
        elif not sim.node_down(port):
            raise LookupError(f"no simulated node on port {port}")
        else:
            self._emit({"stopped": 1, "ssh_port": port})
