# One image for every Settled process: migrate, worker, beat, web and the simulator.
# Every dependency, the build backend included, is pinned by constraints.txt, generated from
# pyproject.toml (the command is in its header; regenerate it whenever pyproject.toml changes).

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY constraints.txt pyproject.toml README.md ./
COPY outbox ./outbox
COPY workers ./workers
COPY reconciler ./reconciler
COPY settled ./settled
# The pinned build backend, then the wheel built with it (no unpinned isolated build env).
RUN pip install --constraint constraints.txt hatchling \
    && pip wheel --no-deps --no-build-isolation --wheel-dir /wheels .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY constraints.txt ./
COPY docker/healthcheck.py ./healthcheck.py
COPY --from=build /wheels /wheels
RUN pip install --constraint constraints.txt /wheels/*.whl && pip check && rm -rf /wheels \
    && useradd --create-home --uid 10001 settled && mkdir -p /app/var /data \
    && chown settled /app/var /data
USER settled
# Checks whichever process the container runs (web, worker, beat, simulator; see the script).
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "/app/healthcheck.py"]
CMD ["settled", "--help"]
