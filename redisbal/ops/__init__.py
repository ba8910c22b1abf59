"""Operating a deployment: the coordinator, status, metrics and the command line."""
