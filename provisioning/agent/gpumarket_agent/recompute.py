"""What a card short of memory pays to answer the memory proof's fresh root by rebuilding, on the card, the
blocks of the fill it dropped (memproof.py): the sim's `memory_rest: "recomputed"` profiles answer after this
many passes of their memory, and bench/memproof_recompute.py compares fills with fewer earlier blocks per block.
"""
import random
from collections import OrderedDict

from .memproof import REFS, read_blocks

RECOMPUTE_SCRATCH = 8  # blocks a recomputing card keeps of what it rebuilt
RECOMPUTE_CAP = 30.0  # passes of its memory: past this the count stops (it is late by far)


def recompute_passes(seed, gpu, blocks, held, refs=REFS, scratch=RECOMPUTE_SCRATCH, cap=RECOMPUTE_CAP):
    """What a card holding `held` of a `blocks`-block fill reads, in passes of the whole fill, to digest every
    block once when it rebuilds the ones it dropped (each rebuilt block read from what it holds, from the last
    `scratch` it rebuilt, or rebuilt again). The cheapest of three ways to choose what to keep: every k-th block
    dropped, the blocks most read by others kept, a random share. An honest card: 1.0."""
    deps = [[]] + [[i - 1] + read_blocks(seed, gpu, i, refs) for i in range(1, blocks)]
    keep_n = min(blocks, max(1, int(round(held * blocks))))
    if keep_n >= blocks:
        return 1.0
    read_by = [0] * blocks
    for ds in deps:
        for d in ds:
            read_by[d] += 1
    k = max(2, int(round(1.0 / (1.0 - float(keep_n) / blocks))))
    ways = [{i for i in range(blocks) if i % k != k - 1},
            set(sorted(range(blocks), key=lambda i: -read_by[i])[:keep_n]),
            set(random.Random(seed ^ gpu).sample(range(blocks), keep_n))]  # noqa: S311 - a sim strategy
    reads = [_pass_reads(deps, kept, scratch, cap * blocks) for kept in ways]
    return min([cap] + [r / float(blocks) for r in reads if r is not None])


def _pass_reads(deps, kept, scratch, limit):
    """Blocks read to produce every block once in order (None past `limit`): a block is read if held or among
    the last `scratch` rebuilt, else rebuilt from the blocks it reads."""
    recent, reads = OrderedDict(), 0
    for i in range(len(deps)):
        stack = [(i, False)]
        while stack:
            b, ready = stack.pop()
            if ready:
                recent[b] = True
                if len(recent) > scratch:
                    recent.popitem(last=False)
            elif b in kept or b in recent:
                if b in recent:
                    recent.move_to_end(b)
                reads += 1
                if reads > limit:
                    return None
            else:
                stack.append((b, True))
                stack.extend((d, False) for d in reversed(deps[b]))
    return reads
