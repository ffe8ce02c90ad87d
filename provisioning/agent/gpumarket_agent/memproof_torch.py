"""The memory proof's real path: the fill on the device with PyTorch (memproof.py has the exchange and the
numbers).

On a real node (or `"device": "cpu"` in the request, for tests and gpu-selfcheck) TorchCard fills as fill() does, on the
device with PyTorch: the blocks as int32 tensors (the words' bits), built in slices of SLICE words, so that the
fill takes the requested bytes and little more, and digested by one torch.compile kernel a block (DIGEST_PATHS;
eager ops a slice at a time where it cannot compile); only the chunk digests (4 bytes per chunk) and the opened
chunks reach the host. Each root line also carries the agent's own timings of it (device and host seconds), as
detail for gpu-selfcheck and the figures, never as evidence.
"""
import sys
import threading
import time

from .challenge_torch import challenge_devices, tensor_bytes, torch_fmix32, torch_mix64
from .core import AgentError, at_once
from .memproof import DIGEST_BYTES, M32, SLICE, Committed, key, links


def _signed(x, bits):
    return x - (1 << bits) if x >= 1 << (bits - 1) else x


_FUSED = {}  # the compiled digest, one per process (torch.compile keeps a specialisation per device)


def fused_rows(torch):
    """digest_rows() compiled: fmix32, the widening and the row sums in one kernel, the fill read once."""
    if "rows" not in _FUSED:  # torch._dynamo: loaded on first use by torch itself
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)  # 8 GPUs and more
        _FUSED["rows"] = torch.compile(lambda view, salts: digest_rows(torch, view, salts), dynamic=False,
                                       fullgraph=True)
    return _FUSED["rows"]


def digest_rows(torch, view, salts):
    """Chunk digests of a [chunks, words] int32 view: sum over the words of fmix32(word ^ salt) mod 2^32, as
    int32 (the uint32's bits)."""
    total = (torch_fmix32(view ^ salts).to(torch.int64) & M32).sum(dim=1) & M32
    return (total - ((total >> 31) << 32)).to(torch.int32)


class TorchCard(Committed):
    """One GPU's fill on the device (PyTorch): the same blocks as fill(), as int32 tensors, views of one
    allocation (so that the fused digest reads the whole fill in one kernel)."""

    fused = None  # fused_rows() once use_fused() has compiled it for this card's device
    fused_error = None  # why the fused digest could not be used, when it was asked for
    detail = None  # the last commit's own timings (the agent's detail, not the platform's evidence)

    def __init__(self, torch, dev, req, i):
        started = time.monotonic()
        self.torch, self.dev, self.req, self.i = torch, dev, req, i
        self.fmix, self.mix = torch_fmix32, torch_mix64
        self.size = req["chunks"] * req["words"]
        self.fill = torch.empty(req["blocks"] * self.size, dtype=torch.int32, device=dev)
        self.blocks = [self.fill[b * self.size:(b + 1) * self.size] for b in range(req["blocks"])]
        self.block_zero(self.blocks[0])
        for b in range(1, req["blocks"]):
            self.derive(b, self.blocks[b])
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        # The fill's and the compile's seconds, sent with the fill's root: how much of the platform's SETUP_S a
        # real card uses (the compile once per device, one device after another), for the first GPU run to say.
        self.setup_s = {"fill": round(time.monotonic() - started, 6)}

    def _slices(self):
        return [(a, min(self.size, a + SLICE)) for a in range(0, self.size, SLICE)]

    def block_zero(self, out):
        torch = self.torch
        k = _signed(key(self.req["seed"], self.i, "seed"), 64)
        for a, b in self._slices():
            z = self.mix(torch.arange(a, b, dtype=torch.int64, device=self.dev) ^ k) & M32
            out[a:b] = self.fmix((z - ((z >> 31) << 32)).to(torch.int32))

    def derive(self, i, out):
        """Block i, into `out`. Each rotated read is one or two contiguous slices of the block read (it wraps at
        most once): no int64 index tensor and no gather, so the fill costs about its nominal traffic."""
        refs, salt = links(self.req["seed"], self.i, i, self.size)
        prev = self.blocks[i - 1]
        for a, b in self._slices():
            mixed = prev[a:b] ^ _signed(salt, 32)
            for p, rot in refs:
                read, start = self.blocks[p], (a + rot) % self.size
                first = min(b - a, self.size - start)
                mixed[:first] ^= read[start:start + first]
                if first < b - a:
                    mixed[first:] ^= read[:b - a - first]
            out[a:b] = self.fmix(mixed)

    def digests(self, salts, fused=None):
        """Every chunk digest of the fill (int32 on the device, block after block): one fused kernel over the
        whole fill, or eager a slice at a time (its int64 temporaries kept to a few x 32 MiB)."""
        torch = self.torch
        chunks, words = self.req["blocks"] * self.req["chunks"], self.req["words"]
        view = self.fill.view(chunks, words)
        fused = self.fused if fused is None else fused
        if fused:
            return fused(view, salts)
        out = torch.empty(chunks, dtype=torch.int32, device=self.dev)
        step = max(1, SLICE // words)
        for c0 in range(0, chunks, step):
            out[c0:c0 + step] = digest_rows(torch, view[c0:c0 + step], salts)
        return out

    def use_fused(self):
        """Compile the fused digest for this card's device (before the fill's roots: off the fresh root's clock)
        and check it against the eager one. Raises what the compiler raises."""
        torch = self.torch
        started = time.monotonic()
        salts = torch.arange(self.req["words"], dtype=torch.int32, device=self.dev) * -0x61C88647
        rows = fused_rows(torch)
        if not torch.equal(self.digests(salts, fused=rows), self.digests(salts, fused=False)):
            raise RuntimeError("the fused digest disagrees with PyTorch's own ops on this device")
        self.fused = rows
        self.setup_s["compile"] = round(time.monotonic() - started, 6)

    def commit(self, salts, fresh=False):
        torch = self.torch
        started = time.monotonic()
        t = torch.tensor([_signed(s, 32) for s in salts], dtype=torch.int32, device=self.dev)
        host = self.digests(t).to("cpu")  # waits for the device
        read = time.monotonic()
        raw, per = tensor_bytes(host), DIGEST_BYTES * self.req["chunks"]
        root = self.keep([raw[b * per:(b + 1) * per] for b in range(self.req["blocks"])], fresh)
        seconds = {"device": round(read - started, 6), "host": round(time.monotonic() - read, 6)}
        if not fresh:
            seconds.update(self.setup_s)
        self.detail = {"digest": "fused" if self.fused is not None else "eager", "node_s": seconds}
        return root

    def open(self, block, chunk):
        words = self.req["words"]
        values = self.blocks[block][chunk * words:(chunk + 1) * words].to("cpu").tolist()
        return self.opening(block, chunk, [v & M32 for v in values])


def torch_cards(req):
    """Every GPU's fill, a thread each (the device work runs outside the GIL)."""
    from .measurements import import_torch
    if sys.byteorder != "little":
        raise AgentError("memproof_unsupported", "the memory proof's digests are little-endian uint32s")
    torch = import_torch()
    devs = challenge_devices(torch, req)
    cards = at_once(devs.items(), lambda i, dev: TorchCard(torch, dev, req, i), "memproof_failed")
    fuse = req.get("digest", "auto")
    if fuse == "fused" or (fuse == "auto" and req.get("device", "cuda") == "cuda"):
        try:
            for i in sorted(cards):  # one device at a time: torch.compile is not made for threads compiling at once
                cards[i].use_fused()
        except Exception as exc:  # noqa: BLE001 - no Triton or compiler here: eager, and the roots say why
            for card in cards.values():
                card.fused = None
                card.fused_error = "%s: %s" % (type(exc).__name__, str(exc)[:300])
    return cards


def commit_now(lines, cards, salts_of, fresh):
    """A real node's roots, each written as soon as its GPU has digested its fill."""
    lock = threading.Lock()

    def one(i, card):
        root = card.commit(salts_of(i), fresh=fresh)
        line = dict(card.detail, gpu=i, root=root)
        if card.fused_error:
            line["fused_error"] = card.fused_error
        with lock:
            lines.write(line)
    at_once(cards.items(), one, "memproof_failed")
