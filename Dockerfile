# redisbal: one image for every role (coordinator, engine-sim, api, status, demo)
# and, in the `test` stage, for running the test suite.
#
#   docker build -t redisbal .                  # runtime image
#   docker build --target test -t redisbal:test .
#
# Debian's redis-server / redis-tools / openssl are in the image so that
# `redisbal demo` runs without a URL and the cluster, sentinel and TLS tests can
# start their own servers.
FROM python:3.11-slim-bookworm AS runtime

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server redis-tools openssl \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY redisbal ./redisbal
RUN pip install '.[metrics,gateway,tracing]'

RUN useradd --create-home --uid 10001 redisbal
USER redisbal
EXPOSE 9100 8310 8311 8400-8403
ENTRYPOINT []
CMD ["redisbal", "--help"]

FROM runtime AS test
USER root
RUN pip install '.[dev]'
COPY tests ./tests
COPY scripts ./scripts
COPY docs ./docs
COPY CHANGELOG.md ./
COPY docker-compose.yml ./
RUN chown -R redisbal /app
USER redisbal
CMD ["pytest", "-q", "tests"]
