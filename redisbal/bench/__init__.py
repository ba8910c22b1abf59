"""The balance benchmark (``redisbal bench``): scenarios, the vLLM baselines' emulation,
the oracle, real-time and simulated runs, the scale projection, reports and plots.
Built on the library and the simulator; neither imports it."""
