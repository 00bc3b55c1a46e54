"""The seesaw decode's balanced form's host side on the CPU: ``decode_launcher(form=
"balanced")`` with the device plan and the reduce run for real (the Triton interpreter) and
the Gluon kernel stood in for by what its programs compute (each item's attention over its
own keys, written in place or into its slot as the kernel's epilogue addresses them).

So the launch's wiring is checked apart from the kernel: the kernel's arguments in its
signature's order, the partials' layout and strides, the reduce's groups and slots, a
request of one item left in place, an empty request written empty by the reduce; the
result against the reference. (The kernel itself: tests/test_gluon_gpu.py on the GPU.)
"""

from __future__ import annotations

import math

import pytest
import torch

from mlatune.check import reference
from mlatune.check.accuracy import check
from mlatune.check.inputs import make_decode_inputs, poison_
from mlatune.kernels import gluon_hopper
from mlatune.problem import MLAProblem

gluon_seesaw = pytest.importorskip("mlatune.kernels.gluon_seesaw")
KERNEL_ARGS = gluon_seesaw.seesaw_kernel.arg_names  # the real kernel's, in order


class _Programs:
    """Stands in for ``seesaw_kernel``: ``[grid](*args, **meta)`` computes what the balanced
    form's programs write, from the arguments as the kernel takes them."""

    def __init__(self, inputs, causal: bool):
        self.inputs, self.causal, self.launches = inputs, causal, 0

    def __getitem__(self, grid):
        return lambda *args, **meta: self.run(grid, args, meta)

    def run(self, grid, args, meta) -> None:
        names = KERNEL_ARGS
        assert names[len(args)] == "TMA_OUT"  # every runtime argument, in order
        a = dict(zip(names, args, strict=False))
        assert meta["WALK"] == gluon_seesaw.WALKS["balanced"] and meta["PDL"]
        assert not meta["TMA_OUT"]  # its next item's Q fills Q's buffer: registers store
        work, indptr, split = a["work_ptr"], a["work_indptr_ptr"], a["split_indptr_ptr"]
        assert grid == (-(-a["qlen"] * a["heads"] // 64), indptr.shape[0] - 1, 1)
        part_out, part_lse, out, lse = (a["part_out_ptr"], a["part_lse_ptr"], a["out_ptr"],
                                        a["lse_ptr"])
        assert (a["stride_po_slot"], a["stride_po_row"]) == part_out.stride()[:2]
        assert a["stride_pl_slot"] == part_lse.stride(0)
        assert (a["stride_o_tok"], a["stride_o_head"], a["stride_lse_tok"]) == \
            (out.stride(0), out.stride(1), lse.stride(0))
        qlen, heads = a["qlen"], a["heads"]
        for b, start, stop, slot in work[:int(indptr[-1])].tolist():
            o, ln = self.attend(b, start, stop, qlen, a["qk_scale"] / math.log2(math.e))
            if int(split[b + 1] - split[b]) == 1:  # in place
                out[b * qlen:(b + 1) * qlen] = o.to(out.dtype)
                lse[b * qlen:(b + 1) * qlen] = ln
            else:  # the slot's rows (token, head), the LSE in base 2
                part_out[slot] = o.reshape(qlen * heads, -1)
                part_lse[slot] = (ln / math.log(2)).reshape(-1)
        self.launches += 1

    def attend(self, b: int, start: int, stop: int, qlen: int, scale: float):
        inputs = self.inputs
        shard = inputs.shards[0]
        length = int(shard.seq_lens[b])
        keys = reference.dequantize(reference._gather_pages(
            shard.kv_cache, shard.block_table[b:b + 1], length)[0], inputs.kv_scale,
            torch.float32)[:, None, :]
        tokens = torch.arange(qlen)
        last = length - qlen + tokens if self.causal else torch.full_like(tokens, length - 1)
        q = inputs.q.float().view(-1, qlen, *inputs.q.shape[1:])[b]
        return reference.attend(q, keys[start:stop], keys[start:stop, :, :512],
                                torch.arange(start, stop), last, scale)


@pytest.mark.parametrize(("heads", "qlen", "lens"), [
    (128, 1, [300, 0, 700, 64, 1, 650]),  # an empty request, one of one key
    (64, 2, [700, 2, 0, 0, 333]),  # a causal verify, two empty requests
    (32, 4, [0, 0, 0]),  # every request empty
])
def test_the_balanced_launch_plans_writes_and_merges(heads, qlen, lens, monkeypatch):
    problem = MLAProblem(num_heads=heads, batch=len(lens), kv_len=700, qlen=qlen)
    inputs = make_decode_inputs(problem, seed=sum(lens) + heads)  # pages for 700 keys
    shard = inputs.shards[0]
    new = torch.tensor(lens, dtype=torch.int32)
    inputs.seq_lens.copy_(new)
    shard.seq_lens.copy_(new)
    programs = _Programs(inputs, problem.causal)
    monkeypatch.setattr(gluon_seesaw, "seesaw_kernel", programs)
    # The stand-in kernel needs no Gluon build: any installed triton will do.
    monkeypatch.setattr(gluon_hopper, "gluon_available", lambda: (True, ""))
    # 8 SMs: requests of up to 11 tiles cut over 4 workers a row block at 128 heads.
    planner, plan = gluon_seesaw.balanced_plan(shard.seq_lens, heads=heads, qlen=qlen, sms=8)
    launch, out, lse = gluon_seesaw.decode_launcher(
        inputs.q, shard.kv_cache, shard.block_table, shard.seq_lens, qlen=qlen,
        sm_scale=inputs.softmax_scale, causal=problem.causal, form="balanced", plan=plan)
    poison_(out, lse)
    planner()
    launch()
    assert programs.launches == 1
    want_out, want_lse = reference.decode_shard(inputs, shard)
    acc = check(problem, out, want_out, lse, want_lse)
    assert acc.ok, f"{acc.reason} ({acc.summary})"
    empty = torch.tensor([n == 0 for n in lens]).repeat_interleave(qlen)
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()


def test_a_plan_of_cut_and_whole_requests():
    """The case above at 128 heads cuts some requests and leaves others whole (both paths
    run), at 8 SMs."""
    lens = torch.tensor([300, 0, 700, 64, 1, 650], dtype=torch.int32)
    planner, (_, indptr, split) = gluon_seesaw.balanced_plan(lens, heads=128, qlen=1, sms=8)
    planner()
    counts = [split[b + 1] - split[b] for b in range(len(lens))]
    assert 0 in counts and 1 in counts and max(counts) > 1
    assert indptr.shape == (5,)  # 8 SMs / 2 row blocks
