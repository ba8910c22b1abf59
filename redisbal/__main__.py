"""``python -m redisbal``: the same as the ``redisbal`` console script."""

from redisbal.cli import main

main()
