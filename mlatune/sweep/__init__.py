"""The sweep, one file per stage, in the order data flows through a sweep:

- ``spec``: the sweep spec (problems, budget, tolerances);
- ``candidates``: what to run (``Candidate``: a route and parameters on a problem), from
  the spec and the routes' rules, pruned by a prior table (``Prior``, ``--prune-from``);
  shares (``Shard``) and input seeds;
- ``compile_ahead``: which candidates compile the kernels before timing;
- ``pool``: the worker processes (``WorkerProcess``: start, alive, put, get with a
  timeout, stop, kill; ``WorkerPool``: a crash or hang scored and the pool going on),
  each running ``worker`` (check, then time with ``bench``) on one ``records.Task``,
  answering a ``records.Result``, forked from a forkserver that imported torch once and
  started by ``worker_entry`` (the sweep's environment applied first); ``ray_pool``:
  the same pool with its workers as Ray actors on a cluster, one GPU each (``--ray``);
- ``runner``: the one-device pass (compiling ahead, the pool, reference fallbacks),
  every result journaled as it arrives; ``progress``: what the stages tell an
  ``Observer`` (a progress bar) as candidates start and finish;
- ``dcp_stage``, ``dcp_group``, ``dcp_graph``, ``merge``: DCP steps measured across a
  group of processes, eagerly or from a CUDA graph;
- ``journal``: every result as one JSON line after a typed header (``JournalHeader``),
  resumable; ``records``: the typed records all stages, the table and the report read
  (``Task``, ``Result``, ``Record``, ``Status``), with the one problem identity
  (``Record.problem_key``), folded into table rows (``table_rows``);
- ``stages``: the whole sweep as ``mlatune sweep`` runs it (``run_sweep``: share,
  journal, one-device pass, DCP stage, table); the CLI only parses and prints;
- beside the sweep: ``refine`` (points to add), ``planning`` (`mlatune plan`), ``at_load``
  (tuning an engine's unmeasured shapes within a budget at model load) and ``user_table``
  (its journals and its merge into the user table).

The modules import downwards only: ``records`` imports none of the others, and no other
module here imports ``stages``.
"""
