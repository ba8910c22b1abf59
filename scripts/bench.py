#!/usr/bin/env python3
"""Thin wrapper: ``python scripts/bench.py [options]`` is ``redisbal bench [options]``
(the balance benchmark; see docs/BENCHMARKS.md)."""

from redisbal.bench.command import main

if __name__ == "__main__":
    main()
