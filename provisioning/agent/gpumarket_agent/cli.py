"""The command line: one JSON request on stdin, one JSON answer on stdout."""
import contextlib
import json
import os
import socket
import sys
import time

from .core import (
    _WATCHDOG,
    AGENT_VERSION,
    MAX_REQUEST_BYTES,
    AgentError,
    Config,
    emit,
    invalid,
    safe_text,
    state_or_unknown,
)
from .records import scan_records
from .runtimes import RUNTIME_CLASSES
from .smi import host_facts, inventory_hash, load_profile, read_gpus
from .validation import reject_unknown


def cmd_inventory(cfg, req):
    from .mig import read_mig
    from .topology import read_topology
    reject_unknown(req, ())
    gpus, cuda = read_gpus(cfg)
    profile = load_profile(cfg.sim_profile)[0] if cfg.runtime == "sim" else None
    answer = {"runtime": cfg.runtime, "hostname": socket.gethostname(), "gpus": gpus, "gpu_count": len(gpus),
              "driver_version": gpus[0]["driver_version"] if gpus else None, "cuda_version": cuda,
              "topology": read_topology(cfg, gpus, profile) if gpus else None,
              "mig": read_mig(cfg, gpus) if gpus else []}
    answer.update(host_facts(cfg))
    return answer


def cmd_health(cfg, req):
    reject_unknown(req, ())
    answer = {"runtime": cfg.runtime, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "load": list(os.getloadavg()), "uptime_s": None, "gpu_count": None, "gpu_error": None,
              "inventory_hash": None, "gpu_uuids": None}
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/uptime") as f:
            answer["uptime_s"] = float(f.read().split()[0])
    try:
        gpus = read_gpus(cfg)[0]
        answer["gpu_count"], answer["inventory_hash"] = len(gpus), inventory_hash(gpus)
        # Which cards nvidia-smi lists now: the platform notices one that fell off the bus within one interval.
        answer["gpu_uuids"] = [g.get("uuid") for g in gpus]
    except AgentError as exc:
        answer["gpu_error"] = exc.message
    try:
        ok, detail = RUNTIME_CLASSES[cfg.runtime](cfg).health() if cfg.runtime else (False, "GPUMARKET_RUNTIME unset")
    except AgentError as exc:
        ok, detail = False, exc.message
    answer["runtime_ok"], answer["runtime_detail"] = ok, detail
    # The state of each VM, so that the platform notices a VM that stopped within one health interval.
    answer["vms"] = None
    if cfg.runtime:
        with contextlib.suppress(AgentError, OSError, ValueError):
            rt = RUNTIME_CLASSES[cfg.runtime](cfg)
            records, errors = scan_records(cfg)  # a record that cannot be read: "unknown" (records.RecordUnreadable)
            vms = dict.fromkeys(errors, "unknown")
            for rec in records:  # one VM whose state cannot be read is "unknown", not every VM's null
                vms[rec["vm_id"]], error = state_or_unknown(rt, rec)
                if error:
                    errors[rec["vm_id"]] = error
            answer["vms"], answer["vm_errors"] = vms, errors
    return answer


def cmd_benchmark(cfg, req):
    from .benchmark import cmd_benchmark
    return cmd_benchmark(cfg, req)


COMMANDS = {"inventory": cmd_inventory, "health": cmd_health, "benchmark": cmd_benchmark}
SERVED = {"health": cmd_health}  # what `serve` answers: read-only commands (serve.py)


def handle(argv, stdin_text, env):
    """Run one command; return (answer dict, exit status). Never raises."""
    try:
        cfg = Config(env)
        try:
            req = json.loads(stdin_text) if stdin_text.strip() else {}
        except ValueError as exc:
            raise invalid("request", "stdin is not JSON: %s" % exc) from None
        except RecursionError:  # the renter's/caller's input, not our bug: no internal_error for it
            raise invalid("request", "stdin is nested too deeply") from None
        if not isinstance(req, dict):
            raise invalid("request", "the request must be a JSON object")
        if argv[:1] == ["vm"] and len(argv) == 2:
            from .vm import cmd_vm
            answer = cmd_vm(cfg, req, argv[1])
        elif argv[:1] == ["volume"] and len(argv) == 2:
            from .vm import cmd_volumes
            answer = cmd_volumes(cfg, req, argv[1])
        elif len(argv) == 1 and argv[0] in COMMANDS:
            answer = COMMANDS[argv[0]](cfg, req)
        else:
            raise invalid("command", "usage: gpumarket_agent.py inventory|health|benchmark|challenge|memproof|"
                                    "vm <subcommand>|volume <subcommand>")
        answer.update(ok=True, agent_version=AGENT_VERSION)
        return answer, 0
    except AgentError as exc:
        error = {"code": exc.code, "message": exc.message}
        if exc.field:
            error["field"] = exc.field
        return {"ok": False, "agent_version": AGENT_VERSION, "error": error}, 2 if exc.code == "invalid_request" else 1
    except Exception as exc:  # the caller must always get one JSON object, even for our own bugs
        return {"ok": False, "agent_version": AGENT_VERSION,
                "error": {"code": "internal_error", "message": safe_text("%s: %s" % (type(exc).__name__, exc))}}, 1


def main():
    _WATCHDOG.append(True)
    argv = sys.argv[1:]
    if argv[:1] == ["_sim-nvidia-smi"] and len(argv) >= 2:  # the fake nvidia-smi of a sim VM
        from .runtimes.sim import sim_nvidia_smi
        return sim_nvidia_smi(argv[2:], argv[1])
    if argv[:1] == ["_sim-box"]:  # the ports and onstart of a sim VM (runtimes/simbox.py)
        from .runtimes.simbox import main_sim_box
        return main_sim_box(argv[1:])
    if argv == ["serve"]:  # long-lived: one JSON request a line, one answer a line (serve.py)
        from .serve import serve
        return serve(os.environ, SERVED)
    if argv in (["challenge"], ["memproof"]):  # interactive: one JSON object a line both ways
        try:
            cfg = Config(os.environ)
        except AgentError as exc:
            emit({"ok": False, "agent_version": AGENT_VERSION, "error": {"code": exc.code, "message": exc.message}})
            return 1
        if argv == ["challenge"]:
            from .challenge import main_challenge
            return main_challenge(cfg)
        from .memproof import main_memproof
        return main_memproof(cfg)
    stdin_text = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read(MAX_REQUEST_BYTES + 1)
    if len(stdin_text) > MAX_REQUEST_BYTES:
        answer, status = {"ok": False, "agent_version": AGENT_VERSION, "error": {
            "code": "invalid_request", "message": "request larger than 1 MiB"}}, 2
    else:
        answer, status = handle(argv, stdin_text, os.environ)
    emit(answer)
    return status
