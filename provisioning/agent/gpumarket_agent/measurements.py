"""The benchmark's measurements with PyTorch, imported in import_torch() only."""
import contextlib
import math
import os
import platform
import statistics
import sys
import time

from .core import AgentError, at_once
from .telemetry import Telemetry

MATMUL_DTYPES = ("bf16", "fp16", "tf32", "fp32")


def bench_plan(device, quick):
    """What is measured, how big and how often. GPU sizes follow gpus.md: 8192^3-class matmuls, >= 1 GiB copies."""
    if device == "cuda":
        return {"matmul_shapes": [[4096, 4096, 4096]] if quick else
                [[8192, 8192, 8192], [16384, 8192, 4096], [4096, 16384, 16384]],
                "repeats": 5 if quick else 10, "warmup": 2 if quick else 3, "warmup_s": 0.3 if quick else 2.0,
                "copy_bytes": 1 << 30, "host_copy_bytes": (64 if quick else 256) << 20,
                "cnn_batch": 512, "cnn_infer_batch": 2048, "check_n": 1024 if quick else 2048}
    # CPU: small enough for a few seconds (FP16 matmuls are slow on CPUs without native FP16).
    return {"matmul_shapes": [[256, 256, 256], [512, 256, 384]] if quick else [[1024, 1024, 1024], [1024, 512, 768]],
            "repeats": 3 if quick else 5, "warmup": 1 if quick else 2, "warmup_s": 0.0 if quick else 0.5,
            "copy_bytes": (32 if quick else 256) << 20, "host_copy_bytes": 0,
            "cnn_batch": 32 if quick else 64, "cnn_infer_batch": 128 if quick else 512,
            "check_n": 256 if quick else 512}


def import_torch():
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # so torch's cuda:N is nvidia-smi's GPU N
    os.environ.pop("NVIDIA_TF32_OVERRIDE", None)  # the benchmark switches TF32 on and off itself
    try:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torch
    except ImportError as exc:
        raise AgentError("no_torch", "the benchmark needs PyTorch, which %s on this node cannot import (%s); "
                         "install it with `%s -m pip install torch`" % (sys.executable, exc, sys.executable)) from None
    return torch


def median_seconds(torch, dev, fn, plan):
    """Median time of fn() over plan["repeats"] after plan["warmup"] calls: CUDA events on a GPU."""
    for _ in range(plan["warmup"]):
        fn()
    times = []
    for _ in range(plan["repeats"]):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return max(statistics.median(times), 1e-9)


def warm_up(torch, dev, plan):
    """Busy the GPU for plan["warmup_s"] so clocks and power reach their steady state before timing."""
    n = plan["matmul_shapes"][0][0]
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    end = time.monotonic() + plan["warmup_s"]
    while time.monotonic() < end:
        for _ in range(4):
            torch.matmul(a, a)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)


def figure(x):
    """A measured rate kept to 6 significant digits: a slow CPU's 0.0004 TFLOP/s stays 0.0004, not 0.0 (which the
    policy would read as no figure), and an H100's 812.345678 stays 812.346."""
    return float("%.6g" % x)


def matmul_tflops(torch, dev, name, plan):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name, torch.float32)

    def tflops(m, n, k):  # random operands (never zeros: some hardware is faster on zeros)
        a, b = torch.randn(m, k, device=dev, dtype=dtype), torch.randn(k, n, device=dev, dtype=dtype)
        c = torch.empty(m, n, device=dev, dtype=dtype)
        return figure(2.0 * m * n * k / median_seconds(torch, dev, lambda: torch.matmul(a, b, out=c), plan) / 1e12)
    return [tflops(*shape) for shape in plan["matmul_shapes"]]


def copy_gbs(torch, dev, plan):
    """Device memory bandwidth of a device-to-device copy, counting the bytes read and written."""
    n = plan["copy_bytes"]
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return figure(2 * n / median_seconds(torch, dev, lambda: dst.copy_(src), plan) / 1e9)


def host_link_gbs(torch, dev, plan):
    """Pinned host-to-device and device-to-host bandwidth (one GPU at a time: they may share the host's lanes)."""
    n = plan["host_copy_bytes"]
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True).fill_(7)
    on_dev = torch.empty(n, dtype=torch.uint8, device=dev)
    h2d = median_seconds(torch, dev, lambda: on_dev.copy_(host, non_blocking=True), plan)
    d2h = median_seconds(torch, dev, lambda: host.copy_(on_dev, non_blocking=True), plan)
    return figure(n / h2d / 1e9), figure(n / d2h / 1e9)


def small_cnn_images_s(torch, dev, plan):
    """Training-step and inference throughput of the source documents' CNN: two conv+pool, two linear, 28x28."""
    nn, F = torch.nn, torch.nn.functional
    model = nn.Sequential(nn.Conv2d(1, 20, 5), nn.ReLU(), nn.MaxPool2d(2, 2), nn.Conv2d(20, 50, 5), nn.ReLU(),
                          nn.MaxPool2d(2, 2), nn.Flatten(), nn.Linear(4 * 4 * 50, 500), nn.ReLU(), nn.Linear(500, 10),
                          nn.LogSoftmax(dim=1)).to(dev)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
    batch, infer_batch = plan["cnn_batch"], plan["cnn_infer_batch"]
    x, y = torch.randn(batch, 1, 28, 28, device=dev), torch.randint(0, 10, (batch,), device=dev)

    def step():
        optimizer.zero_grad(set_to_none=True)
        F.nll_loss(model(x), y).backward()
        optimizer.step()
    train = batch / median_seconds(torch, dev, step, plan)
    xi = torch.randn(infer_batch, 1, 28, 28, device=dev)
    with torch.inference_mode():
        infer = infer_batch / median_seconds(torch, dev, lambda: model(xi), plan)
    return figure(train), figure(infer)


def matmul_errors(torch, dev, plan):
    """Relative (Frobenius) error of FP32 and BF16 matmuls against FP64 on the same, rounded inputs."""
    n, errors = plan["check_n"], {}
    a64, b64 = torch.randn(n, n, device=dev, dtype=torch.float64), torch.randn(n, n, device=dev, dtype=torch.float64)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = a64.to(dtype), b64.to(dtype)
        ref = a.double() @ b.double()
        err = float(((a @ b).double() - ref).norm() / ref.norm())
        errors[name] = err if math.isfinite(err) else None  # NaN/inf: the card computes garbage
    return errors


def set_tf32(torch, matmul, cudnn):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn


def on_every_device(torch, devs, fn):
    """fn(dev) on all devices at once, a thread each; {index: result}. The first failure is raised."""
    def work(_, dev):
        if dev.type != "cuda":
            return fn(dev)
        with torch.cuda.device(dev):
            result = fn(dev)
            torch.cuda.synchronize(dev)
            return result
    return at_once(devs.items(), work, "benchmark_failed", what="device")


def describe_device(torch, dev):
    if dev.type == "cpu":
        model = None
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
        return {"name": model or platform.processor() or "cpu", "uuid": None, "memory_mib": None, "sm_count": None}
    props = torch.cuda.get_device_properties(dev)
    uuid = str(getattr(props, "uuid", "") or "")
    return {"name": props.name, "uuid": uuid if not uuid or uuid.startswith("GPU-") else "GPU-" + uuid,
            "memory_mib": props.total_memory >> 20, "sm_count": props.multi_processor_count}


def measure(device, quick, indices, deadline):
    torch = import_torch()
    plan = bench_plan(device, quick)
    if device == "cuda":
        if not torch.cuda.is_available():
            raise AgentError("no_cuda", "PyTorch %s (built for CUDA %s) sees no GPU on this node" % (
                torch.__version__, torch.version.cuda))
        count = torch.cuda.device_count()
        indices = list(range(count)) if indices is None else indices
        if any(i >= count for i in indices):
            raise AgentError("gpu_mismatch", "PyTorch sees %d GPU(s), nvidia-smi more: GPU %d is hidden from CUDA "
                             "(CUDA_VISIBLE_DEVICES, MIG, a driver fault?)" % (count, max(indices)))
        devs = {i: torch.device("cuda", i) for i in indices}
    else:
        devs = {0: torch.device("cpu")}
    gpus = {i: dict(index=i, **describe_device(torch, dev)) for i, dev in devs.items()}
    telemetry = Telemetry(sorted(devs)) if device == "cuda" and devs else None
    if telemetry:
        telemetry.start()

    def phase(name, fn, tf32=False, cudnn_tf32=False, only=None):
        deadline.check(name)
        if telemetry:
            telemetry.phase = name
        set_tf32(torch, tf32, cudnn_tf32 or tf32)
        return on_every_device(torch, only or devs, fn)
    try:
        if plan["warmup_s"]:
            phase("warmup", lambda dev: warm_up(torch, dev, plan))
        for name in MATMUL_DTYPES:
            tf32 = name == "tf32"
            for i, figures in phase(name, lambda dev, n=name: matmul_tflops(torch, dev, n, plan), tf32).items():
                gpus[i].setdefault("matmul_shapes_tflops", {})[name] = figures
                gpus[i][name + "_tflops"] = max(figures)
        for i, gbs in phase("copy", lambda dev: copy_gbs(torch, dev, plan)).items():
            gpus[i]["memory_bandwidth_gbs"] = gbs
        for i, dev in devs.items():  # one GPU at a time: GPUs may share the host's PCIe lanes
            link = (None, None)
            if plan["host_copy_bytes"]:
                link = phase("host", lambda d: host_link_gbs(torch, d, plan), only={i: dev})[i]
            gpus[i]["h2d_gbs"], gpus[i]["d2h_gbs"] = link
        # The CNN runs as a renter's script would: PyTorch's defaults (TF32 for convolutions, not for matmuls).
        cnn = phase("cnn", lambda dev: small_cnn_images_s(torch, dev, plan), cudnn_tf32=True)
        for i, (train, infer) in cnn.items():
            gpus[i]["cnn_train_images_s"], gpus[i]["cnn_infer_images_s"] = train, infer
        for i, errors in phase("check", lambda dev: matmul_errors(torch, dev, plan)).items():
            gpus[i]["matmul_rel_error"] = errors
        deadline.check("the end")
    finally:
        set_tf32(torch, False, True)  # PyTorch's defaults again
        if telemetry:
            telemetry.stop()
    for i in gpus:
        gpus[i]["telemetry"] = telemetry.summary(i) if telemetry else None
    return {"mode": "measured", "device": device, "quick": quick, "plan": plan, "torch_version": torch.__version__,
            "cuda_runtime": torch.version.cuda, "gpus": [gpus[i] for i in sorted(gpus)]}
