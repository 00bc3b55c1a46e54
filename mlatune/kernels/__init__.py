"""mlatune's own kernels: portable Triton kernels behind the ``*/triton`` routes and
Hopper Gluon kernels behind the ``*/gluon`` routes.

One module per concern. Decode (the absorbed form: 576-wide q·k, 512-wide v):
- ``attend``: jit building blocks every decode kernel shares (query row loads,
  the paged online-softmax walk over a key range, final row stores);
- ``split_kv``: split-KV stage 1 (a split per program, or a persistent grid
  walking a planned work list) writing per-split partials;
- ``segmented``: DCP verify stage 1, one query token per row group, writing
  (out, LSE) partials per KV segment;
- ``reduce``: merges a row's split/segment partials into out and natural-log LSE;
- ``merge``: merges DCP ranks' partial (out, LSE) by LSE;
- ``lse``: the LSE combine those merges share;
- ``empty_rows``: rows without keys rewritten as 0 and -inf after a vendor launch;
- ``plan``: the persistent work list, planned on the device from the lengths
  every step (one program; capturable), and its plain-Python reference.
Prefill: ``prefill`` (persistent varlen kernel) and ``prefill_plan`` (its host plan).
Hopper decode in Gluon (sm_90, triton 3.6): ``gluon_hopper`` (the first, 64-row tiles),
``gluon_seesaw`` (warp-specialized), ``gluon_transposed`` (keys as the MMA's M; 16-bit
caches), ``gluon_transposed_ws`` (its fp8 form with the widening in a partition of its
own) and ``gluon_transposed_fp8`` (fp8 MMAs, q as two e4m3 terms): the route's two kinds of
fp8 param sets; ``gluon_common`` holds what they share, ``gluon_hopper_plan`` their sizes and
split rule without a Triton import. ``interpreter``: Triton's interpreter spared work for the
CPU runs (the sweep's CPU workers, the tests).

Modules here import Triton at import time; routes import them lazily (in
``prepare``) so that ``import mlatune.routes`` works without Triton and tests
can switch on ``TRITON_INTERPRET`` before any kernel is decorated.
"""
