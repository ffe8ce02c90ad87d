"""The challenge in the agent's real (PyTorch) path, on this machine's CPU (device "cpu"): matrices generated on
the device bit-identical to the platform's pure-Python entry(), a real-work challenge verified by the platform's
own check_gpu, a single flipped value caught, and the real-work draw's sizes. No GPU here: the same code runs on
cuda:N on a node (scripts/gpu-selfcheck)."""
import json
import os
import random
import struct
import threading
import time
from types import SimpleNamespace

import pytest

from provisioning.agent.gpumarket_agent import challenge as node
from provisioning.agent.gpumarket_agent import challenge_torch as node_torch
from provisioning.verification import challenge, challenge_rows, challenge_verdict
from provisioning.verification.model import DeclaredModel, load_catalogue
from tests.provisioning.test_challenge_agent import hear, say, start

torch = pytest.importorskip("torch")

CATALOGUE = load_catalogue()
REAL = SimpleNamespace(runtime="docker", sim_profile=None)
CPU = torch.device("cpu")


def test_generation_on_the_device_is_bit_identical_to_the_platforms_entries():
    rng = random.Random(11)
    edges = [0, 1, (1 << 20) - 1, (1 << 31) - 1]
    for _ in range(300):
        seed = rng.choice([0, (1 << 64) - 1, 1 << 63, rng.getrandbits(64)])
        key = challenge.matrix_key(seed, rng.randrange(64), rng.randrange(64), rng.choice("AB"))
        rows = edges + [rng.randrange(1 << 31) for _ in range(4)]
        cols = edges + [rng.randrange(1 << 31) for _ in range(4)]
        got = node_torch.torch_entries(torch, key, torch.tensor(rows).unsqueeze(1), torch.tensor(cols).unsqueeze(0))
        assert got.tolist() == [[challenge.entry(key, r, c) for c in cols] for r in rows], (seed, key)
    # whole matrices, in chunks that split rows unevenly
    key = challenge.matrix_key(rng.getrandbits(64), 3, 1, "B")
    old, node.GEN_CHUNK = node.GEN_CHUNK, 7 * 33
    try:
        generated = node_torch.generate(torch, CPU, key, 50, 33)
    finally:
        node.GEN_CHUNK = old
    assert generated.dtype == torch.bfloat16
    assert generated.float().tolist() == [[float(challenge.entry(key, r, c)) for c in range(33)] for r in range(50)]


def test_code_words_a_matrices_and_row_digests_on_the_device_are_the_platforms():
    rng = random.Random(12)
    for _ in range(20):
        seed, gpu = rng.getrandbits(64), rng.randrange(64)
        key = challenge.matrix_key(seed, gpu, 0, "A")
        code = node_torch.generate(torch, CPU, key, 9, 37, code=True)
        assert code.dtype == torch.int32
        assert [[v & challenge.M32 for v in row] for row in code.tolist()] == [
            [challenge.code_word(key, r, c) for c in range(37)] for r in range(9)]
        salt = challenge.product_salt(seed, gpu, rng.randrange(4096))
        assert node_torch.a_matrix(torch, code, salt).float().tolist() == [
            [float(challenge.a_entry(salt, challenge.code_word(key, r, c))) for c in range(37)] for r in range(9)]
        # rows of every sign and size a product can have, and the extremes of int32
        values = [[rng.randrange(-(1 << 23), 1 << 23) for _ in range(37)] for _ in range(8)]
        values.append([0, -1, 1, (1 << 31) - 1, -(1 << 31)] + [0] * 32)
        salts = challenge.column_salts(seed, gpu, 37)
        signed = torch.tensor([node_torch._signed32(s) for s in salts], dtype=torch.int32)
        got = node_torch.reduce_rows(torch, torch.tensor(values, dtype=torch.float64), signed,
                               torch.empty(9, dtype=torch.int64))
        assert got.tolist() == [challenge.row_digest(v, salts) for v in values]


def test_the_products_are_exactly_the_platforms():
    seed = random.Random(3).getrandbits(64)
    code = node_torch.generate(torch, CPU, challenge.matrix_key(seed, 1, 0, "A"), 64, 2048, code=True)
    a = node_torch.a_matrix(torch, code, challenge.product_salt(seed, 1, 2))
    b = node_torch.generate(torch, CPU, challenge.b_key(seed), 2048, 64)
    c, out_dtype = node_torch.multiply(torch, a, b)
    assert c.dtype == torch.float32 and out_dtype in ("fp32", "bf16")
    # Exactly: an fp32 output is the integer product, a bf16 one that integer rounded once to nearest even.
    rounding = (lambda v: v) if out_dtype == "fp32" else challenge.bf16_round
    rows = [0, 5, 63]
    for row, want in zip(rows, challenge_rows.expected_rows(seed, 2048, 64, [(1, 2, r) for r in rows]), strict=True):
        assert c[row].tolist() == [rounding(v) for v in want]


def pipes():
    a, b = os.pipe()
    c, d = os.pipe()
    return os.fdopen(b, "w"), os.fdopen(a), os.fdopen(d, "w"), os.fdopen(c)


class PipeExchange:
    def __init__(self, to_node, from_node):
        self.to_node, self.from_node, self.lines = to_node, from_node, []

    def send(self, message):
        self.to_node.write(json.dumps(message) + "\n")
        self.to_node.flush()
        return time.monotonic()

    def receive(self, timeout):
        line = self.from_node.readline()  # the agent always answers in these tests
        if not line:
            raise EOFError
        self.lines.append(json.loads(line))
        return line.encode(), time.monotonic()


def real_exchange(drawn, rng=None):
    to_node, node_in, node_out, from_node = pipes()
    status = []
    thread = threading.Thread(target=lambda: status.append(node.run_exchange(REAL, node_in, node_out)))
    thread.start()
    try:
        exchange = PipeExchange(to_node, from_node)
        out = challenge.run(exchange, drawn, 120, rng=rng)
        final = json.loads(from_node.readline())
    finally:
        to_node.close()
        thread.join(60)
    return out, final, status, exchange.lines


def tiny(gpus=(0, 1), seed=None):
    drawn = challenge.draw_real(0.05, 4096, list(gpus), quick=True, rng=random.Random(seed), device="cpu",
                                sizes=(512, 1024, 2))
    assert (drawn.n, drawn.k, drawn.products) == (512, 1024, 2)
    return drawn


def test_a_real_work_challenge_on_the_cpu_is_verified_by_the_platforms_own_check():
    drawn = tiny()
    started = time.monotonic()
    out, final, status, lines = real_exchange(drawn)
    took = time.monotonic() - started
    assert (final["ok"], status, out.problem) == (True, [0], "")
    for gpu in (0, 1):
        revealed = out.revealed[str(gpu)]
        assert challenge_verdict.check_gpu(drawn, gpu, out.commitments[gpu], out.picks[gpu], revealed,
                                           out.output_dtypes.get(gpu)) == ""
    commits = [m for m in lines if "commitment" in m]
    assert {m["output_dtype"] for m in commits} <= {"fp32", "bf16"}
    assert all(0 < m["node_compute_s"] <= m["node_elapsed_s"] for m in commits)
    print(f"\ntiny real-work challenge on this CPU: 2 x {drawn.products} products of {drawn.n}x{drawn.k} by "
          f"{drawn.k}x{drawn.n}, {drawn.flop_per_gpu:.3g} FLOP per 'GPU', {took:.2f} s for the whole exchange")


def test_one_flipped_value_on_one_gpu_is_caught(monkeypatch):
    drawn = tiny(gpus=(0,), seed=5)
    picks = challenge.pick_rows(drawn, random.Random(99))[0]  # the rows run() will ask for with the same rng
    product, row = picks[0]
    col = drawn.n // 3
    done = []

    def corrupt(torch_, a, b):
        c, out_dtype = real_multiply(torch_, a, b)
        if len(done) == product:
            c[row, col] = -c[row, col] - 3  # never the right value, whatever the rounding
        done.append(1)
        return c, out_dtype
    real_multiply = node_torch.multiply
    monkeypatch.setattr(node_torch, "multiply", corrupt)
    out, final, status, _ = real_exchange(drawn, rng=random.Random(99))
    assert final["ok"] is True and out.picks[0] == picks
    why = challenge_verdict.check_gpu(drawn, 0, out.commitments[0], out.picks[0], out.revealed["0"],
                                      out.output_dtypes.get(0))
    # the corrupted GEMM went into the row's digest on the device; the row recomputed at the reveal is right, so
    # it no longer matches what the GPU committed to
    assert why == f"row {row} of product {product} does not match what the GPU committed to"
    findings, figures = challenge_verdict.judge(DeclaredModel.from_catalogue(CATALOGUE["rtx-a4000"]), drawn, out)
    assert "challenge_wrong_result" in {f.code for f in findings} and figures["gpus"]["0"]["correct"] is False


def test_the_zipapp_answers_a_real_work_challenge_and_refuses_a_nominal_one(tmp_path):
    drawn = tiny(gpus=(0,))
    proc = start(tmp_path, runtime="docker")
    say(proc, {"challenge": drawn.request(60)})
    commit = hear(proc)
    assert commit["gpu"] == 0 and len(commit["commitment"]) == 64
    say(proc, {"reveal": {"0": [[1, 7]]}})
    line = hear(proc)
    assert line["gpu"] == 0
    revealed = line["revealed"]
    row, packed = revealed["rows"][0], bytes.fromhex(revealed["row_digests"]["1"])
    assert len(row["values"]) == drawn.n and len(packed) == 8 * drawn.n
    salts = challenge.column_salts(drawn.seed, 0, drawn.n)
    assert challenge.row_digest(row["values"], salts) == struct.unpack_from("<Q", packed, 8 * 7)[0]
    assert challenge.packed_digest(packed) == revealed["product_digests"][1]
    assert hear(proc)["ok"] is True and proc.wait(10) == 0
    # the nominal work of a sim node's challenge cannot be done for real
    nominal = challenge.draw(DeclaredModel.from_catalogue(CATALOGUE["rtx-a4000"]), [0], quick=True).request(60)
    proc = start(tmp_path, runtime="docker")
    say(proc, {"challenge": dict(nominal, device="cpu")})
    assert hear(proc)["error"]["code"] == "challenge_unsupported" and proc.wait(10) == 1


@pytest.mark.parametrize("changes, field", [({"n": 16385}, "n"), ({"products": 4097}, "products"),
                                            ({"n": 16384, "products": 4096}, "products"),
                                            ({"k": (1 << 20) + 1}, "k"), ({"device": "tpu"}, "device")])
def test_a_real_node_has_its_own_limits(changes, field):
    req = dict(tiny(gpus=(0,)).request(60), **changes)
    with pytest.raises(node.AgentError) as caught:
        node.validate_challenge(req, real=True)
    assert caught.value.field == field
    with pytest.raises(node.AgentError):  # a sim node keeps the small sizes
        node.validate_challenge(tiny(gpus=(0,)).request(60))


def test_the_real_work_draw_takes_the_target_time_on_every_card_in_the_catalogue():
    for slug, entry in CATALOGUE.items():
        declared = DeclaredModel.from_catalogue(entry)
        drawn = challenge.draw(declared, list(range(8)), quick=False, real_work=True)
        assert drawn.n % 256 == 0 and drawn.n >= 256 and drawn.k == 16384, slug
        assert drawn.flop_per_gpu == drawn.products * 2.0 * drawn.n ** 2 * drawn.k
        # the work takes the target at the datasheet, to within one product's rounding
        assert abs(drawn.target_s - 8.0) <= 8.0 / drawn.products / 2 + 1e-9, (slug, drawn.target_s)
        memory = (8 * drawn.n * drawn.k + 8 * drawn.n ** 2 + challenge.REAL_GENERATION_BYTES
                  + 8 * drawn.products * drawn.n)
        assert memory <= challenge.REAL_MEMORY_SHARE * declared.memory_mib * 2 ** 20, slug
        assert drawn.products * drawn.n <= challenge.REAL_MAX_DIGESTS
        node.validate_challenge(drawn.request(600), real=True)  # what the agent accepts
        # inside the 3-minute budget with the pings and the reveal (BENCHMARKS.md)
        floor = challenge.bf16_band(declared)["reject"]
        assert drawn.wait_s == pytest.approx(drawn.target_s / floor + drawn.products * drawn.n * 8 / 2.5e8 + 5)
        assert drawn.wait_s < 40, (slug, drawn.wait_s)
    # a slow card: one product at the target; a card with little memory: a smaller n, more products
    assert challenge.real_sizes(0.001, 65536, True)[3] == "target"
    n, _, products, bound = challenge.real_sizes(100.0, 6000, False)
    assert bound == "memory" and n % 256 == 0 and products > 1
    # a card faster than any in the catalogue: the row digests kept bound the products (and the target is missed)
    assert challenge.real_sizes(5000.0, 81920, False) == (16384, 16384, challenge.REAL_MAX_DIGESTS // 16384,
                                                          "products")


def test_gpu_selfcheck_runs_the_challenge_on_this_cpu_with_one_command(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu-selfcheck"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMARKET_")}
    proc = subprocess.run([sys.executable, str(script), "--device", "cpu", "--quick", "--json", str(tmp_path / "a")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "challenge: per GPU 2 products of 512x1024 by 1024x512 in BF16" in proc.stdout
    assert "not run" not in proc.stdout
    assert "memory proof: per GPU 16 blocks of 0.25 MiB" in proc.stdout and "openings right" in proc.stdout
    report = json.loads((tmp_path / "a").read_text())["challenge"]
    row = report["figures"]["gpus"]["0"]
    assert row["correct"] is True and row["bf16_tflops"] > 0 and row["platform_elapsed_s"] > 0
    assert [m["gpu"] for m in report["lines"] if "commitment" in m] == [0]
    proof = json.loads((tmp_path / "a").read_text())["memory_proof"]
    assert proof["gpus"]["0"]["correct"] and proof["verify_cpu_s"] > 0 and report["figures"]["verify_cpu_s"] > 0
    assert "the platform's check of the reveal: " in proc.stdout
    assert "the platform's check of the openings: " in proc.stdout
