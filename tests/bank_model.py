"""Shared-memory bank model of the fp8-MMA kernel's V transpose (``gluon_transposed_fp8``).

A warp's shared load or store of W bytes a lane is served in phases of 128 / W lanes
(32 lanes up to 4 bytes, 16 for 8, 8 for 16); in a phase each of the 32 four-byte banks
serves one word a wavefront. The counts this gives matched Nsight Compute's on the H200
(docs/kernels/gluon_transposed.md).

Addresses: the K tile is TMA's 128-byte swizzle over [64 keys, 128-dim] sub-tiles
(``k_tile_address``); V^T is [512 dims, 128 key slots] rows under a 128-byte swizzle
(``vt_address``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def k_tile_address(key: int, dim: int) -> int:
    return (dim >> 7) * 8192 + key * 128 + ((((dim >> 4) & 7) ^ (key & 7)) << 4) + (dim & 15)


def vt_address(dim: int, slot: int) -> int:
    return dim * 128 + ((((slot >> 4) & 7) ^ (dim & 7)) << 4) + (slot & 15)


def wavefronts(addresses: Sequence[int], width: int) -> int:
    """Wavefronts of one warp instruction: lane i accesses ``width`` bytes at addresses[i]."""
    per_phase = 32 if width <= 4 else 128 // width
    total = 0
    for start in range(0, len(addresses), per_phase):
        words: dict[int, set[int]] = {}
        for a in addresses[start:start + per_phase]:
            for w in range(a >> 2, (a + width - 1 >> 2) + 1):
                words.setdefault(w & 31, set()).add(w)
        total += max(len(s) for s in words.values())
    return total


def element(bases: dict[str, list[list[int]]], reg: int, lane: int, warp: int) -> tuple[int, ...]:
    """The tensor coordinates a (register, lane, warp) holds under a linear layout's bases."""
    coord = [0] * len(bases["reg"][0])
    for name, index in (("reg", reg), ("lane", lane), ("warp", warp)):
        for bit, basis in enumerate(bases[name]):
            if index >> bit & 1:
                coord = [c ^ b for c, b in zip(coord, basis, strict=True)]
    return tuple(coord)


def vector_width(bases: dict[str, list[list[int]]], contiguous_dim: int) -> int:
    """Elements a thread moves in one access: the leading register bases that step the
    contiguous dimension by 1, 2, 4, ..."""
    n = 0
    for basis in bases["reg"]:
        want = [0] * len(basis)
        want[contiguous_dim] = 1 << n
        if basis != want:
            break
        n += 1
    return 1 << n


def warp_wavefronts(bases: dict[str, list[list[int]]], address: Callable[..., int],
                    contiguous_dim: int) -> int:
    """Wavefronts warp 0 takes for all its elements, one access of ``vector_width``
    elements a lane an instruction (one-byte elements)."""
    width = vector_width(bases, contiguous_dim)
    total = 0
    for reg in range(0, 1 << len(bases["reg"]), width):
        total += wavefronts([address(*element(bases, reg, lane, 0)) for lane in range(32)],
                            width)
    return total
