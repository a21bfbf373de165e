# gnnstream worker image: `docker build -t gnnstream .`
#   docker run gnnstream --help          # the CLI (ENTRYPOINT is `gnnstream`)
#   docker run gnnstream run ...         # the streaming worker (the default command)
# The stack around it (Kafka, Prometheus, Grafana) is docker-compose.yml;
# see docs/deployment.md.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# 1. torch, CPU-only build, in its own layer (by far the largest one; it stays
#    cached while the pin in pyproject.toml does not change).
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

WORKDIR /tmp/gnnstream-src

# 2. The other pinned dependencies, read from pyproject.toml, so that editing
#    the source does not reinstall them.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# 3. The package itself (a regular, non-editable install; pure Python), then drop the sources.
COPY gnnstream ./gnnstream
COPY stream ./stream
COPY graph_state ./graph_state
COPY model ./model
COPY workers ./workers
COPY fraud ./fraud
RUN pip install . && rm -rf /tmp/gnnstream-src

# Unprivileged user; /var/lib/gnnstream (graph state) and /models (model
# directories) belong to it, so fresh named volumes mounted there do too.
RUN groupadd --system --gid 10001 gnnstream \
    && useradd --system --uid 10001 --gid gnnstream --home-dir /var/lib/gnnstream --no-create-home \
        --shell /usr/sbin/nologin gnnstream \
    && mkdir -p /var/lib/gnnstream /models \
    && chown gnnstream:gnnstream /var/lib/gnnstream /models

ENV GNNSTREAM_STATE=/var/lib/gnnstream/state \
    GNNSTREAM_METRICS_PORT=9108

USER gnnstream
WORKDIR /var/lib/gnnstream
VOLUME ["/var/lib/gnnstream"]
EXPOSE 9108

# 200 while the worker loop is alive (see workers/metrics.py); urllib raises,
# so the probe fails, on 503 or when nothing listens.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('GNNSTREAM_METRICS_PORT', '9108'), timeout=3)"]

ENTRYPOINT ["gnnstream"]
CMD ["run"]
