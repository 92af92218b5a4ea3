# One image for every Settled process: migrate, worker, beat, web and the simulator.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY outbox ./outbox
COPY workers ./workers
COPY reconciler ./reconciler
RUN pip install . && useradd --create-home --uid 10001 settled && mkdir -p /app/var /data \
    && chown settled /app/var /data
USER settled
CMD ["settled", "--help"]
