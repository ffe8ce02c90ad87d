"""What a sim VM runs beside its sshd: one process that answers the VM's mapped ports and runs onstart once.

Started detached by the sim runtime (`gpumarket_agent.pyz _sim-box <vm dir>`); its command line names the VM's
folder, so stopping the VM finds it (and onstart, and all their children) as it finds the VM's sshd."""
import contextlib
import os
import socket
import subprocess
import threading

from ..core import read_json, write_file
from ..records import append_log

BOX_FILE = "box.json"


def _serve(sock, banner):
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        with contextlib.suppress(OSError), conn:
            conn.settimeout(2)
            conn.sendall(banner)


def run_onstart(vmdir, conf, log):
    """Once per VM: the marker is written before the script starts, so a crash mid-way never runs it twice."""
    marker = os.path.join(vmdir, "onstart.started")
    if not conf.get("onstart") or os.path.exists(marker):
        return
    write_file(marker, "")
    append_log(log, ["onstart: running"])
    proc = subprocess.Popen(["/bin/sh", conf["onstart"]], cwd=conf["env"].get("HOME") or vmdir,
                            env=conf["env"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    for raw in proc.stdout:
        append_log(log, [raw.decode("utf-8", "replace")], prefix="")
    append_log(log, ["onstart: exited %d" % proc.wait()])


def sim_box(vmdir):
    conf = read_json(os.path.join(vmdir, BOX_FILE))
    log = os.path.join(vmdir, "vm.log")
    threads = []
    for name, port in sorted(conf["ports"].items()):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((conf["listen"], port))
            sock.listen(16)
        except OSError as exc:
            append_log(log, ["port %s: cannot listen on %s:%d: %s" % (name, conf["listen"], port, exc)])
            return 1
        banner = ("gpumarket sim VM %s: container port %s\n" % (conf["vm_id"], name)).encode()
        threads.append(threading.Thread(target=_serve, args=(sock, banner), daemon=True))
    for thread in threads:
        thread.start()
    if conf["ports"]:
        append_log(log, ["ports: " + ", ".join("%s -> %s:%d" % (n, conf["listen"], p)
                                               for n, p in sorted(conf["ports"].items()))])
    run_onstart(vmdir, conf, log)
    threading.Event().wait()  # until the VM is stopped
    return 0


def main_sim_box(argv):
    return sim_box(argv[0]) if len(argv) == 1 else 2

