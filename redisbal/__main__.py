"""``python -m redisbal``: the same as the ``redisbal`` console script."""

from redisbal.ops.cli import main

main()
