"""The docker runtime: a VM is a container with its GPUs passed through."""
import os

from ..core import AgentError, run, write_file
from ..records import vm_dir
from ..validation import VM_ID_RE
from .base import Runtime, vm_name


def docker_run_argv(vm_id, gpu_indices, image, host_port, keys_path):
    # --gpus parses its value as CSV, so "device=0,1" needs literal double quotes to stay one item.
    return ["docker", "run", "-d", "--name", vm_name(vm_id), "--hostname", vm_id,
            "--label", "gpumarket.vm_id=" + vm_id,
            "--gpus", '"device=%s"' % ",".join(str(i) for i in gpu_indices),
            "-p", "%d:22" % host_port, "-v", keys_path + ":/root/.ssh/authorized_keys:ro",
            "--restart", "unless-stopped", image]


def docker_verb_argv(verb, vm_id):
    return {"start": ["docker", "start", vm_name(vm_id)],
            "stop": ["docker", "stop", "--time", "20", vm_name(vm_id)],
            "rm": ["docker", "rm", "-f", vm_name(vm_id)],
            "inspect": ["docker", "inspect", "--format", "{{.State.Status}}", vm_name(vm_id)]}[verb]


DOCKER_LIST_ARGV = ["docker", "ps", "-a", "--filter", "label=gpumarket.vm_id",
                    "--format", '{{.Label "gpumarket.vm_id"}}\t{{.State}}']


def docker_state(status):
    return "running" if status in ("running", "restarting") else "stopped"


class DockerRuntime(Runtime):
    name = "docker"

    def provision(self, rec, registry_auth=None):
        keys_path = os.path.join(vm_dir(self.cfg, rec["vm_id"]), "authorized_keys")
        write_file(keys_path, "\n".join(rec["spec"]["ssh_public_keys"]) + "\n", 0o600)
        if self.state(rec) == "missing":
            spec = rec["spec"]
            run(docker_run_argv(rec["vm_id"], spec["gpu_indices"], spec["image"]["docker"], rec["ssh_port"],
                                keys_path), timeout=900)  # may pull the image
        self.start(rec)

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

    def unrecorded(self, known):
        found = []
        for line in run(DOCKER_LIST_ARGV).stdout.splitlines():
            vm_id, _, status = line.partition("\t")
            if VM_ID_RE.fullmatch(vm_id) and vm_id not in known:
                found.append({"vm_id": vm_id, "state": docker_state(status)})
        return found

    def health(self):
        proc = run(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=15, check=False)
        return proc.returncode == 0, (proc.stdout.strip() or proc.stderr.strip())[-300:]
