"""The node agent's Prometheus series, health and readiness (no Django; prometheus-client).

Per GPU, named as NVIDIA's dcgm-exporter names them where the meaning is the
same, with its labels (``gpu``, ``UUID``, ``device``, ``modelName``,
``Hostname``), so existing GPU dashboards and alerts work unchanged:

| series | unit | what |
|---|---|---|
| ``DCGM_FI_DEV_GPU_UTIL`` | % | GPU utilisation |
| ``DCGM_FI_DEV_FB_USED`` / ``DCGM_FI_DEV_FB_FREE`` | MiB | framebuffer memory used / free |
| ``DCGM_FI_DEV_POWER_USAGE`` | W | power draw |
| ``DCGM_FI_DEV_GPU_TEMP`` | °C | temperature |
| ``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION`` | mJ | energy since the driver (or simulator) started |
| ``DCGM_FI_DEV_XID_ERRORS`` | | the last XID seen (0: none), as in dcgm-exporter |
| ``gpushare_gpu_xid_errors_total{xid}`` | | how many of each XID this agent saw (dcgm has no count) |

Per job on a GPU (labels ``job``, ``attempt``, ``tenant``, ``mode`` and the GPU's):

| series | what |
|---|---|
| ``gpushare_job_sm_util_percent`` | the job's SM utilisation, percent of the whole GPU |
| ``gpushare_job_sm_share`` | the share of the GPU the job holds (1 dedicated, 0.5/0.25/0.125 a slice) |
| ``gpushare_job_fb_used_mib`` | GPU memory the job's processes hold |
| ``gpushare_job_energy_joules_total`` | energy attributed to the job (a shared GPU's split by SM use) |

The agent itself: ``gpushare_agent_outbox_messages`` (reports not yet
delivered), ``gpushare_agent_broker_connected`` (1/0),
``gpushare_agent_jobs_running``, ``gpushare_agent_last_sample_timestamp_seconds``.

A job's series go when it ends. ``/healthz`` fails when the sampling loop
has not run for a while (a hung agent gets restarted); ``/readyz`` fails
while the broker is unreachable (the agent keeps working and spooling).
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from . import __version__
from .health import XID

GPU_LABELS = ["gpu", "UUID", "device", "modelName", "Hostname"]
JOB_LABELS = ["job", "attempt", "tenant", "mode", *GPU_LABELS]


class AgentMetrics:
    def __init__(self, agent):
        self.agent = agent
        self.node = agent.config.node
        self.lock = threading.Lock()
        self.gpu_rows: list[tuple[list[str], object, int]] = []  # (labels, sample, memory_mb)
        self.job_rows: list[tuple[list[str], float, float, int]] = []  # (labels, sm %, share, memory MiB)
        self.energy_j: dict[tuple, float] = {}  # (job, attempt, tenant, mode) -> joules
        self.xid_counts: dict[tuple[str, int], int] = {}
        self.last_xid: dict[str, int] = {}
        self.outbox = 0
        self.last_sample = 0.0  # wall clock
        self.last_tick = time.monotonic()
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.registry.register(self)
        self.server = None

    def _gpu_labels(self, uuid: str) -> list[str]:
        gpu = self.agent.gpus.get(uuid)
        index = str(gpu.index) if gpu else ""
        return [index, uuid, f"nvidia{index}", gpu.model if gpu else "", self.node]

    # --- called by the agent's loop (its own thread) ------------------------------------------

    def observe(self, *, samples: dict, running: list, energy_mj: dict[int, float]) -> None:
        if self.server is None:
            return  # nobody can scrape: spare the loop the work (and the outbox count)
        gpu_rows, job_rows = [], []
        for uuid, sample in samples.items():
            gpu = self.agent.gpus.get(uuid)
            gpu_rows.append((self._gpu_labels(uuid), sample, gpu.memory_mb if gpu else 0))
            for event in sample.health_events:
                if event.get("kind") == XID:
                    xid = int(event.get("xid", 0))
                    self.xid_counts[(uuid, xid)] = self.xid_counts.get((uuid, xid), 0) + 1
                    self.last_xid[uuid] = xid
        alive = set()
        for job in running:
            spec = job.spec
            key = (str(spec.job_id), str(spec.attempt), spec.tenant, spec.mode)
            alive.add(key)
            self.energy_j[key] = self.energy_j.get(key, 0.0) + energy_mj.get(spec.job_id, 0.0) / 1000
            for uuid in spec.gpu_uuids:
                use = samples[uuid].jobs.get(spec.job_id) if uuid in samples else None
                job_rows.append(
                    (
                        [*key, *self._gpu_labels(uuid)],
                        use.sm_util if use else 0.0,
                        spec.share_milli / 1000,
                        use.memory_mb if use else 0,
                    )
                )
        with self.lock:
            self.gpu_rows, self.job_rows = gpu_rows, job_rows
            self.energy_j = {k: v for k, v in self.energy_j.items() if k in alive}
            self.outbox = self.agent.spool.pending()
            self.last_sample = time.time()
            self.last_tick = time.monotonic()

    # --- read by a scrape (the ops server's thread) -------------------------------------------

    def collect(self):
        with self.lock:
            gpu_rows, job_rows, energy = list(self.gpu_rows), list(self.job_rows), dict(self.energy_j)
            xid_counts, last_xid, outbox, last_sample = (
                dict(self.xid_counts),
                dict(self.last_xid),
                self.outbox,
                self.last_sample,
            )

        def gauge(name, doc, labels=GPU_LABELS):
            return GaugeMetricFamily(name, doc, labels=labels)

        util = gauge("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).")
        used = gauge("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).")
        free = gauge("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).")
        power = gauge("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).")
        temp = gauge("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).")
        # A counter under dcgm-exporter's exact name (no ``_total``), as it exposes it.
        energy_dev = Metric(
            "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "Total energy consumption since boot (in mJ).", "counter"
        )
        xid_last = gauge("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.")
        xids = CounterMetricFamily(
            "gpushare_gpu_xid_errors", "XID errors seen by this agent, by XID.", labels=[*GPU_LABELS, "xid"]
        )
        for labels, sample, memory_mb in gpu_rows:
            uuid = labels[1]
            if sample.util is not None:
                util.add_metric(labels, sample.util)
            if sample.memory_used_mb is not None:
                used.add_metric(labels, sample.memory_used_mb)
                if memory_mb:
                    free.add_metric(labels, max(0, memory_mb - sample.memory_used_mb))
            if sample.power_w is not None:
                power.add_metric(labels, sample.power_w)
            if sample.temperature_c is not None:
                temp.add_metric(labels, sample.temperature_c)
            if sample.energy_mj is not None:
                energy_dev.add_sample(energy_dev.name, dict(zip(GPU_LABELS, labels, strict=True)), sample.energy_mj)
            xid_last.add_metric(labels, last_xid.get(uuid, 0))
            for (xid_uuid, xid), count in sorted(xid_counts.items()):
                if xid_uuid == uuid:
                    xids.add_metric([*labels, str(xid)], count)
        yield from (util, used, free, power, temp, energy_dev, xid_last, xids)

        sm = gauge("gpushare_job_sm_util_percent", "The job's SM utilisation, percent of the whole GPU.", JOB_LABELS)
        share = gauge("gpushare_job_sm_share", "Share of the GPU the job holds (1: dedicated).", JOB_LABELS)
        memory = gauge("gpushare_job_fb_used_mib", "GPU memory held by the job's processes (MiB).", JOB_LABELS)
        for labels, sm_util, held, memory_mb in job_rows:
            sm.add_metric(labels, sm_util)
            share.add_metric(labels, held)
            memory.add_metric(labels, memory_mb)
        joules = CounterMetricFamily(
            "gpushare_job_energy_joules",
            "Energy attributed to the job on this node (J).",
            labels=["job", "attempt", "tenant", "mode", "Hostname"],
        )
        for key, value in sorted(energy.items()):
            joules.add_metric([*key, self.node], value)
        yield from (sm, share, memory, joules)

        node = ["Hostname"]
        yield _one(
            GaugeMetricFamily("gpushare_agent_outbox_messages", "Reports waiting in the outbox.", labels=node),
            self.node,
            outbox,
        )
        connected = 1 if self.agent.link.connected else 0
        yield _one(
            GaugeMetricFamily("gpushare_agent_broker_connected", "1 when connected to the broker.", labels=node),
            self.node,
            connected,
        )
        yield _one(
            GaugeMetricFamily("gpushare_agent_jobs_running", "Jobs running on this node.", labels=node),
            self.node,
            len(self.agent.jobs),
        )
        yield _one(
            GaugeMetricFamily(
                "gpushare_agent_last_sample_timestamp_seconds", "When the GPUs were last sampled.", labels=node
            ),
            self.node,
            last_sample,
        )
        info = GaugeMetricFamily(
            "gpushare_agent_info", "The agent's version and GPU backend.", labels=["Hostname", "version", "backend"]
        )
        info.add_metric([self.node, __version__, self.agent.backend.name], 1)
        yield info

    # --- health and the server ----------------------------------------------------------------

    def live(self) -> tuple[bool, dict]:
        stale_s = max(10.0, 10 * self.agent.config.sample_interval_s)
        age = time.monotonic() - self.last_tick
        ok = age < stale_s
        return ok, {"ok": ok, "loop_age_s": round(age, 1), **({} if ok else {"reason": "the sampling loop is stuck"})}

    def ready(self) -> tuple[bool, dict]:
        connected = bool(self.agent.link.connected)
        body = {"ready": connected, "checks": {"broker": "ok" if connected else "unreachable (reports are spooled)"}}
        return connected, body

    def serve(self) -> None:
        config = self.agent.config
        port = getattr(config, "metrics_port", 0)
        if not port:
            return
        from .opsserver import OpsServer

        self.server = OpsServer(
            host=config.metrics_address,
            port=port,
            live=self.live,
            ready=self.ready,
            registry=self.registry,
            token=config.metrics_token,
        ).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def _one(family: GaugeMetricFamily, node: str, value: float) -> GaugeMetricFamily:
    family.add_metric([node], value)
    return family
