"""What a report (and a route) costs: the Redis cost measurements behind
docs/BENCHMARKS.md, one command with modes (``python scripts/redis_cost.py MODE``):

- ``core``: route() per call, a router adopting a snapshot, Redis server time per
  report four ways, report -> snapshot latency at every router;
- ``batch``: Redis CPU per engine-step, one report per round trip against report_many;
- ``ab``: route() and report server time of two checkouts, interleaved, as ratios;
- ``callgrind``: instructions per report under valgrind (deterministic);
- ``lua``: where a report_many call's and a publish's server time goes, by stage.
"""
