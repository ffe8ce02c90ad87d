"""The docker runtime: a VM is a container with its GPUs passed through, sshd inside and its ports published.

Every docker command is an argument list. The renter's options reach the container as files the agent writes (the
box folder of dockerbox.py) and as argv items, never through a shell on the node; the renter's env is no part of the
container's environment (dockerbox.py: only onstart, SSH sessions and the command of the renter's own image get it).

Each container is bounded and kept apart from the others (limits_argv, ISOLATION_ARGV): a share of the host's memory
(no swap beyond it), CPUs and process ids in proportion to its GPUs; its writable layer limited to the booked
disk_gb where the engine's storage driver can enforce it (the VM's answer says "disk_limit": "enforced" or
"not_enforced"; "not_enforced" too when the image declares a VOLUME no renter volume covers: docker gives it an
anonymous volume outside that limit); its log files capped; on the gpumarket network, where containers cannot
reach one another; without raw sockets (no ARP spoofing or sniffing), device nodes or setuid/file-capability
privilege gains.

Here: the DockerRuntime itself (a VM's container made, started, stopped, inspected, listed; volumes; health).
Beside it: dockerargv.py (the command lines and the GPUs a container names), dockerlimits.py (the container's
share of the host), dockerpull.py (the image pull), dockerread.py (bounded reads of what a container controls),
dockerbox.py (the entry wrapper and env files). This module re-exports their names."""
import contextlib
import json
import os
import re
import time

from ..core import AgentError, run, write_file
from ..procs import local_address, ssh_banner
from ..records import file_lock, log_path, tail_lines, vm_dir, vm_log
from ..smi import read_gpus
from ..validation import VM_ID_RE
from .base import Runtime, vm_name
from .dockerargv import (
    DOCKER_LIST_ARGV,
    DROPPED_CAPS,
    ISOLATION_ARGV,
    LABEL,
    LOG_ARGV,
    NETWORK,
    NETWORK_ARGV,
    container_devices,
    docker_run_argv,
    docker_state,
    docker_verb_argv,
    gpu_argv,
    mount_arg,
    publish,
)
from .dockerbox import ENTRY_SH, env_file, pam_environment, profile_sh
from .dockerlimits import (
    HOST_RAM_KEPT,
    MIG_SLICES_PER_GPU,
    PIDS_PER_GPU_MIN,
    container_share,
    disk_limit_answer,
    host_resources,
    limits_argv,
    limits_text,
    unsupported_size_option,
)
from .dockerpull import docker_config_json, docker_pull, image_command, image_volumes, pull_reason
from .dockerread import (
    MAX_HOST_KEY,
    MAX_LOG_BYTES,
    MAX_LOG_LINE,
    MAX_OS_RELEASE,
    bounded_output,
    container_log_tail,
    read_os,
)

__all__ = [
    "DOCKER_LIST_ARGV", "DROPPED_CAPS", "HOST_RAM_KEPT", "ISOLATION_ARGV", "LABEL", "LOG_ARGV", "MAX_HOST_KEY",
    "MAX_LOG_BYTES", "MAX_LOG_LINE", "MAX_OS_RELEASE", "MIG_SLICES_PER_GPU", "NETWORK", "NETWORK_ARGV",
    "PIDS_PER_GPU_MIN", "DockerRuntime", "bounded_output", "container_devices", "container_log_tail",
    "container_share", "disk_limit_answer", "docker_config_json", "docker_run_argv", "docker_state",
    "docker_verb_argv", "gpu_argv", "host_resources", "limits_argv", "limits_text", "mount_arg", "publish",
    "pull_reason", "unsupported_size_option",
]

# The engine's word that it has no such container: `docker inspect`'s "Error: No such object: <name>" and the
# daemon's "No such container: <name>" (lower case from some engines). Not "no such file or directory" (a daemon
# socket that is gone) nor "no such host": those leave a VM's state unknown.
NO_SUCH = re.compile(r"\bno such (?:object|container)\b", re.IGNORECASE)
# The container's host key as the agent answers it: its type and base64 body, nothing else. The image may ship that
# file: a NUL in its second word made every answer about the VM refused and the node blamed (found by review).
HOST_KEY_RE = re.compile(r"ssh-ed25519 [A-Za-z0-9+/]+={0,2}")


class DockerRuntime(Runtime):
    name = "docker"

    def write_box(self, rec):
        """The box folder, mounted read-only at /.gpumarket: read by the wrapper as the image's user, who may not be
        root (USER jovyan), so the box is 0755 and its files 0644 (0700 and 0600, a non-root image crash-looped on
        "can't open '/.gpumarket/entry.sh'"; found by review). The renter's env in them is theirs to read in their
        own container; on the host the VM's folder, 0700, keeps every other user out. The env is in the box only:
        the container's environment is the image's and the platform's (dockerbox.py). The image-env marker: the
        image is the renter's own (the request's image_env), whose command the wrapper gives the env."""
        vmdir, spec = vm_dir(self.cfg, rec["vm_id"]), rec["spec"]
        box = os.path.join(vmdir, "box")
        os.makedirs(box, exist_ok=True)
        os.chmod(vmdir, 0o700)
        os.chmod(box, 0o755)  # noqa: S103 - read by the image's user in the container; vmdir keeps others out
        write_file(os.path.join(box, "entry.sh"), ENTRY_SH, 0o755)
        env = spec.get("env", {})
        write_file(os.path.join(box, "profile.sh"), profile_sh(env), 0o644)
        write_file(os.path.join(box, "environment"), pam_environment(env), 0o644)
        write_file(os.path.join(box, "renter.env"), env_file(env), 0o644)  # exported for onstart (and below)
        marker = os.path.join(box, "image-env")
        if spec.get("image_env"):  # the renter's own image: its command gets the env too (dockerbox.py)
            write_file(marker, "", 0o644)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(marker)
        if spec.get("onstart"):
            write_file(os.path.join(box, "onstart.sh"), spec["onstart"], 0o644)
        return vmdir

    def ensure_network(self):
        """The gpumarket bridge, made once per node with inter-container traffic off; one of that name made
        otherwise is refused rather than used. Made under the node-wide "network" lock: two first creates on a
        node ran `docker network create` at once (each under its own VM's lock only), and docker's duplicate-name
        check is best effort, so two networks of that name could be made; then inspect answered "ambiguous" and
        create "already exists" for good, and this recursed until RecursionError, ~1900 docker commands per
        `vm create` (review r54 #2). Inspect is tried again once after "already exists"; a name that still does
        not inspect is the node's configuration to fix (bad_node_config, saying what to do)."""
        with file_lock(self.cfg, "network", timeout=60):
            proc = self.inspect_network()
            if proc.returncode != 0:
                made = run(NETWORK_ARGV, check=False)
                if made.returncode == 0:
                    return None
                if "already exists" not in made.stderr:
                    raise AgentError("command_failed", "docker network create: " + made.stderr.strip()[-800:])
                proc = self.inspect_network()  # made meanwhile by another hand: read once more, never again
                if proc.returncode != 0:
                    raise AgentError("bad_node_config", (
                        "docker network %s cannot be used: docker says it already exists, yet it cannot be "
                        "inspected (%s). Two networks of that name (docker's duplicate-name check is best effort) "
                        "give this: remove them (docker network ls --filter name=%s; docker network rm <id>, once "
                        "no container uses it) and the agent makes its own"
                    ) % (NETWORK, (proc.stderr or proc.stdout).strip()[-300:], NETWORK))
        try:
            options = json.loads(proc.stdout) or {}
        except ValueError:
            options = {}
        if options.get("com.docker.network.bridge.enable_icc") != "false":
            raise AgentError("bad_node_config", "docker network %s exists but lets containers reach one another "
                             "(no com.docker.network.bridge.enable_icc=false): remove it, the agent makes its own"
                             % NETWORK)
        return None

    def inspect_network(self):
        return run(["docker", "network", "inspect", "--format", "{{json .Options}}", NETWORK], check=False)

    def limits(self, spec, image_volume_paths=()):
        """The container's share of the host (container_share) and its disk, recorded with the VM. The image's
        VOLUME paths that no renter volume is mounted on get anonymous volumes outside the writable layer's size
        limit: the VM's disk is then not enforced (disk_limit_answer), and they are named in its log."""
        cores, ram_mib, pids = host_resources()
        gpus = float(len(spec["gpu_indices"]))
        if spec.get("mig_uuids"):
            gpus = min(gpus, len(spec["mig_uuids"]) / float(MIG_SLICES_PER_GPU))
        total = len(read_gpus(self.cfg)[0])
        cpus, memory_mib, pid_limit = container_share(cores, ram_mib, pids, gpus, total)
        covered = {v["mount"] for v in spec.get("volumes", ())}
        limits = {"cpus": cpus, "memory_mib": memory_mib, "pids": pid_limit, "disk_gb": spec.get("disk_gb"),
                  "disk_limit": "enforced"}
        unbounded = [path for path in image_volume_paths if path not in covered]
        if unbounded:
            limits["unbounded_volumes"] = unbounded
        return limits

    def create_container(self, rec, argv_for):
        """docker create with the disk limit; where the storage driver cannot enforce one (overlay2 off xfs with
        pquota, most nodes), without it, and the record says "not_enforced"."""
        limits = rec["limits"]
        if limits.get("disk_gb"):
            proc = run(argv_for(limits), timeout=120, check=False)
            if proc.returncode == 0:
                return
            if not unsupported_size_option(proc.stderr):
                raise AgentError("command_failed", "docker create exited %d: %s" % (
                    proc.returncode, proc.stderr.strip()[-800:]))
            vm_log(self.cfg, rec["vm_id"], "the disk limit is not enforced: this engine's storage driver cannot "
                   "limit a container's size (%s)" % proc.stderr.strip()[-300:])
        limits["disk_limit"] = "not_enforced"
        run(argv_for(limits), timeout=120)

    def provision(self, rec, registry_auth=None):
        vm_id, spec = rec["vm_id"], rec["spec"]
        keys_path = os.path.join(vm_dir(self.cfg, vm_id), "authorized_keys")
        write_file(keys_path, "\n".join(spec["ssh_public_keys"]) + "\n", 0o600)
        if self.state(rec) == "missing":
            docker_pull(self.cfg, rec, registry_auth)
            command = image_command(spec["image"]["docker"])  # run by the wrapper, which outlives it
            self.ensure_network()
            rec["limits"] = self.limits(spec, image_volumes(spec["image"]["docker"]))
            vmdir = self.write_box(rec)
            # A MIG instance gets its slices only (the toolkit takes MIG-... UUIDs as devices), others their cards.
            devices = rec["gpu_devices"] = container_devices(spec, self.cfg.docker_gpus)

            def argv_for(limits):
                return docker_run_argv(vm_id, devices, spec["image"]["docker"],
                                       rec["ssh_port"], keys_path, gpus=self.cfg.docker_gpus, bind=self.cfg.docker_bind,
                                       ports=rec.get("ports"), volumes=spec.get("volumes", ()), box=vmdir,
                                       command=command, limits=limits)
            self.create_container(rec, argv_for)
            rec["os"] = read_os(vm_id)
            vm_log(self.cfg, vm_id, "created container %s (%s; %s)" % (
                vm_name(vm_id), rec["os"] or "OS unknown", limits_text(rec["limits"])))
        self.checked_start(rec)
        if not rec.get("ssh_host_key"):
            rec["ssh_host_key"] = self.read_host_key(vm_id)

    def read_host_key(self, vm_id, timeout=30.0):
        """The container's sshd ed25519 host key (made by the entry wrapper at first boot), for pinning."""
        deadline, has_sshd = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            argv = ["docker", "exec", vm_name(vm_id), "cat", "/etc/ssh/ssh_host_ed25519_key.pub"]
            code, out, too_long = bounded_output(argv, MAX_HOST_KEY)  # the container writes that file
            text = out.decode("utf-8", "replace")
            if code == 0 and not too_long and text.startswith("ssh-ed25519 "):
                key = " ".join(text.split()[:2])
                return key if HOST_KEY_RE.fullmatch(key) else None  # a file the image holds: no key to pin
            if has_sshd is None:
                has_sshd = any(run(["docker", "exec", vm_name(vm_id), "test", "-x", sshd], check=False).returncode == 0
                               for sshd in ("/usr/sbin/sshd", "/usr/local/sbin/sshd"))
            if not has_sshd or self.state({"vm_id": vm_id}) != "running":
                return None  # stopped (its command exited) or no sshd in the image: no key will come
            time.sleep(0.1)
        return None

    def ssh_answers(self, rec):
        # The container's port 22 as docker publishes it on this host: a renter's own image whose sshd never
        # started answers nothing here, whatever host key file it carries (found by review).
        return bool(rec.get("ssh_port")) and ssh_banner(local_address(self.cfg.docker_bind), rec["ssh_port"])

    def disk_limit(self, rec):
        """A container made before the limits (no `limits` in its record) has none; one whose image has a VOLUME
        outside the limit has none either (disk_limit_answer)."""
        return disk_limit_answer(rec.get("limits") or {})

    def rebind(self, rec):
        """A container keeps the devices it was made with: the same cards numbered anew need nothing where it names
        them by UUID; any other change of GPUs needs a new container."""
        made = rec.get("gpu_devices")
        if made and all(isinstance(d, str) for d in made) and \
                sorted(made) == sorted(container_devices(rec["spec"], self.cfg.docker_gpus)):
            return
        super().rebind(rec)

    def start(self, rec):
        run(docker_verb_argv("start", rec["vm_id"]))

    def stop(self, rec):
        if self.state(rec) in ("running", "restarting"):  # a restarting one is stopped too: its loop ends
            run(docker_verb_argv("stop", rec["vm_id"]), timeout=60)

    def destroy(self, rec):
        self.remove_container(rec["vm_id"])

    def destroy_unrecorded(self, vm_id):
        return self.remove_container(vm_id)

    def remove_container(self, vm_id):
        """docker rm -f -v gpumarket-<vm_id>: True when it removed one, False when there was none. Removed is what
        docker rm says on stdout, the name of each container it removed. Of no container, `rm -f` exits 0 since
        Docker 20.10 (docker/cli#2678), printing "No such container", and on current CLIs silently
        (docker/cli#7110): neither the exit status nor stderr tells (found by review: taken as removed, the
        reconciler reported an orphan destroyed where nothing was)."""
        proc = run(docker_verb_argv("rm", vm_id), check=False)
        if proc.returncode != 0 and not NO_SUCH.search(proc.stderr):
            raise AgentError("command_failed", "docker rm: " + proc.stderr.strip()[-800:])
        return proc.returncode == 0 and vm_name(vm_id) in proc.stdout.split()

    def state(self, rec):
        proc = run(docker_verb_argv("inspect", rec["vm_id"]), check=False)
        if proc.returncode != 0:
            # Missing only on the engine's own word that it has no such container. Anything else (the daemon
            # restarting or away: "Cannot connect to the Docker daemon ...", a timeout) leaves its state unknown.
            if NO_SUCH.search(proc.stderr):
                return "missing"
            raise AgentError("command_failed", "docker inspect: " + proc.stderr.strip()[-800:])
        return docker_state(proc.stdout.strip())

    def logs(self, rec, tail):
        """The agent's lines and the container's (onstart, the image's command), merged by time. The container's
        are read as a stream: each cut at MAX_LOG_LINE bytes, the last `tail` kept, at most MAX_LOG_BYTES read."""
        ours = tail_lines(log_path(self.cfg, rec["vm_id"]), tail)
        theirs = container_log_tail(["docker", "logs", "--timestamps", "--tail", str(tail), vm_name(rec["vm_id"])],
                                    tail)
        return sorted(ours + theirs, key=lambda line: line.split(" ", 1)[0])[-tail:]

    def unrecorded(self, known):
        found = []
        for line in run(DOCKER_LIST_ARGV).stdout.splitlines():
            vm_id, _, status = line.partition("\t")
            if VM_ID_RE.fullmatch(vm_id) and vm_id not in known:
                found.append({"vm_id": vm_id, "state": docker_state(status)})
        return found

    def volume_create(self, name, size_gb):
        """An engine volume limited to size_gb where the local driver can (its `size` option: xfs with project
        quotas); elsewhere without a limit, and the answer says so: "enforced" or "not_enforced"."""
        proc = run(["docker", "volume", "inspect", "--format", "{{json .Options}}", name], check=False)
        if proc.returncode == 0:  # made by an earlier, interrupted create
            with contextlib.suppress(ValueError, AttributeError):
                return "enforced" if (json.loads(proc.stdout) or {}).get("size") else "not_enforced"
            return "not_enforced"
        base = ["docker", "volume", "create", "--label", "gpumarket.volume=" + name]
        proc = run(base + ["--opt", "size=%dG" % size_gb, name], check=False)
        if proc.returncode == 0:
            return "enforced"
        if not unsupported_size_option(proc.stderr):
            raise AgentError("command_failed", "docker volume create: " + proc.stderr.strip()[-800:])
        run(base + [name])
        return "not_enforced"

    def volume_delete(self, name):
        proc = run(["docker", "volume", "rm", name], check=False)
        if proc.returncode != 0 and "no such volume" not in proc.stderr.lower():
            if "in use" in proc.stderr:
                raise AgentError("volume_in_use", "volume %s: %s" % (name, proc.stderr.strip()[-300:]))
            raise AgentError("command_failed", "docker volume rm: " + proc.stderr.strip()[-800:])

    def health(self):
        proc = run(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=15, check=False)
        return proc.returncode == 0, (proc.stdout.strip() or proc.stderr.strip())[-300:]
