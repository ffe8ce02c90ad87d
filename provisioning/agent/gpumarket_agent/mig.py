"""MIG devices: read from `nvidia-smi -L` (or a sim profile's `mig`), and the per-slice benchmark.

`nvidia-smi -L` on a card in MIG mode prints the card, then one line per MIG device:
    GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-5f1c...)
      MIG 3g.40gb     Device  0: (UUID: MIG-0a1b...)
A sim profile's `mig` ({"<gpu index>": [{"profile", "uuid", "compute_slices", "memory_mib"}]}, optionally
"reported_compute_slices": what its benchmark figures claim instead) says what is really configured; the
listing the sim prints from it (and a sim VM's nvidia-smi prints) goes through the same parser.
"""
import json
import os
import random
import re
import subprocess
import sys

from .core import AgentError, invalid, run
from .smi import load_profile, read_gpus

_GPU_LINE = re.compile(r"^GPU (\d+): (.+?) \(UUID: (GPU-[0-9A-Za-z-]+)\)\s*$")
_MIG_LINE = re.compile(r"^\s+MIG (\S+)\s+Device\s+(\d+): \(UUID: (MIG-[0-9A-Za-z/-]+)\)\s*$")
UUID_RE = re.compile(r"MIG-[0-9A-Za-z-]{8,60}")  # fullmatch: "$" let a trailing newline through
COMPUTE_SLICES, MEMORY_SLICES = 7, 8
MIG_LABEL_BASE = 64  # a MIG slice's label in gpu_indices: MIG_LABEL_BASE + its position in mig_uuids
SLICE_CHILD = "GPUMARKET_MIG_SLICE"  # set in the child that works on one MIG slice: that slice's UUID


def parse_mig_list(text):
    """[{"gpu", "device", "profile", "uuid"}] of every MIG device in `nvidia-smi -L` output (in its order)."""
    devices, gpu = [], None
    for line in text.splitlines():
        top = _GPU_LINE.match(line)
        if top:
            gpu = int(top.group(1))
            continue
        mig = _MIG_LINE.match(line)
        if mig and gpu is not None:
            devices.append({"gpu": gpu, "device": int(mig.group(2)), "profile": mig.group(1), "uuid": mig.group(3)})
    return devices


def sim_slices(profile):
    """The profile's configured slices, by GPU index: {index: [slice, ...]}."""
    return {int(k): list(v) for k, v in (profile.get("mig") or {}).items()}


def list_text(gpus, slices, only_uuids=None):
    """`nvidia-smi -L` as the sim prints it: every GPU with its slices; with `only_uuids`, only those slices
    under their cards (what a VM given those MIG devices sees)."""
    lines = []
    for g in gpus:
        mine = [s for s in slices.get(g["index"], []) if only_uuids is None or s["uuid"] in only_uuids]
        if only_uuids is not None and not mine:
            continue
        lines.append("GPU %d: %s (UUID: %s)" % (g["index"], g["name"], g["uuid"]))
        for n, s in enumerate(slices.get(g["index"], [])):
            if s in mine:
                lines.append("  MIG %-11s Device %2d: (UUID: %s)" % (s["profile"], n, s["uuid"]))
    return "\n".join(lines) + ("\n" if lines else "")


def read_mig(cfg, gpus):
    """The MIG devices the node has configured ([] when no card is in MIG mode)."""
    if cfg.runtime == "sim":
        return parse_mig_list(list_text(gpus, sim_slices(load_profile(cfg.sim_profile)[0])))
    if not any((g.get("mig_mode") or "") == "Enabled" for g in gpus):
        return []
    return parse_mig_list(run(["nvidia-smi", "-L"], timeout=30).stdout)


def validate_mig_uuids(value, field="mig_uuids"):
    if value is None:
        return None
    if not isinstance(value, list) or len(set(value)) != len(value) or not all(
            isinstance(u, str) and UUID_RE.fullmatch(u) for u in value):
        raise invalid(field, "%s must be a list of distinct MIG-... UUIDs" % field)
    return value


# ------------------------------------------------------------------------- a real slice's exchange, relayed

def in_slice_child(req):
    """Whether this process is the child relay_to_slice started for the request's one slice."""
    return bool(req.get("mig_uuids")) and os.environ.get(SLICE_CHILD) == req["mig_uuids"][0]


def relay_to_slice(req, lines, command, replied):
    """A real node's challenge or memory proof (`command`) of one MIG slice. A CUDA process sees at most one MIG
    device, so the work runs in a child agent started with CUDA_VISIBLE_DEVICES=<the slice's UUID> (an argument
    list and an environment, no shell), where the slice is device 0; this process relays the lines both ways:
    after each child line that carries `replied` (a commitment, a root), the platform's next line goes to the
    child. Returns the child's exit status; a child that ends without its last line is this command's error.
    The child's PyTorch start counts in the platform's time (not measured on a GPU yet: docs/ARCHITECTURE.md)."""
    uuid = req["mig_uuids"][0]
    if len(req["mig_uuids"]) != 1 or req["gpu_indices"] != [MIG_LABEL_BASE]:
        raise invalid("mig_uuids", "a real node's %s names one MIG slice at a time" % command)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=uuid, **{SLICE_CHILD: uuid})
    child = subprocess.Popen([sys.executable, sys.argv[0], command], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    last = None
    try:
        child.stdin.write(json.dumps({command: req}) + "\n")
        child.stdin.flush()
        for line in child.stdout:
            lines.outfile.write(line)
            lines.outfile.flush()
            try:
                message = json.loads(line)
            except ValueError:
                message = None
            if not isinstance(message, dict):
                continue
            if "ok" in message:
                last = message
                break
            if replied in message:
                child.stdin.write(lines.infile.readline())
                child.stdin.flush()
    except BrokenPipeError:  # the child died: said below, from its exit status
        pass
    finally:
        try:
            child.stdin.close()
        except BrokenPipeError:
            pass
    status = child.wait()
    if last is None:
        raise AgentError("%s_failed" % command, "the child working on MIG device %s ended (exit status %d) "
                         "before its last line" % (uuid, status))
    return status


# ---------------------------------------------------------------------------------------- the slice benchmark

def bench_slices(cfg, quick, uuids):
    """Each MIG slice measured on its own: its memory and throughput, in the shape of a GPU's figures plus
    `gpu`, `profile` and `uuid`. A slice the node does not have is an error."""
    gpus, _ = read_gpus(cfg)
    known = {d["uuid"]: d for d in read_mig(cfg, gpus)}
    missing = [u for u in uuids if u not in known]
    if missing:
        raise invalid("mig_uuids", "this node has no MIG device %s" % missing[0])
    if cfg.runtime == "sim":
        return _sim_slices(cfg, quick, [known[u] for u in uuids])
    return [_real_slice(quick, known[u]) for u in uuids]


def _sim_slices(cfg, quick, devices):
    """The card's figures scaled by the share of it each slice really is (its compute slices of 7 for
    throughput, its memory for bandwidth), with the benchmark's run-to-run noise."""
    profile, cards = load_profile(cfg.sim_profile)
    perf, configured = profile.get("performance") or {}, sim_slices(profile)
    specs, cards = {g["index"]: g for g in perf.get("gpus", [])}, {c["index"]: c for c in cards}
    rng = random.Random(os.urandom(16))  # noqa: S311 - noise, not secrets
    noisy = lambda v, d=3: round(v * (1 + max(-0.03, min(0.03, rng.gauss(0, 0.012)))), d)  # noqa: E731
    out = []
    for dev in devices:
        real = next(s for s in configured[dev["gpu"]] if s["uuid"] == dev["uuid"])
        spec, card = specs.get(dev["gpu"]) or {}, cards[dev["gpu"]]
        sheet = dict(perf.get("datasheet", {}), **spec.get("datasheet", {}))
        frac = spec.get("fraction") or {}
        # what the shim reports (`reported_compute_slices`, a dishonest profile) may not be what the slice has
        compute = real.get("reported_compute_slices", real["compute_slices"]) / COMPUTE_SLICES
        memory = real["memory_mib"] / float(card["memory_total_mib"] or 1)
        row = {"gpu": dev["gpu"], "device": dev["device"], "profile": dev["profile"], "uuid": dev["uuid"],
               "memory_mib": real["memory_mib"]}
        for name in ("bf16", "fp16", "tf32", "fp32"):
            row[name + "_tflops"] = noisy(sheet[name + "_tflops"] * frac.get(name, 0) * compute)
        row["memory_bandwidth_gbs"] = noisy(sheet["memory_bandwidth_gbs"] * frac.get("memory_bandwidth", 0)
                                            * min(1.0, memory * MEMORY_SLICES / 8), 2)
        row["matmul_rel_error"] = {"fp32": 2e-7, "bf16": 3e-3} if spec.get("matmul_correct", True) else \
            {"fp32": 0.25, "bf16": 0.3}
        out.append(row)
    return out


def _real_slice(quick, dev):
    """One slice on real hardware: the agent's own benchmark in a child process that sees only that MIG device
    (CUDA_VISIBLE_DEVICES=MIG-...), so PyTorch's device 0 is the slice."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=dev["uuid"])
    req = json.dumps({"quick": quick, "gpu_indices": [0]})
    try:
        done = subprocess.run([sys.executable, sys.argv[0], "benchmark"], input=req, capture_output=True, text=True,
                              env=env, timeout=900, check=False)
        answer = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired) as exc:
        raise AgentError("benchmark_failed", "MIG device %s: %s" % (dev["uuid"], exc)) from None
    if not answer.get("ok") or not answer.get("gpus"):
        raise AgentError("benchmark_failed", "MIG device %s: %s" % (dev["uuid"], answer.get("error")))
    gpu = answer["gpus"][0]
    keep = ("memory_mib", "bf16_tflops", "fp16_tflops", "tf32_tflops", "fp32_tflops", "memory_bandwidth_gbs",
            "matmul_rel_error")
    return dict({k: gpu.get(k) for k in keep}, gpu=dev["gpu"], device=dev["device"], profile=dev["profile"],
                uuid=dev["uuid"])
