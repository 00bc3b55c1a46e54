"""The fp8-MMA kernel's V transpose layouts (``gluon_transposed_fp8``) under the shared-memory
bank model (tests/bank_model.py): each warp's 8 KB of a tile moves at the least wavefronts its
bytes need, and the key slots are one permutation of the tile's keys, the same in V^T and
P^T. Pure Python over the layouts' bases: no triton build needed beyond importing the
module."""

from __future__ import annotations

import pytest

from tests import bank_model as bm

pytestmark = pytest.mark.kernels

gluon = pytest.importorskip("triton.experimental.gluon")


def _bases(layout) -> dict[str, list[list[int]]]:
    value = getattr(layout, "value", layout)
    return {"reg": [list(b) for b in value.reg_bases],
            "lane": [list(b) for b in value.lane_bases],
            "warp": [list(b) for b in value.warp_bases]}


def _kernel():
    from mlatune.kernels import gluon_transposed_fp8 as f

    return f


def test_the_wide_layouts_move_a_warps_8_kb_without_bank_conflicts():
    """4-byte loads and 16-byte stores, each at the least wavefronts its bytes need: 64 +
    64 a warp-tile (8 KB)."""
    f = _kernel()
    load_bases, store_bases = _bases(f._V_LOAD_WIDE), _bases(f._VT_STORE_WIDE)
    assert bm.vector_width(load_bases, 1) == 4 and bm.vector_width(store_bases, 1) == 16
    load = bm.warp_wavefronts(load_bases, bm.k_tile_address, 1)
    store = bm.warp_wavefronts(store_bases, bm.vt_address, 1)
    assert (load, store) == (64, 64)


def _slot(key: int) -> int:
    return 16 * (key % 4) + key // 4


def test_each_thread_stores_what_it_loaded_at_its_keys_slots():
    """The store layout is the load layout with keys renamed to slots (``_key_slots``):
    every (register set, lane, warp) holds the same elements on both sides, so the
    conversion between them moves no data across threads."""
    f = _kernel()
    load, store = _bases(f._V_LOAD_WIDE), _bases(f._VT_STORE_WIDE)

    def held(bases, swap):
        out = {}
        for lane in range(32):
            for warp in range(4):
                elements = {bm.element(bases, r, lane, warp) for r in range(256)}
                out[lane, warp] = {(e[1], e[0]) if swap else e for e in elements}
        return out

    loaded = held(load, swap=False)  # (key, dim)
    stored = held(store, swap=True)  # (slot, dim)
    for where, elements in loaded.items():
        assert {(_slot(k), d) for k, d in elements} == stored[where]
    assert sorted(_slot(k) for k in range(64)) == list(range(64))
