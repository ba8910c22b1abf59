"""Simulation tooling: the engine model, its Redis transport, the engine-sim / api /
demo commands, simulated HTTP engines, the requests of a real-time load, an embedded
redis-server and a local cluster. Built on the library;
the library never imports it."""
