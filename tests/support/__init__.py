"""What the tests share: servers and topologies, processes and probes, polling, the
command line, the gateway stack. Each helper is defined once here and imported as
``support.<module>`` (pyproject puts tests/ on the tests' import path)."""
