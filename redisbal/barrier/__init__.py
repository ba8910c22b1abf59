"""The barrier: the Lua operations and their loader, the records they keep and the
snapshots they publish."""
