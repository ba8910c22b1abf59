"""The benchmarks (``redisbal bench``): scenarios, the vLLM baselines' emulation, the
oracle, real-time and simulated runs, the scale projection, reports and plots; the peer
routers (emulated and real) they compare against; the load generator
(``redisbal loadgen``). Built on the library and the simulator; neither imports it."""
