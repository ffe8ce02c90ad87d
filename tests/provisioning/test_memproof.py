"""The memory proof (provisioning/verification/memproof.py and the agent's memproof.py): the same fill and
digests on both sides, a Merkle path for every leaf, an honest sim node passing over pipes, a 40 GB card
claiming 80 GB caught late (its rest in host RAM) or caught by the openings (made-up digests), and every way a
node can answer badly ending in a finding with a reason. The end-to-end run over SSH is in
test_benchmark_verification.py (every profile's expected verdict)."""
import hashlib
import json
import os
import random
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from provisioning.agent.gpumarket_agent import memproof as node
from provisioning.agent.gpumarket_agent import memproof_torch as node_torch
from provisioning.agent.gpumarket_agent import recompute
from provisioning.verification import memproof, memproof_verdict
from provisioning.verification.model import DeclaredModel, load_catalogue
from provisioning.verification.profiles import PROFILES_DIR

CATALOGUE = load_catalogue()
A100 = DeclaredModel.from_catalogue(CATALOGUE["a100-80gb-sxm"])
PONGS = [b'{"pong": 0}', b'{"pong": 1}', b'{"pong": 2}']


def codes(findings):
    return sorted({(f.code, f.severity, f.gpu_index) for f in findings})


def test_both_sides_have_the_same_fill_and_digests():
    rng = random.Random(2)
    for _ in range(3):
        seed, gpu, size = rng.getrandbits(64), rng.randrange(8), 48
        assert node.block_zero(seed, gpu, size) == memproof.block_zero(seed, gpu, size)
        for i in range(1, 6):
            assert node.links(seed, gpu, i, size) == memproof.links(seed, gpu, i, size)
            refs, _ = node.links(seed, gpu, i, size)
            assert len(refs) == memproof.REFS == node.REFS and all(0 <= p < i and 0 <= r < size for p, r in refs)
        blocks = node.fill(seed, gpu, 6, size)
        for i in range(1, 6):
            refs, salt = memproof.links(seed, gpu, i, size)
            assert blocks[i] == [memproof.g_word(blocks[i - 1][j], [blocks[p][(j + r) % size] for p, r in refs], salt)
                                 for j in range(size)]
        salts = memproof.position_salts(seed, 16)
        assert node.position_salts(seed, 16) == salts
        assert node.chunk_digest(blocks[3][:16], salts) == memproof.chunk_digest(blocks[3][:16], salts)


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 13])
def test_every_leafs_merkle_path_leads_to_the_root_and_nothing_else_does(count):
    leaves = [hashlib.sha256(bytes([i])).digest() for i in range(count)]
    levels = node.merkle_levels(leaves)
    root = levels[-1][0].hex()
    for i, leaf in enumerate(leaves):
        path = node.merkle_path(levels, i)
        assert memproof.merkle_verify(leaf, i, count, path, root)
        assert not memproof.merkle_verify(hashlib.sha256(b"x").digest(), i, count, path, root)
        assert not memproof.merkle_verify(leaf, i, count, [*path, "00" * 32], root)
        if count > 1:
            assert not memproof.merkle_verify(leaf, (i + 1) % count, count, path, root) or leaves[i] == leaves[
                (i + 1) % count]
    assert not memproof.merkle_verify(leaves[0], 0, count, ["zz"], root)
    assert not memproof.merkle_verify(leaves[0], 0, count, "path", root)


def test_a_block_depends_on_whole_earlier_blocks_not_on_one_position():
    """The rotation: changing one word of block 0 changes words of later blocks at other positions."""
    seed, size = 99, 64
    blocks = node.fill(seed, 0, 12, size)
    changed = [b[:] for b in blocks[:1]]
    changed[0][5] ^= 1
    for i in range(1, 12):
        refs, salt = node.links(seed, 0, i, size)
        changed.append([node.g_word(changed[i - 1][j], [changed[p][(j + r) % size] for p, r in refs], salt)
                        for j in range(size)])
    differ = {j for j in range(size) if changed[11][j] != blocks[11][j]}
    assert len(differ) > 1 and differ != {5}


# ------------------------------------------------------------------------------- the exchange, on pipes

class PipeExchange:
    def __init__(self, to_node, from_node):
        self.to_node, self.from_node = to_node, from_node

    def send(self, message):
        self.to_node.write(json.dumps(message) + "\n")
        self.to_node.flush()
        return time.monotonic()

    def receive(self, timeout):
        line = self.from_node.readline()
        if not line:
            raise EOFError
        return line.encode(), time.monotonic()


def exchange_with_agent(profile_path, declared, gpus, rng=None):
    a, b = os.pipe()
    c, d = os.pipe()
    to_node, node_in = os.fdopen(b, "w"), os.fdopen(a)
    node_out, from_node = os.fdopen(d, "w"), os.fdopen(c)
    cfg = SimpleNamespace(runtime="sim", sim_profile=str(profile_path))
    status = []
    thread = threading.Thread(target=lambda: status.append(node.run_exchange(cfg, node_in, node_out)))
    thread.start()
    try:
        drawn = memproof.draw(declared, gpus, rng=rng)
        out = memproof.run(PipeExchange(to_node, from_node), drawn, 300, rng=rng)
        final = json.loads(from_node.readline())
    finally:
        to_node.close()
        thread.join(30)
    return drawn, out, final, status


def test_an_honest_node_passes_and_reads_its_fill_in_the_claimed_cards_time():
    drawn, out, final, status = exchange_with_agent(PROFILES_DIR / "a100-80gb-sxm-x4.json", A100, [0, 1, 2, 3])
    assert (final["ok"], status, out.problem) == (True, [0], "")
    findings, figures = memproof_verdict.judge(A100, drawn, out)
    assert findings == []
    assert drawn.nominal_bytes >= 0.95 * 81920 * 2 ** 20
    assert all(figures["gpus"][str(g)]["correct"] for g in range(4))
    # 77.8 GB at 85 % of 2039 GB/s: ~45 ms, under the deadline (half the datasheet bandwidth, plus the allowance)
    assert all(figures["gpus"][str(g)]["fresh_s"] < figures["read_deadline_s"] for g in range(4))
    assert all(0 < figures["gpus"][str(g)]["fill_s"] < figures["fill_wait_s"] for g in range(4))
    assert not any("node_fill" in figures["gpus"][str(g)] for g in range(4))  # a sim agent gives no account of it


def test_a_40gb_card_claiming_80gb_with_the_rest_in_host_ram_is_late():
    path = PROFILES_DIR / "a100-40gb-sxm-says-80gb-everywhere-x1.json"
    drawn, out, final, status = exchange_with_agent(path, A100, [0])
    assert (final["ok"], status) == (True, [0])
    findings, figures = memproof_verdict.judge(A100, drawn, out)
    assert codes(findings) == [("memory_proof_late", "reject", 0)]
    assert figures["gpus"]["0"]["correct"] is True  # every opening is right: only the clock sees it
    # ~37 GB over its 25 GB/s host link: more than a second
    assert figures["gpus"]["0"]["fresh_s"] > 1.0
    assert "host RAM" in findings[0].message


def test_made_up_digests_for_the_memory_it_lacks_fail_the_openings(tmp_path):
    profile = json.loads((PROFILES_DIR / "a100-40gb-sxm-says-80gb-everywhere-x1.json").read_text())
    profile["performance"]["memory_rest"] = "made_up"
    path = tmp_path / "made-up.json"
    path.write_text(json.dumps(profile))
    # with 8 openings a card holding half of the blocks passes them all 1 time in 256: seeded so that one lands
    drawn, out, final, status = exchange_with_agent(path, A100, [0], rng=random.Random(1))
    assert any(b >= drawn.blocks // 2 for b, _ in out.picks[0])
    findings, _ = memproof_verdict.judge(A100, drawn, out)
    assert codes(findings) == [("memory_proof_failed", "reject", 0)]
    assert "does not match its committed digest" in findings[0].message


# ------------------------------------------------------------------------------------------ bad answers

class FakeExchange:
    def __init__(self, *lines):
        self.lines, self.sent, self.timeouts = list(lines), [], []

    def send(self, message):
        self.sent.append(message)
        return time.monotonic()

    def receive(self, timeout):
        self.timeouts.append(timeout)
        line = self.lines.pop(0) if self.lines else None
        if line is EOFError:
            raise EOFError
        return line, time.monotonic()


@pytest.mark.parametrize("lines, reason", [
    ([*PONGS, b"garbage"], "garbage"),
    ([*PONGS, b'{"gpu": 0, "root": 5}'], "other than a root of its fill"),
    ([*PONGS, None], "sent no root of its fill within the wait"),
    ([*PONGS, b'{"gpu": 0, "root": "ab"}', None], "sent no fresh root"),
    ([None], "did not answer a ping"),
    ([*PONGS, EOFError], "closed the exchange"),
    ([*PONGS, b'{"ok": false, "error": {"code": "memproof_unsupported", "message": "no"}}'], "stopped with an error"),
])
def test_a_node_that_answers_badly_gets_a_finding_with_the_reason(lines, reason):
    drawn = memproof.draw(A100, [0])
    out = memproof.run(FakeExchange(*lines), drawn, 300)
    findings, _ = memproof_verdict.judge(A100, drawn, out)
    assert codes(findings) == [("memory_proof_no_answer", "reject", 0)]
    assert reason in findings[0].message and "verify again" in findings[0].message


def test_roots_without_openings_or_with_wrong_ones_fail():
    drawn = memproof.draw(A100, [0])
    roots = [b'{"gpu": 0, "root": "ab"}', b'{"gpu": 0, "root": "cd"}']
    exchange = FakeExchange(*PONGS, *roots, b'{"nope": 1}')
    findings, _ = memproof_verdict.judge(A100, drawn, memproof.run(exchange, drawn, 300))
    assert codes(findings) == [("memory_proof_failed", "reject", 0)]
    assert "fresh" in exchange.sent[-2] and "open" in exchange.sent[-1]  # opened only after both roots
    words = "00" * 4 * drawn.words
    for answer, why in (({"gpu": 0, "opened": "all"}, "other than its openings"),
                        ({"opened": []}, "other than its openings"), ({"gpu": 1, "opened": []}, "other than its"),
                        ({"gpu": 0, "opened": [{"block": 1}]}, "was not opened"),
                        ({"gpu": 0, "opened": [{"block": 0, "chunk": 0, "words": ["x"]}]}, "32-bit words"),
                        ({"gpu": 0, "opened": [{"block": 0, "chunk": 0, "words": words[2:]}]}, "32-bit words"),
                        ({"gpu": 0, "opened": [{"block": 0, "chunk": 0, "words": "zz" + words[2:]}]},
                         "32-bit words"),
                        ({"gpu": 0, "opened": [{"block": 0, "chunk": 0, "words": words}]}, "no chunk digests"),
                        (None, "sent no openings")):
        exchange = FakeExchange(*PONGS, *roots, json.dumps(answer).encode() if answer else None)
        out = memproof.run(exchange, drawn, 300)
        out.picks = {0: [(1, 0)]}  # block 1's chunk 0: the first chunk checked is chunk 0 of block 0
        findings, _ = memproof_verdict.judge(A100, drawn, out)
        assert codes(findings) == [("memory_proof_failed", "reject", 0)], answer
        assert why in findings[0].message, (answer, findings[0].message)


def flip_word(item, t=0):
    """The opened chunk with the lowest bit of its word t flipped (words: little-endian uint32 in hex)."""
    raw = bytearray(bytes.fromhex(item["words"]))
    raw[4 * t] ^= 1
    item["words"] = raw.hex()


def test_an_opening_is_a_few_kib_per_commitment_beside_its_words_at_real_sizes():
    """At 4096 chunks of 4096 words (a real fill's 64 MiB blocks) an opened chunk carries 16 KiB of words and,
    per commitment, 2 KiB of its group's 512 chunk digests (4 bytes each) and 256 B of group digests (hex doubles
    them): every opening of a GPU fits a line well under the SSH exchange's 8 MiB."""
    req = {"chunks": 4096, "words": 4096}
    card = node.Committed()
    assert node.DIGEST_BYTES == memproof.DIGEST_BYTES == 4 and node.GROUP == memproof.GROUP == 512
    packed = [bytes(range(256)) * (node.DIGEST_BYTES * req["chunks"] // 256)] * 3
    card.keep(packed, fresh=False)
    card.keep(packed, fresh=True)
    item = card.opening(2, 4095, [7] * req["words"])
    sizes = {k: len(v) // 2 for k, v in item.items() if isinstance(v, str)}
    assert sizes == {"words": 16384, "group": 2048, "groups": 256, "group_fresh": 2048, "groups_fresh": 256}
    per_gpu = memproof.OPENINGS * (2 + 2 * memproof.REFS) * len(json.dumps(item))  # the most an answer reaches
    assert per_gpu < 8 * 2 ** 20 * 0.75, per_gpu


def test_a_tampered_word_or_path_of_an_honest_answer_fails():
    drawn, out, _, _ = exchange_with_agent(PROFILES_DIR / "a100-80gb-sxm-x4.json", A100, [0])
    assert memproof_verdict.check_gpu(drawn, out, 0) == ""
    item = out.opened["0"][0]
    flip_word(item)
    assert "does not match its committed digest" in memproof_verdict.check_gpu(drawn, out, 0)
    flip_word(item)
    assert memproof_verdict.check_gpu(drawn, out, 0) == ""
    for field in ("group", "groups_fresh"):
        honest = item[field]
        item[field] = ("0" if honest[0] != "0" else "1") + honest[1:]
        assert "does not lead to the committed root" in memproof_verdict.check_gpu(drawn, out, 0), field
        item[field] = honest
    item["path"] = item["path"][::-1] if len(item["path"]) > 1 else ["00" * 32]
    assert "does not lead to the committed root" in memproof_verdict.check_gpu(drawn, out, 0)


def test_a_fill_not_derived_from_its_blocks_or_not_from_the_seed_fails_with_consistent_digests(monkeypatch):
    """Digests and paths that agree with the words opened, but words that are not the fill: every block after
    the first changed (not G of the blocks it reads), or block 0 not the seed's (the rest derived from it)."""
    honest_fill = node.fill
    monkeypatch.setattr(node, "fill", lambda *args: [block if i == 0 else [w ^ 1 for w in block]
                                                     for i, block in enumerate(honest_fill(*args))])
    drawn, out, final, _ = exchange_with_agent(PROFILES_DIR / "a100-80gb-sxm-x4.json", A100, [0])
    assert final["ok"] is True
    block, chunk = out.picks[0][0]
    refs = memproof.links(drawn.seed, 0, block, drawn.chunks * drawn.words)[0]
    assert memproof_verdict.check_gpu(drawn, out, 0) == (f"word {chunk * drawn.words} of block {block} is not derived "
                                                         f"from blocks {block - 1} and "
                                                         + ", ".join(str(p) for p, _ in refs))
    monkeypatch.setattr(node, "fill", honest_fill)
    honest_zero = node.block_zero
    monkeypatch.setattr(node, "block_zero", lambda *args: [w ^ 1 for w in honest_zero(*args)])
    drawn, out, final, _ = exchange_with_agent(PROFILES_DIR / "a100-80gb-sxm-x4.json", A100, [0],
                                               rng=random.Random(2))
    assert final["ok"] is True
    assert memproof_verdict.check_gpu(drawn, out, 0).endswith("of block 0 is not the seed's")


def test_the_agent_refuses_a_bad_request_with_the_field():
    for req, field in (({"seed": -1}, "seed"), ({"blocks": 1}, "blocks"), ({"extra": 1}, "extra"),
                       ({"gpu_indices": [0, 0]}, "gpu_indices"), ({"digest": "fast"}, "digest")):
        good = memproof.draw(A100, [0]).request(60)
        with pytest.raises(node.AgentError) as caught:
            node.validate(dict(good, **req))
        assert caught.value.field == field


def test_the_profile_file_exists_with_its_expected_verdict():
    profile = json.loads(Path(PROFILES_DIR / "a100-40gb-sxm-says-80gb-everywhere-x1.json").read_text())
    assert profile["expect"] == {"verdict": "rejected", "findings": ["memory_proof_late"]}


def test_a_platform_that_hangs_up_ends_the_agent_with_an_error_line():
    import io
    out = io.StringIO()
    cfg = SimpleNamespace(runtime="sim", sim_profile=str(PROFILES_DIR / "a100-80gb-sxm-x4.json"))
    request = json.dumps({"memproof": memproof.draw(A100, [0]).request(60)}) + "\n"
    assert node.run_exchange(cfg, io.StringIO(request), out, sleep=lambda s: None) == 1
    answers = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [a["gpu"] for a in answers if "root" in a] == [0]
    assert answers[-1]["ok"] is False and "closed the exchange" in answers[-1]["error"]["message"]
    # a real node says it cannot, as an error the platform turns into memory_proof_no_answer
    out = io.StringIO()
    assert node.run_exchange(SimpleNamespace(runtime="docker", sim_profile=None), io.StringIO(request), out) == 1
    assert json.loads(out.getvalue().splitlines()[-1])["error"]["code"] == "memproof_unsupported"


def test_the_pytorch_fill_on_this_cpu_is_the_platforms_and_passes_its_check():
    """The agent's real path (TorchCard) with device "cpu" and small sizes: bit-identical blocks, digests and
    roots, an honest exchange on pipes verified by the platform, and a real-size draw that fills the bytes."""
    torch = pytest.importorskip("torch")
    drawn = memproof.draw(A100, [0, 1], rng=random.Random(5), sizes={"blocks": 9, "chunks": 6, "words": 16},
                          device="cpu")
    req = node.validate(drawn.request(60))
    old, node.SLICE = node.SLICE, 40  # slices that split chunks and blocks unevenly
    try:
        card = node_torch.TorchCard(torch, torch.device("cpu"), req, 1)
    finally:
        node.SLICE = old
    size = drawn.chunks * drawn.words
    assert [[w & node.M32 for w in b.tolist()] for b in card.blocks] == node.fill(drawn.seed, 1, drawn.blocks, size)
    salts = node.position_salts(node.key(drawn.seed, 1, "digest"), drawn.words)
    sim_like = node.merkle_levels([node.block_leaf(node.group_digests(node.packed_block(b, drawn.chunks, drawn.words,
                                                                                     salts)))
                                   for b in node.fill(drawn.seed, 1, drawn.blocks, size)])
    assert card.commit(salts) == sim_like[-1][0].hex()
    assert card.detail["digest"] == "eager" and set(card.detail["node_s"]) == {"device", "host", "fill"}  # no compile
    card.commit(salts, fresh=True)
    assert set(card.detail["node_s"]) == {"device", "host"}  # the fill's seconds go with the fill's root only

    out, final, status, _ = torch_exchange(drawn)
    assert (final["ok"], status, out.problem) == (True, [0], "")
    assert memproof_verdict.check_gpu(drawn, out, 0) == "" and memproof_verdict.check_gpu(drawn, out, 1) == ""
    assert {g: d["digest"] for g, d in out.node_detail.items()} == {0: "eager", 1: "eager"}  # auto, on a CPU
    real = memproof.draw(A100, [0], real=True)
    assert real.blocks * real.chunks * real.words * 4 >= 0.95 * 81920 * 2 ** 20
    assert node.validate(real.request(600))["blocks"] == real.blocks


def torch_exchange(drawn, time_limit_s=120):
    """The agent's PyTorch path (runtime docker) and the platform's memproof.run on pipes: (outcome, the agent's
    last line, its exit status, the pipe)."""
    cfg = SimpleNamespace(runtime="docker", sim_profile=None)
    a, b = os.pipe()
    c, d = os.pipe()
    to_node, node_in, node_out, from_node = os.fdopen(b, "w"), os.fdopen(a), os.fdopen(d, "w"), os.fdopen(c)
    status = []
    thread = threading.Thread(target=lambda: status.append(node.run_exchange(cfg, node_in, node_out)))
    thread.start()
    try:
        pipe = SizedPipe(to_node, from_node)
        out = memproof.run(pipe, drawn, time_limit_s)
        final = json.loads(from_node.readline()) if not out.problem else {}
    finally:
        to_node.close()
        thread.join(time_limit_s)
    return out, final, status, pipe


def eager_root(drawn, gpu, salt_base):
    """The root of the GPU's fill under salt_base's position salts, computed by the agent's pure-Python fill."""
    size, salts = drawn.chunks * drawn.words, node.position_salts(salt_base, drawn.words)
    return node.merkle_levels([node.block_leaf(node.group_digests(node.packed_block(b, drawn.chunks, drawn.words,
                                                                                  salts)))
                               for b in node.fill(drawn.seed, gpu, drawn.blocks, size)])[-1][0].hex()


def test_the_fused_digest_compiled_on_this_cpu_gives_the_same_roots_and_passes():
    """digest "fused": torch.compile's one kernel a block (inductor's C++ on a CPU, Triton on a GPU). Its roots
    are the pure-Python fill's, under the fill's salts and the fresh one, and the root lines say which path ran."""
    pytest.importorskip("torch")
    drawn = memproof.draw(A100, [0, 1], rng=random.Random(8), sizes={"blocks": 5, "chunks": 64, "words": 32},
                          device="cpu", digest="fused")
    out, final, status, _ = torch_exchange(drawn, 300)
    assert (final["ok"], status, out.problem) == (True, [0], "")
    for gpu in (0, 1):
        assert out.node_detail[gpu]["digest"] == "fused", out.node_detail
        assert "fused_error" not in out.node_detail[gpu]
        assert out.roots[gpu] == eager_root(drawn, gpu, node.key(drawn.seed, gpu, "digest"))
        assert out.fresh_roots[gpu] == eager_root(drawn, gpu, out.fresh_salt)
        assert memproof_verdict.check_gpu(drawn, out, gpu) == ""
    _, figures = memproof_verdict.judge(A100, drawn, out)
    assert figures["gpus"]["0"]["node"]["digest"] == "fused" and figures["gpus"]["0"]["node"]["node_s"]["device"] >= 0
    for gpu in ("0", "1"):  # what the fill and the compile used of the fill's wait: the platform's clock, the agent's
        row, setup = figures["gpus"][gpu], figures["gpus"][gpu]["node_fill"]["node_s"]
        assert 0 < setup["fill"] < row["fill_s"] < figures["fill_wait_s"] == round(drawn.fill_wait_s, 3)
        assert 0 < setup["compile"] < row["fill_s"] and "fill" not in row["node"]["node_s"]  # the fill's root only


def test_a_fused_digest_that_disagrees_with_pytorchs_ops_is_not_used(monkeypatch):
    """A miscompiled kernel (here: one that forgets the salts) is caught on block 0 before the fill's roots: the
    agent digests eagerly, says why, and the proof passes."""
    torch = pytest.importorskip("torch")
    monkeypatch.setitem(node_torch._FUSED, "rows", lambda view, salts: node_torch.digest_rows(torch, view, salts * 0))
    drawn = memproof.draw(A100, [0], rng=random.Random(9), sizes={"blocks": 3, "chunks": 4, "words": 16},
                          device="cpu", digest="fused")
    out, final, status, _ = torch_exchange(drawn)
    assert (final["ok"], status, out.problem) == (True, [0], "")
    assert out.node_detail[0]["digest"] == "eager"
    assert "disagrees" in out.node_detail[0]["fused_error"]
    assert memproof_verdict.check_gpu(drawn, out, 0) == ""


def test_a_real_fill_waits_for_the_agents_setup_and_a_sim_fill_does_not():
    sim, real = memproof.draw(A100, [0]), memproof.draw(A100, [0], real=True)
    assert real.fill_wait_s - memproof.FILL_PASSES * real.read_s == pytest.approx(memproof.GRACE_S + memproof.SETUP_S)
    assert sim.fill_wait_s - memproof.FILL_PASSES * sim.read_s == pytest.approx(memproof.GRACE_S)
    assert "digest" not in real.request(60)
    assert memproof.draw(A100, [0], digest="eager").request(60)["digest"] == "eager"


class SizedPipe(PipeExchange):
    """The pipe, keeping each answer line's length."""

    def __init__(self, *args):
        super().__init__(*args)
        self.sizes = []

    def receive(self, timeout):
        line, at = super().receive(timeout)
        self.sizes.append(len(line))
        return line, at


def test_a_real_size_fills_openings_fit_the_ssh_exchanges_line_limit():
    """The PyTorch path on this CPU with a real fill's block shape (4096 chunks of 4096 words, 64 MiB; two blocks
    only, so that block 1 reads block 0 six times over): every line the platform reads is under the SSH exchange's
    MAX_ANSWER_BYTES. With every chunk digest of a block in each opened chunk, one GPU's openings were ~20 MB."""
    pytest.importorskip("torch")
    from provisioning.ssh_channels import MAX_ANSWER_BYTES
    drawn = memproof.draw(A100, [0], sizes={"blocks": 2, "chunks": 4096, "words": 4096}, device="cpu")
    out, _, _, pipe = torch_exchange(drawn, 300)
    assert out.problem == "" and memproof_verdict.check_gpu(drawn, out, 0) == ""
    assert sum(len(node.needed_chunks(drawn.request(60), 0, b, c)) for b, c in out.picks[0]) > 8 * 8  # many reached
    assert 2 ** 20 < max(pipe.sizes) < MAX_ANSWER_BYTES * 0.75, pipe.sizes
    assert max(pipe.sizes) <= memproof.openings_bytes(drawn)  # the bound the openings' wait uses


def test_the_openings_wait_grows_with_their_bytes_at_the_stated_floor():
    """Eight GPUs' openings of a real fill are ~40 MB (4.8 MB a GPU, measured above and in BENCHMARKS): the
    platform waits for them at ANSWER_FLOOR_BPS (10 Mbit/s of the node's uplink), not within a fixed 10 s, which
    would ask 32 Mbit/s of it; a sim fill's openings keep about the 10 s."""
    from provisioning.verification.challenge import ANSWER_FLOOR_BPS, answer_wait_s
    h200 = DeclaredModel.from_catalogue(CATALOGUE["h200-sxm"])
    for drawn, least, most in ((memproof.draw(A100, [0]), 10, 11),
                               (memproof.draw(h200, list(range(8)), real=True), 38e6 / ANSWER_FLOOR_BPS, 60)):
        roots = [json.dumps({"gpu": g, "root": "ab"}).encode() for g in drawn.gpu_indices]
        exchange = FakeExchange(*PONGS, *roots, *roots, None)
        out = memproof.run(exchange, drawn, 300)
        wait = answer_wait_s(memproof.openings_bytes(drawn))
        assert exchange.timeouts[-1] == pytest.approx(wait, abs=0.5) and least <= wait <= most, wait
        assert out.problem == f"sent no openings within {wait:.0f} s"


# ------------------------------------------------------------------ a card rebuilding what it lacks; the retry

def test_rebuilding_dropped_blocks_costs_passes_of_memory_an_honest_card_does_not_pay():
    seed = 0x5EED
    assert recompute.recompute_passes(seed, 0, 1187, 1.0) == 1.0
    # half of a real 76 GB fill: with six earlier blocks read per block, past the count's cap; with one, cheap
    assert recompute.recompute_passes(seed, 0, 1187, 0.52) == recompute.RECOMPUTE_CAP
    assert recompute.recompute_passes(seed, 0, 1187, 0.52, refs=1) < 2.0  # inside the old deadline: the hole it closes
    assert 1.0 < recompute.recompute_passes(seed, 0, 1187, 0.9) < recompute.recompute_passes(seed, 0, 1187, 0.7)


def test_a_40gb_card_rebuilding_the_rest_on_the_card_is_late_with_every_opening_right():
    path = PROFILES_DIR / "a100-40gb-sxm-says-80gb-rebuilds-the-rest-x1.json"
    drawn, out, final, status = exchange_with_agent(path, A100, [0])
    assert (final["ok"], status) == (True, [0])
    findings, figures = memproof_verdict.judge(A100, drawn, out)
    assert codes(findings) == [("memory_proof_late", "reject", 0)]
    assert figures["gpus"]["0"]["correct"] is True and figures["fresh_rounds"] == 2  # late twice
    assert figures["gpus"]["0"]["fresh_s"] > 1.0 > figures["read_deadline_s"]
    assert json.loads(path.read_text())["expect"] == {"verdict": "rejected", "findings": ["memory_proof_late"]}


class ClockedExchange(FakeExchange):
    """FakeExchange on a clock of its own: each line arrives `delay` seconds after the last message sent."""

    def __init__(self, *timed):
        super().__init__(*[line for line, _ in timed])
        self.delays, self.now = [delay for _, delay in timed], 1000.0

    def send(self, message):
        self.sent.append(message)
        return self.now

    def receive(self, timeout):
        line, _ = super().receive(timeout)
        delay = self.delays.pop(0) if self.delays else 0.0
        return line, self.now + delay


def fresh_answers(*delays):
    root = b'{"gpu": 0, "root": "ab"}'
    return [(root, delay) for delay in delays]


def test_a_late_fresh_root_gets_a_second_salt_and_the_second_answer_is_judged():
    drawn = memproof.draw(A100, [0])
    on_time, late = drawn.read_s / 2, drawn.read_s + 1.0
    exchange = ClockedExchange(*[(p, 0.001) for p in PONGS], *fresh_answers(0.0, late, on_time), (b'{"nope": 1}', 0))
    out = memproof.run(exchange, drawn, 300)
    assert out.fresh_rounds == 2 and [m for m in exchange.sent if "fresh" in m][1]["fresh"] == out.fresh_salt
    findings, figures = memproof_verdict.judge(A100, drawn, out)
    assert "memory_proof_late" not in {f.code for f in findings}  # (its openings are garbage: failed)
    assert figures["gpus"]["0"]["fresh_s"] == pytest.approx(on_time - 0.001, abs=1e-4)

    exchange = ClockedExchange(*[(p, 0.001) for p in PONGS], *fresh_answers(0.0, late, late), (b'{"nope": 1}', 0))
    out = memproof.run(exchange, drawn, 300)
    assert out.fresh_rounds == memproof.FRESH_TRIES == 2 and len([m for m in exchange.sent if "fresh" in m]) == 2
    assert memproof.late_gpus(drawn, out) == [0]  # judged late (here its garbage openings fail it first)

    exchange = ClockedExchange(*[(p, 0.001) for p in PONGS], *fresh_answers(0.0, on_time), (b'{"nope": 1}', 0))
    assert memproof.run(exchange, drawn, 300).fresh_rounds == 1  # on time: no second salt


def test_uneven_pongs_buy_at_most_the_capped_allowance():
    drawn = memproof.draw(A100, [0])
    base, cap = (memproof.TOLERANCES["memory_proof_latency_allowance_s"],
                 memproof.TOLERANCES["memory_proof_jitter_allowance_max_s"])
    steady = memproof.run(ClockedExchange(*[(p, 0.002) for p in PONGS], *fresh_answers(0.0, 0.0)), drawn, 300)
    assert memproof.allowance_s(steady) == pytest.approx(base)
    uneven = [(PONGS[0], 0.001), (PONGS[1], 5.0), (PONGS[2], 0.001)]
    out = memproof.run(ClockedExchange(*uneven, *fresh_answers(0.0, drawn.read_s + base + cap + 0.05,
                                                                drawn.read_s + base + cap + 0.05)), drawn, 300)
    assert out.round_trip_spread_s == pytest.approx(4.999) and memproof.allowance_s(out) == pytest.approx(base + cap)
    assert memproof.late_gpus(drawn, out) == [0]


def test_the_agent_takes_a_second_fresh_salt_and_refuses_a_third():
    import io
    cfg = SimpleNamespace(runtime="sim", sim_profile=str(PROFILES_DIR / "a100-80gb-sxm-x4.json"))
    request = json.dumps({"memproof": memproof.draw(A100, [0]).request(60)}) + "\n"
    out = io.StringIO()
    lines = request + '{"fresh": 1}\n{"fresh": 2}\n{"open": {"0": [[1, 0]]}}\n'
    assert node.run_exchange(cfg, io.StringIO(lines), out, sleep=lambda s: None) == 0
    answers = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len([a for a in answers if "root" in a]) == 3 and answers[-1]["ok"] is True
    out = io.StringIO()
    lines = request + '{"fresh": 1}\n{"fresh": 2}\n{"fresh": 3}\n'
    assert node.run_exchange(cfg, io.StringIO(lines), out, sleep=lambda s: None) == 2
    assert json.loads(out.getvalue().splitlines()[-1])["error"]["field"] == "open"


def test_the_fill_is_95_percent_of_the_memory_a_card_has_in_its_ecc_mode():
    """The catalogue's memory_mib of the RTX A4000/A5000/A6000 and RTX 4090 is their ECC-off size; with ECC on a
    card has 1/16 less. The proof asked 95 % of memory_mib whatever the mode: more than an honest RTX A4000 with
    ECC on has at all, an out-of-memory on a real card (found by review)."""
    from provisioning.services.platform_checks import ecc_mode_of

    a4000 = DeclaredModel.from_catalogue(CATALOGUE["rtx-a4000"])
    on, off = a4000.memory_mib_ecc_on, a4000.memory_mib_ecc_off
    assert on < off
    for mode, size in (("Enabled", on), ("Disabled", off), (None, on)):
        nominal = memproof.draw(a4000, [0], ecc_mode=mode).nominal_bytes
        assert 0.95 * size * 2 ** 20 <= nominal <= size * 2 ** 20, mode
    gpus = [{"index": 0, "ecc_mode": "Enabled"}, {"index": 1, "ecc_mode": "Disabled"}]
    assert ecc_mode_of({"gpus": gpus}, [0]) == "enabled" and ecc_mode_of({"gpus": gpus}, [1]) == "disabled"
    assert ecc_mode_of({"gpus": gpus}, [0, 1]) is None and ecc_mode_of({}, [0]) is None  # mixed, or not said
    assert ecc_mode_of({"gpus": "garbage"}, [0]) is None


def test_a_finding_names_the_memory_the_fill_stood_for():
    """The fill is 95 % of the card's memory in its ECC mode; the finding said 95 % of the catalogue's ECC-off size
    (found by review), not the number the proof asked for."""
    a4000 = DeclaredModel.from_catalogue(CATALOGUE["rtx-a4000"])
    proof = memproof.draw(a4000, [0], ecc_mode="Enabled")
    (finding,) = memproof_verdict.judge(a4000, proof, memproof.Outcome(problem="did not answer"))[0]
    assert f"95% of the {a4000.memory_mib_ecc_on} MiB an RTX A4000 has" in finding.message
    assert str(a4000.memory_mib_ecc_off) not in finding.message
