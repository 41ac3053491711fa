"""The upcycled router's initial weight, computed in Python the way include/moefold/upcycle/
router_init.hpp computes it in C++ (SplitMix64's mixer over a counter, Box-Muller, times 0.02,
rounded once to fp32), so that tests can hold the tool's routers to an implementation that shares
no code with it."""
import math
import struct

MASK = (1 << 64) - 1


def mix64(z):
    z = (z + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def unit_draw(seed, i):
    """Draw i of stream `seed` in (0, 1], 53 bits."""
    u = mix64((mix64(seed & MASK) + i) & MASK)
    return float((u >> 11) + 1) * 2.0 ** -53


def normal(seed, i):
    """Standard normal number i: Box-Muller on draws 2j, 2j + 1 (cosine for even i)."""
    j = i // 2
    r = math.sqrt(-2.0 * math.log(unit_draw(seed, 2 * j)))
    a = 2.0 * math.pi * unit_draw(seed, 2 * j + 1)
    return r * (math.cos(a) if i % 2 == 0 else math.sin(a))


def to_f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def router(seed, experts, hidden, granularity, uniform=False):
    """[E][H] as Python floats holding fp32 values; rows repeat within each virtual group."""
    if uniform:
        return [[0.0] * hidden for _ in range(experts)]
    return [[to_f32(0.02 * normal(seed, (e // granularity) * hidden + h)) for h in range(hidden)]
            for e in range(experts)]
