# The placement core compiled with mypyc (scheduler/placement/native.py) and the agent's launch helper
# (agents/agent/jobexec.c), in a stage of their own: the image itself carries no compiler. The same base
# image, so the build's interpreter digest matches.
FROM python:3.11-slim AS native
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY requirements-dev.txt .
RUN grep -E '^mypy==' requirements-dev.txt | pip install --no-cache-dir -r /dev/stdin
COPY scheduler/placement scheduler/placement
COPY scripts/native_build.py scripts/
RUN python scripts/native_build.py
COPY agents/agent/jobexec.c agents/agent/jobexec.py agents/agent/
COPY scripts/jobexec_build.py scripts/
RUN python scripts/jobexec_build.py

# One image for web, worker, beat and the node agent.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
# nftables: a multi-tenant (root) agent fences job uids off the node's services (agents/agent/netpolicy.py).
RUN apt-get update && apt-get install -y --no-install-recommends nftables && rm -rf /var/lib/apt/lists/*
COPY requirements.txt .
RUN pip install --no-cache-dir -r requirements.txt
COPY . .
COPY --from=native /app/build/native build/native
COPY --from=native /app/build/agent build/agent
RUN pip install --no-cache-dir --no-deps -e . && pip install --no-cache-dir --no-deps -e client \
    && DJANGO_SETTINGS_MODULE=gpushare.settings.dev python manage.py collectstatic --noinput -v 0
# /app/var holds local state; its subfolders are mount points (compose volumes, Kubernetes
# emptyDir/hostPath) that start owned by the gpushare user.
RUN useradd --system --uid 1000 gpushare \
    && mkdir -p /app/var/agent /app/var/credential /app/var/heartbeat /app/var/metrics /app/var/nodelink \
    && chown -R gpushare /app/var
USER gpushare
EXPOSE 8000 8001
# Web: gpushare's server (granian; multiprocess metrics, no access log: gpushare.request logs).
CMD ["python", "-m", "gpushare.serve"]
