"""Word-wise arithmetic on many unsigned words at once, each in a lane of one Python int (SWAR).

The platform checks a node's answers by recomputing hashes of the seed: thousands of 32-bit words an opened
chunk of the memory proof. One word at a time in CPython that is ~0.5 us a hash and ~0.8 s of control-plane CPU a
GPU. Packed `width` bits a lane into one int, the same shifts, XORs, masks and multiplications by a constant run
over every lane in CPython's C loops over big ints: tens of times faster, with no dependency (the platform has no
numpy).

A lane holds a value of at most half its width, so that a product with a constant of that half width stays inside
its lane (32-bit words in 64-bit lanes for fmix32; 64-bit ones in 128-bit lanes for mix64). A right shift brings
the next lane's low bits into the top of this one; the mask after each step clears them. Pure: no Django.
"""
from __future__ import annotations

import struct
from functools import lru_cache

M32 = (1 << 32) - 1
M64 = (1 << 64) - 1


@lru_cache(maxsize=64)
def ones(count: int, width: int) -> int:
    """1 in each of `count` lanes of `width` bits."""
    return int.from_bytes((b"\x01" + bytes(width // 8 - 1)) * count, "little")


@lru_cache(maxsize=64)
def mask(count: int, width: int, bits: int) -> int:
    """The low `bits` bits set in each lane."""
    return ones(count, width) * ((1 << bits) - 1)


def broadcast(value: int, count: int, width: int) -> int:
    """`value` (at most width bits) in every lane."""
    return ones(count, width) * value


def pack32(raw: bytes) -> int:
    """Little-endian uint32 words (bytes, as an opened chunk carries them) into 64-bit lanes."""
    wide = bytearray(2 * len(raw))
    for byte in range(4):  # strided copies in C, no int per word
        wide[byte::8] = raw[byte::4]
    return int.from_bytes(wide, "little")


def pack(values: list[int] | tuple[int, ...], width: int) -> int:
    """Unsigned values below 2^64 into lanes of `width` (64 or 128) bits."""
    if width == 64:
        return int.from_bytes(struct.pack(f"<{len(values)}Q", *values), "little")
    flat = [0] * (2 * len(values))
    flat[::2] = values
    return int.from_bytes(struct.pack(f"<{len(flat)}Q", *flat), "little")


def unpack(lanes: int, count: int, width: int) -> tuple[int, ...]:
    """Each lane's value (lanes of 64 or 128 bits whose values are below 2^64)."""
    words = struct.unpack(f"<{count * width // 64}Q", lanes.to_bytes(count * width // 8, "little"))
    return words if width == 64 else words[::2]


def total(lanes: int, count: int, width: int) -> int:
    """The sum of the lanes (values below 2^64)."""
    return sum(unpack(lanes, count, width))


def total32(lanes: int, count: int, width: int = 64) -> int:
    """The sum of lanes holding 32-bit values: the top half of the lanes added onto the bottom half until one is
    left (no lane carries: `count` 32-bit values sum below 2^64)."""
    while count > 1:
        half = count // 2
        lanes = (lanes & ((1 << (width * half)) - 1)) + (lanes >> (width * half))
        count -= half
    return lanes


@lru_cache(maxsize=16)
def _counting(count: int, width: int) -> int:
    return pack(list(range(count)), width)


def iota(start: int, count: int, width: int) -> int:
    """start, start + 1, ... in `count` lanes (start + count <= 2^64)."""
    return _counting(count, width) + broadcast(start, count, width)  # no lane carries: each value < 2^64


def fmix32(z: int, count: int, width: int = 64) -> int:
    """murmur3's fmix32 (verification/challenge.py) in every lane; lanes hold 32-bit words, width >= 64."""
    m = mask(count, width, 32)
    z ^= (z >> 16) & m
    z = z * 0x85EBCA6B & m
    z ^= (z >> 13) & m
    z = z * 0xC2B2AE35 & m
    return z ^ ((z >> 16) & m)


def mix64(z: int, count: int) -> int:
    """verification/challenge.py's mix64 in every lane; 128-bit lanes holding 64-bit values."""
    m = mask(count, 128, 64)
    z = (z ^ ((z >> 30) & m)) * 0xBF58476D1CE4E5B9 & m
    z = (z ^ ((z >> 27) & m)) * 0x94D049BB133111EB & m
    return z ^ ((z >> 31) & m)


def narrow(lanes: int, count: int) -> int:
    """128-bit lanes of 32-bit values into 64-bit lanes."""
    return pack(unpack(lanes, count, 128), 64)


def mod5(z: int, count: int) -> int:
    """Each 64-bit value of 128-bit lanes mod 5: the quotient is the lane's product with ceil(2^66 / 5), shifted
    66 bits down (exact for every value below 2^64), and no lane borrows from the next in z - 5q."""
    q = (z * 0xCCCCCCCCCCCCCCCD >> 66) & mask(count, 128, 62)
    return z - 5 * q
