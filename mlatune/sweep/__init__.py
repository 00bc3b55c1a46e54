"""The sweep, one file per stage, in the order a sweep runs them:

- ``spec``: the sweep spec (problems, budget, tolerances);
- ``candidates``: what to run (``Candidate``: a route and parameters on a problem),
  from the spec and the routes' rules; shares (``Shard``) and input seeds;
- ``compile_ahead``: which candidates compile the kernels before timing;
- ``runner``: the worker processes that check and time candidates (``worker``,
  ``bench``), a crash or hang recorded and the sweep going on;
- ``dcp_stage``, ``dcp_group``, ``dcp_graph``: DCP steps measured across a group of
  processes, eagerly or from a CUDA graph;
- ``journal``: every result as it arrives; ``records``: results as the table reads
  them, with the one problem identity (``records.problem_key``);
- ``merge`` (ranks' partials), ``refine`` (points to add), ``planning`` (`mlatune plan`).
"""
