"""The docker runtime: a VM is a container with its GPUs passed through, sshd inside and its ports published.

Every docker command is an argument list. The renter's options reach the container as files the agent writes
(an --env-file, the box folder of dockerbox.py) and as argv items, never through a shell on the node.

Each container is bounded and kept apart from the others (limits_argv, ISOLATION_ARGV): a share of the host's memory
(no swap beyond it), CPUs and process ids in proportion to its GPUs; its writable layer limited to the booked
disk_gb where the engine's storage driver can enforce it (the VM's answer says "disk_limit": "enforced" or
"not_enforced"); its log files capped; on the gpumarket network, where containers cannot reach one another; without
raw sockets (no ARP spoofing or sniffing), device nodes or setuid/file-capability privilege gains."""
import base64
import collections
import contextlib
import csv
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time

from ..core import AgentError, run, write_file
from ..records import log_path, tail_lines, vm_dir, vm_log
from ..reference import registry_key
from ..smi import read_gpus
from ..validation import VM_ID_RE
from .base import Runtime, os_release_pretty_name, vm_name
from .dockerbox import ENTRY_SH, env_file, pam_environment, profile_sh

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
HOST_RAM_KEPT = 0.1  # of the host's RAM, never given to containers (as libvirt_share)
PIDS_PER_GPU_MIN = 1024
MIG_SLICES_PER_GPU = 7  # a MIG device counts as 1/7 of its GPU in the share


def container_share(host_cores, host_ram_mib, host_pids, gpus, total_gpus):
    """(cpus, memory MiB, pids) for a container of `gpus` GPUs (a fraction for MIG slices) of `total_gpus`:
    in proportion, as libvirt_share; 10 % of RAM and half the process ids stay with the host."""
    part = min(1.0, float(gpus) / max(1, total_gpus))
    cpus = max(1.0, round(host_cores * part, 2))
    memory = max(2048, int(int(host_ram_mib * (1 - HOST_RAM_KEPT)) * part))
    pids = max(PIDS_PER_GPU_MIN, int(host_pids // 2 * part))
    return min(cpus, float(max(1, host_cores))), memory, pids


def limits_text(limits):
    return "%g CPUs, %d MiB memory, %d processes, disk %s GB %s" % (
        limits["cpus"], limits["memory_mib"], limits["pids"], limits.get("disk_gb"),
        "enforced" if limits.get("disk_limit") == "enforced" else "NOT enforced")


def limits_argv(limits):
    """docker create's resource limits: memory with no swap beyond it, CPUs, process ids, and the disk."""
    argv = ["--memory", "%dm" % limits["memory_mib"], "--memory-swap", "%dm" % limits["memory_mib"],
            "--cpus", "%g" % limits["cpus"], "--pids-limit", str(limits["pids"])]
    if limits.get("disk_gb") and limits.get("disk_limit") == "enforced":
        argv += ["--storage-opt", "size=%dG" % limits["disk_gb"]]
    return argv


def host_resources():
    """(cores, RAM MiB, process ids the kernel allows) of this host: cheap reads, no disk test."""
    ram_mib, pids = 4096, 32768
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/meminfo") as f:
            ram_mib = next(int(ln.split()[1]) // 1024 for ln in f if ln.startswith("MemTotal:"))
    for path in ("/proc/sys/kernel/pid_max", "/proc/sys/kernel/threads-max"):
        with contextlib.suppress(OSError, ValueError):
            with open(path) as f:
                pids = min(pids, int(f.read().strip())) if path.endswith("threads-max") else int(f.read().strip())
    return os.cpu_count() or 1, ram_mib, pids


def unsupported_size_option(stderr):
    """docker's refusal of a size option the storage or volume driver cannot enforce (overlay2 off xfs+pquota,
    the local volume driver without quota support), as opposed to any other failure."""
    text = stderr.lower()
    return any(needle in text for needle in ("storage-opt", "storage opt", "storage option", "quota",
                                             "invalid option", "size option", "not supported"))


def bounded_output(argv, limit, timeout=30):
    """(returncode, stdout bytes, too_long) of a command whose output the container controls: at most `limit`
    bytes are read; past that the command is killed and too_long is True."""
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    except FileNotFoundError:
        raise AgentError("command_not_found", "%s is not installed on this node" % argv[0]) from None
    chunks, size, deadline = [], 0, time.monotonic() + timeout
    try:
        while size <= limit and time.monotonic() < deadline:
            chunk = proc.stdout.read1(min(65536, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        too_long = size > limit or time.monotonic() >= deadline
        if too_long:
            proc.kill()
        proc.stdout.close()
        try:
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    return code, b"".join(chunks)[:limit], too_long


MAX_OS_RELEASE = 64 * 1024  # the tar of /etc/os-release as docker cp streams it
MAX_HOST_KEY = 4096
MAX_LOG_LINE = 4096  # a container's log line longer than this is cut
MAX_LOG_BYTES = 64 * 1024 * 1024  # read from `docker logs` for one logs command


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
                    volumes=(), box=None, env_path=None, command=(), limits=None):
    """`docker create` (run_argv's name is kept: `docker run -d` minus the start) for one VM."""
    argv = ["docker", "create", "--name", vm_name(vm_id), "--hostname", vm_id, "--label", LABEL + "=" + vm_id]
    argv += ISOLATION_ARGV + LOG_ARGV
    if limits:
        argv += limits_argv(limits)
    argv += gpu_argv(gpus, gpu_indices)
    argv += publish(bind, host_port, 22)
    for name, hp in sorted((ports or {}).items()):
        argv += publish(bind, hp, int(name.split("/")[0]))
    argv += ["-v", keys_path + ":/root/.ssh/authorized_keys:ro"]
    if box:  # (the entry wrapper's own state lives in the container's writable layer, under its disk limit)
        argv += ["-v", os.path.join(box, "box") + ":/.gpumarket:ro", "--init", "--entrypoint", "/bin/sh"]
    for vol in volumes:
        argv += ["--mount", mount_arg(type="volume", src=vol["name"], dst=vol["mount"])]
    if env_path:
        argv += ["--env-file", env_path]
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
    return "running" if status in ("running", "restarting") else "stopped"


def docker_config_json(reference, registry_auth):
    """A DOCKER_CONFIG's config.json: credentials for the reference's registry only, or none at all."""
    auths = {}
    if registry_auth:
        token = "%s:%s" % (registry_auth["username"], registry_auth["password"])
        auths[registry_key(reference)] = {"auth": base64.b64encode(token.encode()).decode()}
    return json.dumps({"auths": auths})


def pull_reason(text, registry_auth):
    """The registry's reason from docker's stderr, without docker's prefix and never with the password."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    reason = (lines[-1] if lines else "docker pull failed").replace("Error response from daemon: ", "")
    if registry_auth:
        reason = reason.replace(registry_auth["password"], "***")
    return reason[-800:]


def container_log_tail(argv, tail, max_line=MAX_LOG_LINE, max_bytes=MAX_LOG_BYTES, timeout=60):
    """The last `tail` lines a command prints (stdout and stderr), each cut at max_line bytes, reading at most
    max_bytes: memory stays bounded however long a line the container wrote. [] if the command fails."""
    lines, current, size, cut = collections.deque(maxlen=tail), bytearray(), 0, False
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except FileNotFoundError:
        return []
    deadline = time.monotonic() + timeout
    ended = False
    try:
        while size < max_bytes and time.monotonic() < deadline:
            chunk = proc.stdout.read1(65536)
            if not chunk:
                ended = True
                break
            size += len(chunk)
            for n, piece in enumerate(chunk.split(b"\n")):
                if n:
                    lines.append(bytes(current))
                    current, cut = bytearray(), False
                if not cut:
                    current += piece[:max_line - len(current)]
                    cut = len(current) >= max_line
        if current:
            lines.append(bytes(current))
    finally:
        if not ended:
            proc.kill()  # past the bounds: what was read is kept
        proc.stdout.close()
        code = proc.wait()
    if ended and code != 0:
        return []
    return [ln.decode("utf-8", "replace") for ln in lines]


class DockerRuntime(Runtime):
    name = "docker"

    def pull(self, rec, registry_auth):
        """docker pull with a fresh, private DOCKER_CONFIG: the renter's credentials or none (never the node's)."""
        image, vm_id = rec["spec"]["image"]["docker"], rec["vm_id"]
        present = self.cfg.docker_pull == "missing" and \
            run(["docker", "image", "inspect", image], check=False).returncode == 0
        if present:
            vm_log(self.cfg, vm_id, "image %s is present; not pulled (GPUMARKET_DOCKER_PULL=missing)" % image)
            return
        vm_log(self.cfg, vm_id, "pulling %s%s" % (image, " with registry credentials" if registry_auth else ""))
        config_dir = tempfile.mkdtemp(prefix="gpumarket-pull-")  # mode 0700
        try:
            write_file(os.path.join(config_dir, "config.json"), docker_config_json(image, registry_auth), 0o600)
            proc = run(["docker", "--config", config_dir, "pull", image], timeout=900, check=False)
        finally:
            shutil.rmtree(config_dir, ignore_errors=True)
        if proc.returncode != 0:
            reason = pull_reason(proc.stderr or proc.stdout, registry_auth)
            vm_log(self.cfg, vm_id, "pull failed: " + reason)
            raise AgentError("pull_failed", reason)
        done = [ln for ln in proc.stdout.splitlines() if ln.startswith(("Digest:", "Status:"))]
        vm_log(self.cfg, vm_id, "pulled %s%s" % (image, (": " + "; ".join(done)) if done else ""))

    def image_command(self, image):
        """The image's own entrypoint + cmd, which the entry wrapper runs after its work."""
        proc = run(["docker", "image", "inspect", "--format", "{{json .Config}}", image])
        config = json.loads(proc.stdout) or {}
        return list(config.get("Entrypoint") or []) + list(config.get("Cmd") or [])

    def write_box(self, rec):
        vmdir, spec = vm_dir(self.cfg, rec["vm_id"]), rec["spec"]
        os.makedirs(os.path.join(vmdir, "box"), mode=0o700, exist_ok=True)
        box = os.path.join(vmdir, "box")
        write_file(os.path.join(box, "entry.sh"), ENTRY_SH, 0o755)
        env = spec.get("env", {})
        write_file(os.path.join(box, "profile.sh"), profile_sh(env), 0o600)  # root in the container reads it
        write_file(os.path.join(box, "environment"), pam_environment(env), 0o600)
        if spec.get("onstart"):
            write_file(os.path.join(box, "onstart.sh"), spec["onstart"], 0o600)
        env_path = os.path.join(vmdir, "env.list")
        write_file(env_path, env_file(env), 0o600)
        return vmdir, env_path

    def ensure_network(self):
        """The gpumarket bridge, made once per node with inter-container traffic off; one of that name made
        otherwise is refused rather than used."""
        proc = run(["docker", "network", "inspect", "--format", "{{json .Options}}", NETWORK], check=False)
        if proc.returncode != 0:
            made = run(NETWORK_ARGV, check=False)
            if made.returncode == 0 or "already exists" in made.stderr:
                return self.ensure_network() if made.returncode else None
            raise AgentError("command_failed", "docker network create: " + made.stderr.strip()[-800:])
        try:
            options = json.loads(proc.stdout) or {}
        except ValueError:
            options = {}
        if options.get("com.docker.network.bridge.enable_icc") != "false":
            raise AgentError("bad_node_config", "docker network %s exists but lets containers reach one another "
                             "(no com.docker.network.bridge.enable_icc=false): remove it, the agent makes its own"
                             % NETWORK)
        return None

    def limits(self, spec):
        """The container's share of the host (container_share) and its disk, recorded with the VM."""
        cores, ram_mib, pids = host_resources()
        gpus = float(len(spec["gpu_indices"]))
        if spec.get("mig_uuids"):
            gpus = min(gpus, len(spec["mig_uuids"]) / float(MIG_SLICES_PER_GPU))
        total = len(read_gpus(self.cfg)[0])
        cpus, memory_mib, pid_limit = container_share(cores, ram_mib, pids, gpus, total)
        return {"cpus": cpus, "memory_mib": memory_mib, "pids": pid_limit, "disk_gb": spec.get("disk_gb"),
                "disk_limit": "enforced"}

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
            self.pull(rec, registry_auth)
            command = self.image_command(spec["image"]["docker"])
            self.ensure_network()
            rec["limits"] = self.limits(spec)
            vmdir, env_path = self.write_box(rec)
            # A MIG instance gets its slices only (the toolkit takes MIG-... UUIDs as devices), others their cards.
            devices = rec["gpu_devices"] = container_devices(spec, self.cfg.docker_gpus)

            def argv_for(limits):
                return docker_run_argv(vm_id, devices, spec["image"]["docker"],
                                       rec["ssh_port"], keys_path, gpus=self.cfg.docker_gpus, bind=self.cfg.docker_bind,
                                       ports=rec.get("ports"), volumes=spec.get("volumes", ()), box=vmdir,
                                       env_path=env_path, command=command, limits=limits)
            try:
                self.create_container(rec, argv_for)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(env_path)  # the container holds the env now; the record keeps the spec
            rec["os"] = self.read_os(vm_id)
            vm_log(self.cfg, vm_id, "created container %s (%s; %s)" % (
                vm_name(vm_id), rec["os"] or "OS unknown", limits_text(rec["limits"])))
        self.checked_start(rec)
        if not rec.get("ssh_host_key"):
            rec["ssh_host_key"] = self.read_host_key(vm_id)

    def read_os(self, vm_id):
        """PRETTY_NAME of the container's /etc/os-release (a created container is enough: docker cp reads it).
        The image controls that file: at most MAX_OS_RELEASE bytes are read."""
        for path in ("/etc/os-release", "/usr/lib/os-release"):
            with contextlib.suppress(OSError, subprocess.SubprocessError, tarfile.TarError, AttributeError, AgentError):
                code, out, too_long = bounded_output(
                    ["docker", "cp", "-L", "%s:%s" % (vm_name(vm_id), path), "-"], MAX_OS_RELEASE)
                if code == 0 and not too_long:
                    with tarfile.open(fileobj=io.BytesIO(out)) as tar:
                        member = tar.next()
                        if member is None or not member.isfile() or member.size > MAX_OS_RELEASE:
                            continue
                        text = tar.extractfile(member).read(MAX_OS_RELEASE).decode("utf-8", "replace")
                        return os_release_pretty_name(text)
        return None

    def read_host_key(self, vm_id, timeout=30.0):
        """The container's sshd ed25519 host key (made by the entry wrapper at first boot), for pinning."""
        deadline, has_sshd = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            argv = ["docker", "exec", vm_name(vm_id), "cat", "/etc/ssh/ssh_host_ed25519_key.pub"]
            code, out, too_long = bounded_output(argv, MAX_HOST_KEY)  # the container writes that file
            text = out.decode("utf-8", "replace")
            if code == 0 and not too_long and text.startswith("ssh-ed25519 "):
                return " ".join(text.split()[:2])
            if has_sshd is None:
                has_sshd = any(run(["docker", "exec", vm_name(vm_id), "test", "-x", sshd], check=False).returncode == 0
                               for sshd in ("/usr/sbin/sshd", "/usr/local/sbin/sshd"))
            if not has_sshd or self.state({"vm_id": vm_id}) != "running":
                return None  # stopped (its command exited) or no sshd in the image: no key will come
            time.sleep(0.1)
        return None

    def disk_limit(self, rec):
        """A container made before the limits (no `limits` in its record) has none."""
        return (rec.get("limits") or {}).get("disk_limit") or "not_enforced"

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
        if self.state(rec) == "running":
            run(docker_verb_argv("stop", rec["vm_id"]), timeout=60)

    def destroy(self, rec):
        proc = run(docker_verb_argv("rm", rec["vm_id"]), check=False)
        if proc.returncode != 0 and "No such container" not in proc.stderr:
            raise AgentError("command_failed", "docker rm: " + proc.stderr.strip()[-800:])

    def state(self, rec):
        proc = run(docker_verb_argv("inspect", rec["vm_id"]), check=False)
        if proc.returncode != 0:
            if "No such" in proc.stderr:
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
