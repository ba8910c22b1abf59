"""The OpenAI-compatible gateway (``redisbal gateway``).

Needs the ``gateway`` extra (aiohttp, prometheus-client); the command modules
import it lazily so that ``redisbal --help`` works without it.
"""
