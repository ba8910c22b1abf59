"""Ways for unmodified engines to report: a vLLM stat-logger plugin and a /metrics sidecar.

Both hand counts to :class:`redisbal.integrations.relay.ReportSender`, which never
does network I/O on the caller's thread. Nothing in the library imports this package.
"""
