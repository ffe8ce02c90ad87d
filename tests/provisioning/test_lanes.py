"""verification/lanes.py: word-wise hashing over lanes of one int gives, lane by lane, what the one-word functions
give (the platform's checks of the memory proof's openings rest on it)."""
import random

import pytest

from provisioning.verification import lanes
from provisioning.verification.challenge import M32, M64, fmix32, mix64

EDGES32 = [0, 1, 2, M32 - 1, M32, 0x80000000, 0x7FFFFFFF, 0xDEADBEEF]
EDGES64 = [0, 1, M64 - 1, M64, 1 << 63, (1 << 63) - 1, 0xFFFFFFFF00000000, 0x00000000FFFFFFFF]


@pytest.mark.parametrize("count", [1, 2, 7, 4096])
def test_fmix32_on_every_lane_is_fmix32_of_each_word(count):
    rng = random.Random(count)
    words = (EDGES32 + [rng.getrandbits(32) for _ in range(count)])[:count]
    for width in (64, 128):
        got = lanes.unpack(lanes.fmix32(lanes.pack(words, width), count, width), count, width)
        assert list(got) == [fmix32(w) for w in words]


@pytest.mark.parametrize("count", [1, 3, 1000])
def test_mix64_on_every_lane_is_mix64_of_each_word(count):
    rng = random.Random(count)
    values = (EDGES64 + [rng.getrandbits(64) for _ in range(count)])[:count]
    got = lanes.unpack(lanes.mix64(lanes.pack(values, 128), count), count, 128)
    assert list(got) == [mix64(v) for v in values]


def test_packing_xor_broadcast_iota_and_the_sum():
    rng = random.Random(7)
    words = [rng.getrandbits(32) for _ in range(513)]
    raw = b"".join(w.to_bytes(4, "little") for w in words)
    packed = lanes.pack32(raw)
    assert packed == lanes.pack(words, 64) and lanes.unpack(packed, 513, 64) == tuple(words)
    assert lanes.unpack(packed ^ lanes.broadcast(M32, 513, 64), 513, 64) == tuple(w ^ M32 for w in words)
    assert lanes.total(packed, 513, 64) == sum(words)
    for count in (1, 2, 3, 513):  # halves folded, odd counts included; no carry between lanes
        assert lanes.total32(lanes.pack(words[:count], 64), count) == sum(words[:count])
    assert lanes.total32(lanes.broadcast(M32, 4096, 64), 4096) == 4096 * M32
    assert lanes.unpack(lanes.iota(5, 4, 128), 4, 128) == (5, 6, 7, 8)
    assert lanes.narrow(lanes.pack(words, 128), 513) == packed
    assert lanes.mask(3, 64, 32) == sum(M32 << (64 * i) for i in range(3))


def test_mod5_on_every_lane_is_each_value_mod_5():
    rng = random.Random(5)
    values = EDGES64 + [5 * rng.getrandbits(61) + r for r in range(5)] + [rng.getrandbits(64) for _ in range(500)]
    got = lanes.unpack(lanes.mod5(lanes.pack(values, 128), len(values)), len(values), 128)
    assert list(got) == [v % 5 for v in values]


@pytest.mark.parametrize("k", [1, 5, 300])
def test_the_challenges_whole_rows_and_row_digests_are_the_one_word_ones(k):
    from provisioning.verification import challenge, challenge_rows
    rng = random.Random(k)
    seed, width = rng.getrandbits(64), 7
    wanted = [(0, 0, 0), (3, 7, 16383), (64, 1, (1 << 32) - 1)]
    # whole rows on lanes (B shared by the GPUs, generated once) against the one-entry definition
    assert challenge_rows.expected_rows(seed, k, width, wanted) == [
        [challenge.expected_entry(seed, gpu, product, k, row, col) for col in range(width)]
        for gpu, product, row in wanted]
    n = 257
    values = [rng.randrange(-(2 ** 31) + 1, 2 ** 31) for _ in range(n)] + [-(2 ** 31) + 1, 2 ** 31 - 1, 0, -1, 4.0]
    salts = challenge.column_salts(seed, 2, len(values))
    assert challenge.column_salt_lanes(seed, 2, len(values)) == lanes.pack(salts, 64)
    assert challenge.row_digest_lanes(values, lanes.pack(salts, 64)) == challenge.row_digest(values, salts)
