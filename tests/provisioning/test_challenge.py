"""The platform's challenge (provisioning/verification/challenge.py), pure: the same numbers as the agent's, a
single wrong entry caught, the timing arithmetic, and every way a node can answer badly. No SSH, no database:
the agent's side runs in a thread on pipes (test_benchmark_verification.py goes over SSH)."""
import json
import os
import random
import threading
import time
from types import SimpleNamespace

import pytest

from provisioning.agent import gpumarket_agent as agent
from provisioning.agent.gpumarket_agent import challenge as node
from provisioning.verification import challenge, challenge_rows, challenge_verdict
from provisioning.verification.model import DeclaredModel, load_catalogue
from provisioning.verification.profiles import PROFILES_DIR, simulated_challenge

CATALOGUE = load_catalogue()
A100 = DeclaredModel.from_catalogue(CATALOGUE["a100-80gb-sxm"])
A4000 = DeclaredModel.from_catalogue(CATALOGUE["rtx-a4000"])


def codes(findings):
    return sorted({(f.code, f.severity, f.gpu_index) for f in findings})


# ----------------------------------------------------------------------------- the same numbers on both sides

def test_the_platform_and_the_agent_generate_the_same_matrices_and_products():
    rng = random.Random(7)
    for _ in range(5):
        seed, gpu, product = rng.getrandbits(64), rng.randrange(8), rng.randrange(4)
        for matrix in ("A", "B"):
            assert node.matrix_key(seed, gpu, product, matrix) == challenge.matrix_key(seed, gpu, product, matrix)
        assert node.b_key(seed) == challenge.b_key(seed)  # one B per challenge, on both sides
        rows = node.product_rows(seed, gpu, product, 6, 9)
        assert rows == [[challenge.expected_entry(seed, gpu, product, 9, r, c) for c in range(6)] for r in range(6)]
        assert rows == challenge_rows.expected_rows(seed, 9, 6, [(gpu, product, r) for r in range(6)])
        salts = node.column_salts(seed, gpu, 6)
        assert salts == challenge.column_salts(seed, gpu, 6)
        assert [node.row_digest(r, salts) for r in rows] == [challenge.row_digest(r, salts) for r in rows]
        assert node.joined_digest(["ab", "cd"]) == challenge.joined_digest(["ab", "cd"])
        assert node.product_salt(seed, gpu, product) == challenge.product_salt(seed, gpu, product)


def test_the_row_digest_is_not_linear_in_the_row():
    """A weighted sum would let a node commit to A (B w) without the product: the digest of a sum of rows is not
    the sum of their digests, and one entry changed by one changes it."""
    salts = challenge.column_salts(5, 0, 8)
    x, y = [3, -1, 4, 1, -5, 9, 2, -6], [2, 7, -1, 8, 2, -8, 1, 8]
    both = [a + b for a, b in zip(x, y, strict=True)]
    assert challenge.row_digest(both, salts) != (challenge.row_digest(x, salts) + challenge.row_digest(y, salts))
    assert challenge.row_digest([*x[:-1], x[-1] + 1], salts) != challenge.row_digest(x, salts)
    assert challenge.row_digest([2 * v for v in x], salts) != 2 * challenge.row_digest(x, salts)


def test_entries_are_small_integers_spread_over_the_range_and_differ_by_seed_gpu_and_product():
    key = challenge.matrix_key(1, 0, 0, "A")
    values = [challenge.entry(key, r, c) for r in range(40) for c in range(40)]
    counts = {v: values.count(v) for v in range(-2, 3)}
    assert set(values) == set(counts) and all(250 < n < 390 for n in counts.values()), counts
    others = [challenge.matrix_key(2, 0, 0, "A"), challenge.matrix_key(1, 1, 0, "A"),
              challenge.matrix_key(1, 0, 1, "A"), challenge.matrix_key(1, 0, 0, "B")]
    assert len({key, *others}) == 5
    # exact in FP32 accumulation at every size the platform asks for: |sum| <= 4k < 2**24
    assert 4 * max(s["k"] for s in challenge.SIZES.values()) < 2 ** 24


def test_the_draw_is_secret_and_sized_from_the_claimed_cards_datasheet():
    a, b = challenge.draw(A100, [0, 1], quick=True), challenge.draw(A100, [0, 1], quick=True)
    assert a.seed != b.seed and 0 <= a.seed < 2 ** 64
    assert a.flop_per_gpu == pytest.approx(challenge.SIZES[True]["target_s"] * 312e12)
    assert challenge.draw(A4000, [0], quick=True).flop_per_gpu == pytest.approx(1.5 * 76.7e12)
    full = challenge.draw(A100, [0], quick=False)
    assert (full.n, full.target_s) == (challenge.SIZES[False]["n"], challenge.SIZES[False]["target_s"])
    # the slowest card still accepted (the reject floor) answers within the wait, with the grace to spare
    assert a.wait_s == pytest.approx(a.target_s / 0.45 + challenge.GRACE_S)
    assert node.validate_challenge(a.request(300))["gpu_indices"] == [0, 1]  # what the agent accepts


# ------------------------------------------------------------------------------------------- correctness

def honest_outcome(declared, drawn, profile="a100-80gb-sxm-x4", seconds_per_gpu=None):
    """What an honest node sends, built with the agent's own sim code; arrivals at the claimed card's 85 %."""
    req = node.validate_challenge(drawn.request(300))
    results, _, _ = node.sim_work(SimpleNamespace(sim_profile=str(PROFILES_DIR / f"{profile}.json")), req)
    out = challenge.Outcome(round_trip_s=0.01, sent_at=100.0)
    for gpu in drawn.gpu_indices:
        taken = (seconds_per_gpu or {}).get(gpu, drawn.target_s / 0.85)
        out.arrivals[gpu] = 100.0 + 0.01 + taken
        out.commitments[gpu] = results[gpu].commitment()
    out.picks = challenge.pick_rows(drawn, random.Random(3))
    out.revealed = node.reveal_rows(challenge.reveal_request(out.picks)["reveal"], results)
    return out, results


def test_an_honest_answer_passes_and_its_figures_are_the_platforms():
    drawn = challenge.draw(A100, [0, 1, 2, 3], quick=True)
    out, _ = honest_outcome(A100, drawn)
    out.node_elapsed_s = {0: 0.001}  # whatever the node says about its own speed is detail only
    findings, figures = challenge_verdict.judge(A100, drawn, out)
    assert findings == []
    row = figures["gpus"]["0"]
    assert row["of_datasheet"] == pytest.approx(0.85, abs=1e-3) and row["correct"] is True
    assert row["node_elapsed_s"] == 0.001 and row["platform_elapsed_s"] == pytest.approx(1.5 / 0.85, abs=1e-3)


def off_by(drawn, gpu, work, product, row, col, delta):
    """A node that commits to its wrong product consistently: one entry off by `delta`, its digests recomputed."""
    rows_of = [work.rows(p, list(range(drawn.n))) for p in range(drawn.products)]
    rows_of[product][row][col] += delta
    salts = node.column_salts(drawn.seed, gpu, drawn.n)
    packed = [node.packed_digests([node.row_digest(r, salts) for r in rows]) for rows in rows_of]
    return node.Work(packed, lambda p, picked: [rows_of[p][r] for r in picked])


def test_a_single_wrong_entry_on_one_gpu_of_eight_is_caught():
    drawn = challenge.draw(A100, list(range(8)), quick=True)
    out, results = honest_outcome(A100, drawn, profile="a100-80gb-sxm-x8-one-slow")
    gpu, (product, row), col = 6, out.picks[6][2], drawn.n - 3  # any column: each revealed row is checked whole
    results[gpu] = off_by(drawn, gpu, results[gpu], product, row, col, 1)
    out.commitments[gpu] = results[gpu].commitment()
    out.revealed = node.reveal_rows(challenge.reveal_request(out.picks)["reveal"], results)
    findings, figures = challenge_verdict.judge(A100, drawn, out)
    assert codes(findings) == [("challenge_wrong_result", "reject", 6)]
    assert f"entry ({row}, {col}) of product {product}" in findings[0].message
    assert [figures["gpus"][str(g)]["correct"] for g in range(8)] == [g != 6 for g in range(8)]


@pytest.mark.parametrize("tamper, reason", [
    (lambda rev, out: rev["0"]["rows"][0]["values"].__setitem__(0, 999), "does not match what the GPU committed"),
    (lambda rev, out: rev["0"]["product_digests"].reverse(), "product digests do not match its commitment"),
    (lambda rev, out: out.commitments.__setitem__(0, "0" * 64), "product digests do not match its commitment"),
    (lambda rev, out: rev["0"]["rows"].pop(), "was not revealed"),
    (lambda rev, out: rev["0"]["rows"][0].__setitem__("values", ["x"]), "is not 16 integers"),
    (lambda rev, out: rev["0"]["rows"][0]["values"].__setitem__(1, 0.5), "is not 16 integers"),
    (lambda rev, out: rev["0"].pop("row_digests"), "no row digests"),
    (lambda rev, out: rev["0"]["row_digests"].update({k: "zz" for k in rev["0"]["row_digests"]}),
     "does not match what the GPU committed"),
    (lambda rev, out: rev["0"]["row_digests"].update({k: v[16:] + v[:16] for k, v in rev["0"]["row_digests"].items()}),
     "does not match what the GPU committed"),
    (lambda rev, out: rev.pop("0"), "no revealed rows"),
    (lambda rev, out: rev["0"]["rows"][0].__setitem__("product", [0]), "was not revealed"),
    (lambda rev, out: rev["0"].__setitem__("rows", "all"), "no revealed rows"),
])
def test_revealed_rows_that_do_not_prove_the_commitment_are_wrong_results(tamper, reason):
    drawn = challenge.draw(A100, [0, 1], quick=True)
    out, _ = honest_outcome(A100, drawn)
    tamper(out.revealed, out)
    findings, _ = challenge_verdict.judge(A100, drawn, out)
    assert codes(findings) == [("challenge_wrong_result", "reject", 0)]
    assert reason in findings[0].message


def test_a_bf16_output_is_the_exact_product_rounded_once_to_nearest_even_and_nothing_else():
    """Entries large enough for BF16 to round them (|C| >= 256 needs k in the thousands). A GPU whose commitment
    said bf16 must give every entry rounded once to nearest even: not the exact value, not a neighbouring BF16
    value (each such freedom would let a node steer a row's digest), and an fp32 GPU not the rounded one."""
    drawn = challenge.draw_real(312.0, 81920, [0], quick=True, rng=random.Random(4), sizes=(8, 8192, 1))
    rows = node.product_rows(drawn.seed, 0, 0, drawn.n, drawn.k)
    _, row, col = max((abs(v), r, c) for r, vals in enumerate(rows) for c, v in enumerate(vals)
                      if challenge.bf16_round(v) != v)
    rounded = [[challenge.bf16_round(v) for v in vals] for vals in rows]
    assert rounded != rows

    def answer(values_of, dtype):
        salts = node.column_salts(drawn.seed, 0, drawn.n)
        work = node.Work([node.packed_digests([node.row_digest(r, salts) for r in values_of])],
                         lambda p, picked: [values_of[r] for r in picked])
        picks = [(0, row)]
        revealed = node.reveal_rows(challenge.reveal_request({0: picks})["reveal"], {0: work})["0"]
        return challenge_verdict.check_gpu(drawn, 0, work.commitment(), picks, revealed, dtype)

    assert answer(rows, "fp32") == answer(rows, None) == answer(rounded, "bf16") == ""

    def but(values_of, value):  # the same rows with (row, col) set to `value`
        changed = [list(r) for r in values_of]
        changed[row][col] = value
        return changed

    where = f"entry ({row}, {col}) of product 0 is "
    assert where in answer(but(rounded, rows[row][col]), "bf16")  # one entry unrounded where bf16 was said
    assert where in answer(but(rows, rounded[row][col]), "fp32")  # one entry rounded where fp32 was
    assert answer(rows, "bf16").startswith("entry (")
    ulp = 1 << max(0, abs(rounded[row][col]).bit_length() - 8)
    # the next BF16 value up: within the 2^-8 of the value once allowed, and a freedom to steer the digest with
    assert where in answer(but(rounded, rounded[row][col] + ulp), "bf16")
    assert "output dtype 'fp16'" in answer(rounded, "fp16")


# ------------------------------------------------------------------------------------------------ timing

@pytest.mark.parametrize("share, expected", [
    (0.86, []),
    (1.3, [("challenge_too_fast", "reject")]),
    (0.60, [("challenge_too_slow", "degrade")]),
    (0.36, [("challenge_too_slow", "reject")]),
])
def test_throughput_is_the_platforms_work_over_its_own_clock_minus_the_round_trip(share, expected):
    drawn = challenge.draw(A100, [0, 1], quick=True)
    out, _ = honest_outcome(A100, drawn, seconds_per_gpu={0: drawn.target_s / share, 1: drawn.target_s / share})
    out.round_trip_s = 0.2  # a slow link: subtracted, so it does not count against the card
    for gpu in out.arrivals:
        out.arrivals[gpu] += 0.19
    findings, figures = challenge_verdict.judge(A100, drawn, out)
    assert sorted({(f.code, f.severity) for f in findings}) == expected
    assert figures["gpus"]["1"]["of_datasheet"] == pytest.approx(share, abs=1e-3)
    assert figures["round_trip_s"] == 0.2


def test_one_gpu_slower_than_the_rest_of_its_node_is_an_outlier():
    drawn = challenge.draw(A100, list(range(8)), quick=True)
    slow = {g: drawn.target_s / (0.74 if g == 5 else 0.86) for g in range(8)}
    out = honest_outcome(A100, drawn, "a100-80gb-sxm-x8-one-slow", slow)[0]
    findings, _ = challenge_verdict.judge(A100, drawn, out)
    assert codes(findings) == [("challenge_outlier", "degrade", 5)]


# ----------------------------------------------------------------------------- bad answers over an exchange

class FakeExchange:
    """Replays scripted lines (bytes, None for a timeout, EOFError for a closed output); records what was sent."""

    def __init__(self, *lines):
        self.lines, self.sent, self.timeouts = list(lines), [], []

    def send(self, message):
        self.sent.append(message)
        return time.monotonic()

    def receive(self, timeout):
        self.timeouts.append(timeout)
        if not self.lines:
            raise EOFError
        line = self.lines.pop(0)
        if line is EOFError:
            raise EOFError
        return line, time.monotonic()


PONGS = [b'{"pong": 0}', b'{"pong": 1}', b'{"pong": 2}']


@pytest.mark.parametrize("lines, reason", [
    ([b"\x00garbage"], "answered with garbage"),
    ([*PONGS, b"[1, 2]"], "answered with garbage"),
    ([*PONGS, b'{"gpu": 7, "commitment": "ab"}'], "other than a commitment of a challenged GPU"),
    ([*PONGS, b'{"gpu": [0], "commitment": "ab"}'], "other than a commitment of a challenged GPU"),
    ([*PONGS, b'{"gpu": true, "commitment": "ab"}'], "other than a commitment of a challenged GPU"),
    ([*PONGS, None], "sent no commitment within"),
    ([None], "did not answer a ping"),
    ([*PONGS, EOFError], "closed the exchange"),
    ([*PONGS, b'{"ok": false, "error": {"code": "internal_error", "message": "boom"}}'], "stopped with an error: boom"),
])
def test_a_node_that_answers_badly_gets_a_finding_with_the_reason(lines, reason):
    drawn = challenge.draw(A4000, [0, 1], quick=True)
    out = challenge.run(FakeExchange(*lines), drawn, 300)
    findings, _ = challenge_verdict.judge(A4000, drawn, out)
    assert codes(findings) == [("challenge_no_answer", "reject", 0), ("challenge_no_answer", "reject", 1)]
    assert reason in findings[0].message and "verify again" in findings[0].message


def test_commitments_without_the_revealed_rows_are_wrong_results():
    drawn = challenge.draw(A4000, [0], quick=True)
    exchange = FakeExchange(*PONGS, b'{"gpu": 0, "commitment": "ab", "node_elapsed_s": 1}', b'{"nope": 1}')
    findings, _ = challenge_verdict.judge(A4000, drawn, challenge.run(exchange, drawn, 300))
    assert {f.code for f in findings} >= {"challenge_wrong_result"}
    assert "reveal" in exchange.sent[-1]  # the rows were asked for only after the commitment


def test_revealed_rows_come_a_line_per_gpu_each_of_a_challenged_gpu():
    drawn = challenge.draw(A4000, [0, 1], quick=True)
    commits = [b'{"gpu": 0, "commitment": "ab"}', b'{"gpu": 1, "commitment": "cd"}']
    for lines, why in (([b'{"gpu": 0, "revealed": {}}', None], "sent no revealed rows"),
                       ([b'{"gpu": 0, "revealed": {}}', b'{"gpu": 0, "revealed": {}}'], "of a challenged GPU"),
                       ([b'{"gpu": 2, "revealed": {}}'], "of a challenged GPU"),
                       ([b'{"revealed": {"0": {}, "1": {}}}'], "of a challenged GPU")):
        out = challenge.run(FakeExchange(*PONGS, *commits, *lines), drawn, 300)
        assert why in out.problem, (lines, out.problem)
        findings, _ = challenge_verdict.judge(A4000, drawn, out)
        assert {(f.code, f.gpu_index) for f in findings} >= {("challenge_wrong_result", 1)}


def test_one_gpus_reveal_at_real_sizes_fits_a_line_and_eight_in_one_would_not():
    """The largest reveal a real-work challenge asks for (n = 16384, the most products n allows, entries at their
    largest magnitude): one GPU's line is well under the SSH exchange's 8 MiB; eight in one line, as the agent
    once sent them, would not be read at all."""
    from provisioning.ssh_channels import MAX_ANSWER_BYTES
    n = challenge.REAL_SIZES[False]["n_max"]
    products = challenge.REAL_MAX_DIGESTS // n
    packed = bytes(8 * n)
    work = node.Work([packed] * products, lambda p, picked: [[-8 * 16384] * n for _ in picked])
    picks = {0: [[p, 7] for p in range(challenge.REVEAL_ROWS)]}  # each row of its own product: most row digests
    line = json.dumps({"gpu": 0, "revealed": node.reveal_rows(picks, {0: work})["0"]})
    assert len(line) < MAX_ANSWER_BYTES / 2 < 8 * len(line), len(line)
    drawn = challenge.draw_real(989.0, 81559, list(range(8)), False, sizes=(n, 16384, products))
    assert 8 * len(line) <= challenge.reveal_bytes(drawn) < 8 * 2 * len(line)  # the bound the reveal's wait uses


def test_the_reveals_wait_grows_with_its_bytes_at_the_stated_floor():
    """The revealed rows of eight real-size GPUs are ~12 MB: the platform waits for them at ANSWER_FLOOR_BPS
    (10 Mbit/s of the node's uplink), not within a fixed 10 s; a small sim reveal keeps about the 10 s."""
    for drawn, least, most in ((challenge.draw(A4000, [0], quick=True), 10, 11),
                               (challenge.draw(A100, list(range(8)), quick=False, real_work=True), 15, 60)):
        commits = [json.dumps({"gpu": g, "commitment": "ab"}).encode() for g in drawn.gpu_indices]
        exchange = FakeExchange(*PONGS, *commits, None)
        out = challenge.run(exchange, drawn, 300)
        wait = challenge.answer_wait_s(challenge.reveal_bytes(drawn))
        assert exchange.timeouts[-1] == pytest.approx(wait, abs=0.5) and least <= wait <= most, wait
        assert out.problem == f"sent no revealed rows within {wait:.0f} s"


def test_an_agent_that_cannot_run_the_challenge_gets_no_pass():
    """A real node is judged on the real-work challenge now (GPU-side digests): an agent that cannot run it has
    not answered, whatever its reason, and the reason reaches the provider."""
    drawn = challenge.draw(A4000, [0], quick=True, real_work=True)
    for code in ("challenge_unsupported", "no_cuda", "internal_error"):
        error = b'{"ok": false, "error": {"code": "%s", "message": "no CUDA path"}}' % code.encode()
        out = challenge.run(FakeExchange(*PONGS, error), drawn, 300)
        findings, figures = challenge_verdict.judge(A4000, drawn, out)
        assert {f.code for f in findings} == {"challenge_no_answer"} and "not_run" not in figures
        assert "no CUDA path" in findings[0].message


# ------------------------------------------------------------------------- the real exchange, on pipes

class PipeExchange:
    def __init__(self, to_node, from_node):
        self.to_node, self.from_node = to_node, from_node

    def send(self, message):
        self.to_node.write(json.dumps(message) + "\n")
        self.to_node.flush()
        return time.monotonic()

    def receive(self, timeout):
        line = self.from_node.readline()  # the agent always answers in these tests
        if not line:
            raise EOFError
        return line.encode(), time.monotonic()


def exchange_with_agent(profile, declared, gpus):
    a, b = os.pipe()
    c, d = os.pipe()
    to_node, node_in = os.fdopen(b, "w"), os.fdopen(a)
    node_out, from_node = os.fdopen(d, "w"), os.fdopen(c)
    cfg = SimpleNamespace(runtime="sim", sim_profile=str(PROFILES_DIR / f"{profile}.json"))
    status = []
    thread = threading.Thread(target=lambda: status.append(node.run_exchange(cfg, node_in, node_out)))
    thread.start()
    try:
        drawn = challenge.draw(declared, gpus, quick=True)
        out = challenge.run(PipeExchange(to_node, from_node), drawn, 300)
        final = json.loads(from_node.readline())
    finally:
        to_node.close()
        thread.join(30)
    return drawn, out, final, status


def test_the_platform_and_the_sim_agent_complete_the_exchange_and_the_sim_takes_its_real_cards_time():
    drawn, out, final, status = exchange_with_agent("a6000-posing-as-a100-x2-faked-figures", A100, [0, 1])
    assert (final["ok"], status) == (True, [0])
    findings, figures = challenge_verdict.judge(A100, drawn, out)
    assert codes(findings) == [("challenge_too_slow", "reject", 0), ("challenge_too_slow", "reject", 1)]
    # an RTX A6000 at ~72 % of its 154.8 TFLOP/s, however the node reports itself: ~36 % of an A100
    assert all(0.33 < figures["gpus"][g]["of_datasheet"] < 0.38 for g in ("0", "1")), figures
    assert all(figures["gpus"][g]["correct"] for g in ("0", "1"))


def test_the_in_process_profile_check_agrees_with_the_exchange():
    found, figures = simulated_challenge(PROFILES_DIR / "rtx-a4000-x2-bad-matmul-hidden.json", A4000, [0, 1])
    assert codes(found) == [("challenge_wrong_result", "reject", 0)]
    # the shim's own check says all is well
    bench = agent.sim_benchmark(SimpleNamespace(sim_profile=str(PROFILES_DIR / "rtx-a4000-x2-bad-matmul-hidden.json")),
                                True, None)
    assert bench["gpus"][0]["matmul_rel_error"]["bf16"] < 1e-2


def test_throughput_figures_keep_their_digits_below_one():
    """A loaded CPU's 0.0004 TFLOP/s (scripts/gpu-selfcheck --device cpu) is printed as such, not as 0.0."""
    _figure = challenge_verdict._figure
    assert _figure(0.000412345) == 0.000412 and _figure(0.5) == 0.5
    assert _figure(312.51234) == 312.512 and _figure(1.0004) == 1.0


@pytest.mark.parametrize(("values", "ok"), [
    ([0, -3, 2 ** 31 - 1, -(2 ** 31 - 1)], True),
    ([0, 1.0, -2.0, 5], True),  # integral floats, as JSON may carry them
    ([0, 1, 2], False),  # not n of them
    ([0, 1, 2, True], False),  # a bool is not a number here
    ([0, 1, 2, "3"], False),
    ([0, 1, 2, 0.5], False),
    ([0, 1, 2, float("nan")], False),
    ([0, 1, 2, float("inf")], False),
    ([0, 1, 2, 2 ** 31], False),  # past int32, which the row digest packs
    ([0, 1, 2, 10 ** 400], False),  # past float64 itself
    ([0, 1, 2, None], False),
    ("0123", False),
])
def test_a_revealed_row_is_n_integers_of_int32(values, ok):
    assert challenge_verdict._integers(values, 4) is ok
