"""An engine's decode loop around ``mlatune.attention.decode``.

    python examples/engine_loop.py            # on a GPU: CUDA graphs, the bundled table
    python examples/engine_loop.py --cpu      # tiny sizes on the CPU (Triton interpreter)

What a serving engine does, in miniature:
- at model load: a paged latent KV cache per layer, a dispatcher (the bundled
  table for this GPU, or rules on the CPU), and per batch-size bucket persistent
  buffers (q, block table, lengths, one out per layer) plus, on a GPU, one CUDA
  graph captured per bucket after an eager warm-up step;
- every step: requests come and go, each running one more token; the step's
  lengths and block-table rows are written into the bucket's buffers in place,
  and the graph is replayed (or ``decode`` called eagerly on the CPU). The
  layers share the step's plan: the first plans, the others pass
  ``reuse_plan=True``;
- now and then a step is checked against mlatune's torch reference.

The softmax scale is the model's own: DeepSeek-V3's YaRN rope scaling multiplies
``qk_head_dim ** -0.5`` by mscale squared.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
from dataclasses import dataclass

if "--cpu" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from mlatune import attention
from mlatune.arch import cpu_device
from mlatune.check import reference
from mlatune.check.accuracy import check
from mlatune.check.inputs import DecodeInputs, KVShard
from mlatune.dispatch import Dispatcher
from mlatune.problem import MLAProblem

KV_LORA_RANK, ROPE_DIM, QK_HEAD_DIM = 512, 64, 192


def deepseek_softmax_scale(factor: float = 40.0, mscale_all_dim: float = 1.0) -> float:
    """DeepSeek-V3's attention scale under YaRN rope scaling."""
    mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
    return QK_HEAD_DIM ** -0.5 * mscale * mscale


@dataclass
class Bucket:
    """Persistent buffers for batches of up to ``size`` requests, and their graph."""

    size: int
    q: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    outs: list[torch.Tensor]  # one per layer
    graph: torch.cuda.CUDAGraph | None = None


@dataclass
class Config:
    device: str
    dtype: torch.dtype
    heads: int
    layers: int
    page_size: int
    max_pages_per_request: int
    buckets: tuple[int, ...]
    steps: int
    check_every: int


GPU = Config("cuda", torch.bfloat16, 16, 4, 64, 64, (1, 8, 32), 40, 10)
CPU = Config("cpu", torch.float16, 4, 2, 8, 4, (1, 2), 6, 3)


class Engine:
    def __init__(self, cfg: Config, dispatcher: Dispatcher, scale: float):
        self.cfg, self.dispatcher, self.scale = cfg, dispatcher, scale
        pages = max(cfg.buckets) * cfg.max_pages_per_request
        self.kv_caches = [torch.randn(pages, cfg.page_size, KV_LORA_RANK + ROPE_DIM,
                                      device=cfg.device).to(cfg.dtype)
                          for _ in range(cfg.layers)]
        self.free_pages = list(range(pages))
        random.shuffle(self.free_pages)
        self.buckets = [self._bucket(n) for n in cfg.buckets]

    def _bucket(self, size: int) -> Bucket:
        cfg = self.cfg
        return Bucket(
            size,
            q=torch.empty(size, cfg.heads, KV_LORA_RANK + ROPE_DIM, dtype=cfg.dtype,
                          device=cfg.device),
            block_table=torch.zeros(size, cfg.max_pages_per_request, dtype=torch.int32,
                                    device=cfg.device),
            seq_lens=torch.ones(size, dtype=torch.int32, device=cfg.device),
            outs=[torch.empty(size, cfg.heads, KV_LORA_RANK, dtype=cfg.dtype, device=cfg.device)
                  for _ in range(cfg.layers)])

    @property
    def max_len(self) -> int:
        return self.cfg.max_pages_per_request * self.cfg.page_size

    def attend(self, bucket: Bucket) -> None:
        """The model's attention calls, one per layer (what the graph captures); the
        first layer plans the step, the others read its plan."""
        for layer, (kv_cache, out) in enumerate(zip(self.kv_caches, bucket.outs,
                                                    strict=True)):
            attention.decode(bucket.q, kv_cache, bucket.block_table, bucket.seq_lens,
                             num_heads=self.cfg.heads, softmax_scale=self.scale, out=out,
                             max_kv_len=self.max_len, reuse_plan=layer > 0,
                             capturable=bucket.graph is not None or self.cfg.device == "cuda",
                             dispatcher=self.dispatcher)

    def capture(self) -> None:
        """Per bucket: an eager warm-up step (chooses and prepares the route), then a graph."""
        for bucket in self.buckets:
            self.attend(bucket)
            bucket.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(bucket.graph):
                self.attend(bucket)

    def step(self, requests: list[dict]) -> Bucket:
        """Write this step's requests into the smallest bucket that holds them, and run."""
        bucket = next(b for b in self.buckets if b.size >= len(requests))
        lens = [r["len"] for r in requests] + [1] * (bucket.size - len(requests))
        rows = [r["pages"] + [0] * (self.cfg.max_pages_per_request - len(r["pages"]))
                for r in requests]
        rows += [[0] * self.cfg.max_pages_per_request] * (bucket.size - len(requests))
        bucket.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        bucket.block_table.copy_(torch.tensor(rows, dtype=torch.int32))
        bucket.q.copy_(torch.randn(bucket.q.shape).to(bucket.q.dtype))  # this step's queries
        if bucket.graph is not None:
            bucket.graph.replay()
        else:
            self.attend(bucket)
        return bucket

    def new_request(self) -> dict:
        length = random.randint(1, self.max_len // 2)
        pages = [self.free_pages.pop() for _ in range(-(-length // self.cfg.page_size))]
        return {"len": length, "pages": pages}

    def grow(self, request: dict) -> bool:
        """One more token; False when the request is done (its pages go back)."""
        if request["len"] >= self.max_len or random.random() < 0.1:
            self.free_pages.extend(request["pages"])
            return False
        request["len"] += 1
        if len(request["pages"]) * self.cfg.page_size < request["len"]:
            request["pages"].append(self.free_pages.pop())
        return True

    def check(self, bucket: Bucket) -> None:
        problem = MLAProblem(num_heads=self.cfg.heads, batch=bucket.size, kv_len=self.max_len,
                             q_dtype=_name(self.cfg.dtype), kv_dtype=_name(self.cfg.dtype),
                             page_size=self.cfg.page_size)
        for layer, (kv_cache, out) in enumerate(zip(self.kv_caches, bucket.outs,
                                                    strict=True)):
            shard = KVShard(0, kv_cache, bucket.block_table, bucket.seq_lens)
            inputs = DecodeInputs(problem, bucket.q, None, None, bucket.seq_lens, (shard,),
                                  sm_scale=self.scale)
            want = reference.run(inputs, torch.float64)[0]
            accuracy = check(problem, out, want)
            if not accuracy.ok:
                raise AssertionError(f"batch bucket {bucket.size}, layer {layer}: "
                                     f"{accuracy.reason}")


def _name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def run(cfg: Config, seed: int = 0) -> int:
    """Serve ``cfg.steps`` decode steps; returns how many were checked."""
    random.seed(seed)
    torch.manual_seed(seed)
    if cfg.device == "cuda":
        dispatcher = Dispatcher.from_bundled()
    else:
        dispatcher = Dispatcher.rules_only(cpu_device())
    engine = Engine(cfg, dispatcher, deepseek_softmax_scale())
    if cfg.device == "cuda":
        engine.capture()
    return serve(engine, cfg)


def serve(engine: Engine, cfg: Config) -> int:
    """``cfg.steps`` decode steps, requests arriving and finishing at random; how many
    steps were checked against the reference."""
    requests: list[dict] = []
    checked = 0
    for step in range(cfg.steps):
        while len(requests) < max(cfg.buckets) and random.random() < 0.5:
            requests.append(engine.new_request())
        requests = requests or [engine.new_request()]
        bucket = engine.step(requests)
        if step % cfg.check_every == 0:
            engine.check(bucket)
            checked += 1
        requests = [r for r in requests if engine.grow(r)]
    return checked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="tiny sizes on the CPU")
    args = parser.parse_args()
    cfg = CPU if args.cpu or not torch.cuda.is_available() else GPU
    checked = run(cfg)
    print(f"{cfg.steps} decode steps on {cfg.device}, {checked} checked against the reference")


if __name__ == "__main__":
    main()
