"""The docker runtime's command lines: `docker create` for one VM (its isolation, log cap, limits, ports, volumes
and the entry wrapper; no renter's env: dockerbox.py), the GPUs it names (gpu_argv, container_devices), the
lifecycle verbs and the listing of our containers. Argument lists only: nothing here runs a command."""
import csv
import io
import os

from ..options import AUTHORIZED_KEYS_MOUNT
from .base import vm_name
from .dockerlimits import limits_argv

LABEL = "gpumarket.vm_id"
# Every renter's container joins this bridge, made by the agent with inter-container traffic off (icc=false):
# a container reaches the outside world and its published ports are reached from it, never another renter's.
NETWORK = "gpumarket-vms"
NETWORK_ARGV = ["docker", "network", "create", "--driver", "bridge", "--label", "gpumarket.network=1",
                "--opt", "com.docker.network.bridge.enable_icc=false", NETWORK]
# Capabilities sshd and a renter's root never need: raw sockets (ARP spoofing, sniffing the bridge), device nodes,
# file capabilities, the host's audit log. sshd keeps what privilege separation uses (SETUID, SETGID, SYS_CHROOT,
# CHOWN for the pty). no-new-privileges: no setuid binary or file capability raises a process's privileges (sshd
# runs as root and drops them, which it allows; a non-root user in the container cannot `sudo`).
DROPPED_CAPS = ("NET_RAW", "MKNOD", "SETFCAP", "AUDIT_WRITE")
ISOLATION_ARGV = ["--network", NETWORK] + [a for cap in DROPPED_CAPS for a in ("--cap-drop", cap)] + [
    "--security-opt", "no-new-privileges"]
# The container's log (docker logs, the VM's logs command) stays under 3 x 10 MB on the node's disk.
LOG_ARGV = ["--log-driver", "json-file", "--log-opt", "max-size=10m", "--log-opt", "max-file=3"]


def gpu_argv(mode, gpu_indices):
    if mode == "none":
        return []
    if mode.startswith("devices:"):  # a stand-in device node per GPU, where the toolkit would put /dev/nvidiaN
        out = []
        for i in gpu_indices:
            out += ["--device", "%s:/dev/nvidia%d" % (mode[len("devices:"):].replace("{index}", str(i)), i)]
        return out
    # --gpus parses its value as CSV, so "device=0,1" needs literal double quotes to stay one item.
    return ["--gpus", '"device=%s"' % ",".join(str(i) for i in gpu_indices)]  # indices, or MIG-... UUIDs


def container_devices(spec, mode):
    """What the container's `--gpus device=` names (the toolkit): its MIG slices, else its cards' UUIDs where the
    platform sent every one (nvidia-smi numbers the cards anew when one falls off the bus; a UUID stays the card's),
    else their indices. Stand-in device nodes ("devices:") go by index. UUIDs only as validation.py matched them."""
    if mode != "toolkit":
        return spec["gpu_indices"]
    uuids = spec.get("gpu_uuids")
    return spec.get("mig_uuids") or (uuids if uuids and None not in uuids else spec["gpu_indices"])


def publish(bind, host_port, port):
    return ["-p", ("%s:%d:%d" % (bind, host_port, port)) if bind else "%d:%d" % (host_port, port)]


def mount_arg(**fields):
    """A --mount value: CSV, so a path holding ',' or '"' is quoted as docker's parser expects."""
    out = io.StringIO()
    csv.writer(out, lineterminator="").writerow("%s=%s" % kv for kv in fields.items())
    return out.getvalue()


def docker_run_argv(vm_id, gpu_indices, image, host_port, keys_path, gpus="toolkit", bind=None, ports=None,
                    volumes=(), box=None, command=(), limits=None):
    """`docker create` (run_argv's name is kept: `docker run -d` minus the start) for one VM."""
    argv = ["docker", "create", "--name", vm_name(vm_id), "--hostname", vm_id, "--label", LABEL + "=" + vm_id]
    argv += ISOLATION_ARGV + LOG_ARGV
    if limits:
        argv += limits_argv(limits)
    argv += gpu_argv(gpus, gpu_indices)
    argv += publish(bind, host_port, 22)
    for name, hp in sorted((ports or {}).items()):
        argv += publish(bind, hp, int(name.split("/")[0]))
    argv += ["-v", keys_path + ":" + AUTHORIZED_KEYS_MOUNT + ":ro"]
    if box:  # (the entry wrapper's own state lives in the container's writable layer, under its disk limit)
        argv += ["-v", os.path.join(box, "box") + ":/.gpumarket:ro", "--init", "--entrypoint", "/bin/sh"]
        # docker-init (tini) passes docker stop's signal to the whole process group: the image's command runs under
        # the entry wrapper, not as its only child (dockerbox.ENTRY_SH).
        argv += ["-e", "TINI_KILL_PROCESS_GROUP=1"]
    for vol in volumes:
        argv += ["--mount", mount_arg(type="volume", src=vol["name"], dst=vol["mount"])]
    if gpus != "toolkit":
        # No GPU through an nvidia default runtime either: the image's own ENV (every nvidia/cuda image has
        # NVIDIA_VISIBLE_DEVICES=all) must not hand the container the node's GPUs. (--gpus sets the variable.)
        argv += ["-e", "NVIDIA_VISIBLE_DEVICES=void"]
    argv += ["--restart", "unless-stopped", image]
    if box:
        argv += ["/.gpumarket/entry.sh"] + list(command)
    return argv


def docker_verb_argv(verb, vm_id):
    return {"start": ["docker", "start", vm_name(vm_id)],
            "stop": ["docker", "stop", "--time", "20", vm_name(vm_id)],
            "rm": ["docker", "rm", "-f", "-v", vm_name(vm_id)],  # -v: its anonymous volumes too
            "inspect": ["docker", "inspect", "--format", "{{.State.Status}}", vm_name(vm_id)]}[verb]


DOCKER_LIST_ARGV = ["docker", "ps", "-a", "--filter", "label=" + LABEL,
                    "--format", '{{.Label "gpumarket.vm_id"}}\t{{.State}}']


def docker_state(status):
    """The VM's state from the container's. "restarting" (its command exited and `--restart unless-stopped` runs it
    again, backing off) is no running VM: taken as running, a container whose command exited at once crash-looped
    while its instance was billed as running, every restart killing sshd and the renter's sessions (found by
    review). The platform takes any state but "running" as not running; the container still holds its GPUs
    (allocation.holds_gpus) and a stop stops it."""
    if status == "running":
        return "running"
    return "restarting" if status == "restarting" else "stopped"
