"""A container whose image's command exits at once, or whose image runs as a non-root user (found by review): the
entry wrapper keeps it running (the wrapper itself runs here too, on this host's /bin/sh), the box is readable by
the image's user, and a crash-looping container is not answered "running" (stand-in docker CLI of
test_agent_docker.py; tests/docker/test_docker_entry.py: a real engine)."""
import json
import os
import signal
import stat
import subprocess
import threading
import time

import pytest

from provisioning.agent import gpumarket_agent as agent
from provisioning.agent.gpumarket_agent.runtimes import docker as docker_runtime
from provisioning.agent.gpumarket_agent.runtimes.dockerbox import ENTRY_SH
from tests.provisioning.test_agent_docker import node  # noqa: F401 - the fixture

# nvidia/cuda's /opt/nvidia/nvidia_entrypoint.sh ends so: with no CMD it execs a bare bash.
NVIDIA_ENTRYPOINT = 'if [ $# -eq 0 ]; then exec /bin/bash; else exec "$@"; fi\n'


def _signals_at_their_defaults():
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def start_like_docker_init(args, **popen):
    """The wrapper starts in a container with every signal at its default (docker-init's child). A suite started in
    the background (`pytest ... &` from a script) would hand it SIGINT and SIGQUIT ignored, which POSIX sh cannot
    undo: the test of the image's command keeping them failed on that start, which no container gives it."""
    return subprocess.Popen(args, preexec_fn=_signals_at_their_defaults, **popen)


def wrapper_here(tmp_path, sshd=""):
    """ENTRY_SH runnable on this host: its box and state in tmp_path, /etc left alone, no sshd (each replaced line
    must be found, so a change of the wrapper shows here)."""
    script = ENTRY_SH
    for old, new in [("G=/.gpumarket\n", f"G={tmp_path}/box\n"), ("S=/.gpumarket-state\n", f"S={tmp_path}/state\n"),
                     ("if [ -w /etc ]; then", "if false; then"),
                     ("for candidate in /usr/sbin/sshd /usr/local/sbin/sshd; do", f"for candidate in {sshd}; do")]:
        assert script.count(old) == 1, old
        script = script.replace(old, new)
    (tmp_path / "box").mkdir()
    (tmp_path / "entry.sh").write_text(script)
    (tmp_path / "nvidia_entrypoint.sh").write_text(NVIDIA_ENTRYPOINT)
    return str(tmp_path / "entry.sh")


class Output:
    """The wrapper's output read as it comes (a thread), so that a test waits for what it needs to have happened
    before the stop, not a fixed second: on a loaded machine (CI's two cores under five xdist workers) `bash -l`
    took longer than that to exit, and the stop came first."""

    def __init__(self, proc):
        self.proc, self.lines = proc, []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, needle: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text:
            if self.proc.poll() is not None:
                self.thread.join(5)
                assert needle in self.text, f"the wrapper ended without {needle!r}: {self.text}"
                return
            assert time.monotonic() < deadline, f"no {needle!r} after {timeout} s: {self.text}"
            time.sleep(0.05)

    def rest(self, timeout: float = 10.0) -> str:
        """Everything, once the wrapper has ended (after the stop)."""
        self.proc.wait(timeout)
        self.thread.join(timeout)
        return self.text


def docker_stop(proc, sig=signal.SIGTERM):
    """docker stop through docker-init with TINI_KILL_PROCESS_GROUP (dockerargv): the signal to the wrapper's whole
    process group (the wrapper is started here in a session of its own)."""
    os.killpg(proc.pid, sig)


@pytest.mark.parametrize("command", [
    ["/bin/bash"], ["sh"], ["/bin/sh", "-c", "bash"], ["bash", "-l"], ["/bin/sh", "{nvidia}"], ["true"], ["false"],
])
def test_the_wrapper_outlives_an_image_command_that_exits_at_once_and_ends_at_a_stop(tmp_path, command):
    """Found by review: only ["/bin/bash"] was recognised as a bare shell; nvidia/cuda's entrypoint (it execs bash
    when given nothing), shell-form `CMD bash` and `bash -l` exited at once and the container crash-looped."""
    entry = wrapper_here(tmp_path)
    command = [a.format(nvidia=tmp_path / "nvidia_entrypoint.sh") for a in command]
    proc = start_like_docker_init(["/bin/sh", entry, *command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output = Output(proc)
    rc = 1 if command == ["false"] else 0
    try:
        output.wait_for(f"[gpumarket] the image's command exited {rc}; the instance stays up for SSH\n")
        time.sleep(0.5)
        assert proc.poll() is None, output.text  # still up after its command ended: the container is not restarted
        started = time.monotonic()
        docker_stop(proc)  # docker stop (through --init)
        out = output.rest()
        assert time.monotonic() - started < 3, out  # at once, not at docker stop's 20 s kill
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(("rc", "wrappers"), [(0, False), (1, True)])
def test_an_image_whose_command_is_sshd_runs_it_and_the_wrappers_only_if_it_fails(tmp_path, rc, wrappers):
    """The image's own sshd is SSH (the wrapper starts none beside it); one that exits 0 daemonised and still
    serves, one that fails is replaced by the wrapper's."""
    fake = tmp_path / "sshd"
    fake.write_text('#!/bin/sh\necho "wrapper sshd $*"\n')
    fake.chmod(0o700)
    image_sshd = tmp_path / "image-sshd"
    image_sshd.write_text(f'#!/bin/sh\necho "image sshd $*"\nexit {rc}\n')
    image_sshd.chmod(0o700)
    entry = wrapper_here(tmp_path, sshd=str(fake))
    proc = start_like_docker_init(["/bin/sh", entry, str(image_sshd), "-D"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output = Output(proc)
    try:
        if wrappers:
            output.wait_for("[gpumarket] sshd started\n")
        else:
            output.wait_for("image sshd -D\n")
            time.sleep(1.0)  # and no wrapper's sshd after it
        assert proc.poll() is None
        docker_stop(proc)
        out = output.rest()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert out.startswith("image sshd -D\n"), out  # no wrapper's sshd before the image's
    assert ("wrapper sshd -e\n[gpumarket] sshd started\n" in out) == wrappers, out


def test_a_stop_ends_the_images_command_still_running(tmp_path):
    entry = wrapper_here(tmp_path)
    marker = tmp_path / "ended"
    command = ["/bin/sh", "-c", f"trap 'echo term > {marker}; exit 0' TERM; echo ready; while :; do sleep 0.1; done"]
    proc = start_like_docker_init(["/bin/sh", entry, *command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output = Output(proc)
    try:
        output.wait_for("ready\n")  # its trap is set
        assert proc.poll() is None
        docker_stop(proc)
        out = output.rest()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert marker.read_text() == "term\n", out  # the command was told to stop, and the wrapper waited for it
    assert "exited" not in out


def test_the_images_command_gets_no_stdin(tmp_path):
    entry = wrapper_here(tmp_path)
    proc = start_like_docker_init(["/bin/sh", entry, "/bin/sh", "-c", "cat; echo read-eof"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output = Output(proc)
    try:
        # stdin kept open here: a command reading the wrapper's stdin would still wait (and this times out)
        output.wait_for("[gpumarket] the image's command exited")
        docker_stop(proc)
        out = output.rest()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "read-eof\n[gpumarket] the image's command exited 0" in out, out


def test_an_image_whose_command_is_bash_gets_the_wrapper_running_it(node, monkeypatch):  # noqa: F811
    monkeypatch.setattr(docker_runtime, "image_command", lambda image: ["/bin/bash"])
    vm = node.create("inst-1", [0], image="ubuntu:22.04")
    assert vm["ok"] and vm["state"] == "running", vm
    (create,) = node.creates()
    assert create[-3:] == ["ubuntu:22.04", "/.gpumarket/entry.sh", "/bin/bash"]  # the wrapper outlives bash's EOF


def test_the_box_is_readable_by_the_images_user_and_the_vm_folder_by_nobody_else(node):  # noqa: F811
    assert node.create("inst-2", [0], env={"API_KEY": "secret"}, onstart="echo hi")["ok"]
    (create,) = node.creates()
    (box,) = [a.split(":")[0] for a in create if a.endswith(":/.gpumarket:ro")]  # -v <vm dir>/box:/.gpumarket:ro
    vmdir = os.path.dirname(box)

    def mode(path):
        return stat.S_IMODE(os.stat(path).st_mode)

    assert mode(vmdir) == 0o700  # the env in the box: no other user of the host reaches it
    assert mode(box) == 0o755
    assert {name: mode(os.path.join(box, name)) for name in os.listdir(box)} == {
        "entry.sh": 0o755, "profile.sh": 0o644, "environment": 0o644, "renter.env": 0o644, "onstart.sh": 0o644}


def set_status(tmp_path, name, status):
    path = tmp_path / "containers.json"
    state = json.loads(path.read_text())
    state[name] = status
    path.write_text(json.dumps(state))


def test_a_restarting_container_is_not_running_holds_its_gpus_and_is_stopped_by_a_stop(node, tmp_path):  # noqa: F811
    assert node.create("inst-3", [1], image="ghcr.io/x/app:1")["ok"]
    set_status(tmp_path, "gpumarket-inst-3", "restarting")  # its command exited; the engine runs it again
    assert node.states() == {"inst-3": "restarting"}
    assert node.call("vm status", {"vm_id": "inst-3"})["state"] == "restarting"
    busy = node.create("inst-4", [1])  # the engine starts it again on GPU 1, again and again
    assert busy["error"]["code"] == "gpu_busy", busy
    assert node.call("vm stop", {"vm_id": "inst-3"})["state"] == "stopped"
    assert ["stop", "--time", "20", "gpumarket-inst-3"] in node.docker_calls()


def test_docker_state_restarting_is_no_running_vm():
    assert agent.docker_state("restarting") not in ("running", "stopped", "missing")


def test_the_images_command_keeps_sigint_and_sigquit(tmp_path):
    """Found by review: run in the background (sh starts those with SIGINT and SIGQUIT ignored), the image's
    command and all it starts could not be interrupted: no KeyboardInterrupt, no Ctrl-C in a terminal it opens."""
    entry = wrapper_here(tmp_path)
    proc = start_like_docker_init(["/bin/sh", entry, "/bin/sh", "-c", "grep SigIgn /proc/self/status"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    output = Output(proc)
    try:
        output.wait_for("[gpumarket] the image's command exited")
        docker_stop(proc)
        out = output.rest()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ignored = int(out.split("SigIgn:")[1].split()[0], 16)
    assert not ignored & (1 << (signal.SIGINT - 1) | 1 << (signal.SIGQUIT - 1)), out


def test_an_images_own_stop_signal_reaches_its_command_and_ends_the_wrapper(tmp_path):
    """httpd's STOPSIGNAL is WINCH: docker stop sends it, the command shuts down gracefully, the wrapper ends."""
    entry = wrapper_here(tmp_path)
    marker = tmp_path / "ended"
    command = ["/bin/sh", "-c", f"trap 'echo winch > {marker}; exit 0' WINCH; echo ready; while :; do sleep 0.1; done"]
    proc = start_like_docker_init(["/bin/sh", entry, *command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output = Output(proc)
    try:
        output.wait_for("ready\n")  # its trap is set
        started = time.monotonic()
        docker_stop(proc, signal.SIGWINCH)
        out = output.rest()
        assert time.monotonic() - started < 3, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert marker.read_text() == "winch\n", out


class Listener:
    """Serves `greeting` to each connection on `sock` (bound by the test, listening from here on: an SSH server's
    banner, or not)."""

    def __init__(self, sock, greeting):
        import threading

        sock.listen(8)
        sock.settimeout(0.2)
        self.sock, self.greeting, self.done = sock, greeting, threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        while not self.done.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(self.greeting)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


def held_port(monkeypatch):
    """A port this test holds (bound, not listening: refused) and the VM's SSH port: no other process of a
    parallel run can answer on it (found by the clean-clone CI run: another's server answered the VM's port)."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    monkeypatch.setattr("provisioning.agent.gpumarket_agent.runtimes.base.pick_host_port",
                        lambda cfg, records, taken=(): port)
    return sock


def test_vm_status_probes_the_vms_ssh_on_the_node_itself(node, monkeypatch):  # noqa: F811
    """What the platform asks when it cannot reach a renter's own image's SSH: does it answer on the node? A host
    key file in the image says nothing (found by review); only an SSH server's banner on the published port does."""
    with held_port(monkeypatch) as sock:
        node.create("inst-6", [0])
        assert "ssh_answers" not in node.call("vm status", {"vm_id": "inst-6"})  # asked for only
        assert node.call("vm status", {"vm_id": "inst-6", "probe_ssh": True})["ssh_answers"] is False  # refused
        with Listener(sock, b"HTTP/1.1 400 Bad Request\r\n\r\n") as listener:
            assert node.call("vm status", {"vm_id": "inst-6", "probe_ssh": True})["ssh_answers"] is False
            listener.greeting = b"SSH-2.0-OpenSSH_9.2p1\r\n"
            assert node.call("vm status", {"vm_id": "inst-6", "probe_ssh": True})["ssh_answers"] is True
    bad = node.call("vm status", {"vm_id": "inst-6", "probe_ssh": "yes"})
    assert bad["error"]["code"] == "invalid_request" and "probe_ssh" in bad["error"]["message"], bad


def test_a_stopped_vms_ssh_does_not_answer(node, monkeypatch):  # noqa: F811
    with held_port(monkeypatch) as sock:
        node.create("inst-7", [0])
        assert node.call("vm stop", {"vm_id": "inst-7"})["state"] == "stopped"
        with Listener(sock, b"SSH-2.0-someone-else\r\n"):  # another process on its port is not its SSH
            assert node.call("vm status", {"vm_id": "inst-7", "probe_ssh": True})["ssh_answers"] is False
