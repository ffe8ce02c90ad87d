"""The docker runtime: a VM is a container with its GPUs passed through, sshd inside and its ports published.

Every docker command is an argument list. The renter's options reach the container as files the agent writes
(an --env-file, the box folder of dockerbox.py) and as argv items, never through a shell on the node."""
import base64
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
from ..validation import VM_ID_RE
from .base import Runtime, os_release_pretty_name, vm_name
from .dockerbox import ENTRY_SH, env_file, pam_environment, profile_sh

LABEL = "gpumarket.vm_id"


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


def publish(bind, host_port, port):
    return ["-p", ("%s:%d:%d" % (bind, host_port, port)) if bind else "%d:%d" % (host_port, port)]


def mount_arg(**fields):
    """A --mount value: CSV, so a path holding ',' or '"' is quoted as docker's parser expects."""
    out = io.StringIO()
    csv.writer(out, lineterminator="").writerow("%s=%s" % kv for kv in fields.items())
    return out.getvalue()


def docker_run_argv(vm_id, gpu_indices, image, host_port, keys_path, gpus="toolkit", bind=None, ports=None,
                    volumes=(), box=None, env_path=None, command=()):
    """`docker create` (run_argv's name is kept: `docker run -d` minus the start) for one VM."""
    argv = ["docker", "create", "--name", vm_name(vm_id), "--hostname", vm_id, "--label", LABEL + "=" + vm_id]
    argv += gpu_argv(gpus, gpu_indices)
    argv += publish(bind, host_port, 22)
    for name, hp in sorted((ports or {}).items()):
        argv += publish(bind, hp, int(name.split("/")[0]))
    argv += ["-v", keys_path + ":/root/.ssh/authorized_keys:ro"]
    if box:
        argv += ["-v", os.path.join(box, "box") + ":/.gpumarket:ro", "-v", os.path.join(box, "state") +
                 ":/.gpumarket-state", "--init", "--entrypoint", "/bin/sh"]
    for vol in volumes:
        argv += ["--mount", mount_arg(type="volume", src=vol["name"], dst=vol["mount"])]
    if env_path:
        argv += ["--env-file", env_path]
    argv += ["--restart", "unless-stopped", image]
    if box:
        argv += ["/.gpumarket/entry.sh"] + list(command)
    return argv


def docker_verb_argv(verb, vm_id):
    return {"start": ["docker", "start", vm_name(vm_id)],
            "stop": ["docker", "stop", "--time", "20", vm_name(vm_id)],
            "rm": ["docker", "rm", "-f", vm_name(vm_id)],
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
        for sub in ("box", "state"):
            os.makedirs(os.path.join(vmdir, sub), mode=0o700, exist_ok=True)
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

    def provision(self, rec, registry_auth=None):
        vm_id, spec = rec["vm_id"], rec["spec"]
        keys_path = os.path.join(vm_dir(self.cfg, vm_id), "authorized_keys")
        write_file(keys_path, "\n".join(spec["ssh_public_keys"]) + "\n", 0o600)
        if self.state(rec) == "missing":
            self.pull(rec, registry_auth)
            command = self.image_command(spec["image"]["docker"])
            vmdir, env_path = self.write_box(rec)
            try:
                # A MIG instance gets its slices only (the toolkit takes MIG-... UUIDs as devices).
                devices = spec.get("mig_uuids") if self.cfg.docker_gpus == "toolkit" else None
                run(docker_run_argv(vm_id, devices or spec["gpu_indices"], spec["image"]["docker"], rec["ssh_port"],
                                    keys_path,
                                    gpus=self.cfg.docker_gpus, bind=self.cfg.docker_bind, ports=rec.get("ports"),
                                    volumes=spec.get("volumes", ()), box=vmdir, env_path=env_path,
                                    command=command), timeout=120)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(env_path)  # the container holds the env now; the record keeps the spec
            rec["os"] = self.read_os(vm_id)
            vm_log(self.cfg, vm_id, "created container %s (%s)" % (vm_name(vm_id), rec["os"] or "OS unknown"))
        self.start(rec)
        if not rec.get("ssh_host_key"):
            rec["ssh_host_key"] = self.read_host_key(vm_id)

    def read_os(self, vm_id):
        """PRETTY_NAME of the container's /etc/os-release (a created container is enough: docker cp reads it)."""
        for path in ("/etc/os-release", "/usr/lib/os-release"):
            with contextlib.suppress(OSError, subprocess.SubprocessError, tarfile.TarError, AttributeError):
                proc = subprocess.run(["docker", "cp", "-L", "%s:%s" % (vm_name(vm_id), path), "-"],
                                      stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
                if proc.returncode == 0:
                    with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
                        member = tar.next()
                        return os_release_pretty_name(tar.extractfile(member).read().decode("utf-8", "replace"))
        return None

    def read_host_key(self, vm_id, timeout=30.0):
        """The container's sshd ed25519 host key (made by the entry wrapper at first boot), for pinning."""
        deadline, has_sshd = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            proc = run(["docker", "exec", vm_name(vm_id), "cat", "/etc/ssh/ssh_host_ed25519_key.pub"], check=False)
            if proc.returncode == 0 and proc.stdout.startswith("ssh-ed25519 "):
                return " ".join(proc.stdout.split()[:2])
            if has_sshd is None:
                has_sshd = any(run(["docker", "exec", vm_name(vm_id), "test", "-x", sshd], check=False).returncode == 0
                               for sshd in ("/usr/sbin/sshd", "/usr/local/sbin/sshd"))
            if "is not running" in proc.stderr or not has_sshd:
                return None  # stopped (its command exited) or no sshd in the image: no key will come
            time.sleep(0.1)
        return None

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
        """The agent's lines and the container's (onstart, the image's command), merged by time."""
        ours = tail_lines(log_path(self.cfg, rec["vm_id"]), tail)
        proc = subprocess.run(["docker", "logs", "--timestamps", "--tail", str(tail), vm_name(rec["vm_id"])],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
        theirs = proc.stdout.decode("utf-8", "replace").splitlines() if proc.returncode == 0 else []
        return sorted(ours + theirs, key=lambda line: line.split(" ", 1)[0])[-tail:]

    def unrecorded(self, known):
        found = []
        for line in run(DOCKER_LIST_ARGV).stdout.splitlines():
            vm_id, _, status = line.partition("\t")
            if VM_ID_RE.fullmatch(vm_id) and vm_id not in known:
                found.append({"vm_id": vm_id, "state": docker_state(status)})
        return found

    def volume_create(self, name, size_gb):
        # The local driver has no size limit: the size is recorded (volumes.py), not enforced.
        run(["docker", "volume", "create", "--label", "gpumarket.volume=" + name, name])

    def volume_delete(self, name):
        proc = run(["docker", "volume", "rm", name], check=False)
        if proc.returncode != 0 and "no such volume" not in proc.stderr.lower():
            if "in use" in proc.stderr:
                raise AgentError("volume_in_use", "volume %s: %s" % (name, proc.stderr.strip()[-300:]))
            raise AgentError("command_failed", "docker volume rm: " + proc.stderr.strip()[-800:])

    def health(self):
        proc = run(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=15, check=False)
        return proc.returncode == 0, (proc.stdout.strip() or proc.stderr.strip())[-300:]
