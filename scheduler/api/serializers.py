"""REST v1 shapes for jobs. Serializers validate shape; services enforce rules."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from agents.agent.imageref import image_check
from gpushare.serializers import FieldsBuiltOnce, StrictStrings, money_exact

from ..arrays import MAX_TASKS, ArrayError, ArraySpec, array_parse
from ..models import MILLI_PER_GPU, Job, JobArray, JobKind, JobState
from ..selectors import job_gpu_uuids
from ..services import JobSpec
from .selectors import JOB_API_COLUMNS, queue_positions_page

MAX_COMMAND_ARGS = 1000
MAX_ARG_LEN = 8192
MAX_ENV = 200
RESERVED_ENV_PREFIXES = ("CUDA_", "NVIDIA_", "GPUSHARE_", "LD_")
# Names that steer a runtime rather than the job's program (docs/operator-guide.md, "Security model"):
# the dynamic loader and glibc, and the docker client. Refused with the reason, never silently dropped.
STEERING_ENV = {
    "LD_": "it steers the dynamic loader",
    "DOCKER_": "it steers the docker client",
    "GCONV_PATH": "it makes glibc load code from a path",
    "GLIBC_TUNABLES": "it tunes glibc's loader and allocator",
    "CUDA_": "the platform sets the CUDA device and MPS variables",
    "NVIDIA_": "it steers the NVIDIA container runtime's device choice",
    "GPUSHARE_": "the platform sets GPUSHARE_ variables",
}


def env_name_refusal(key: str) -> str:
    """Why a job may not set ``key`` ("" when it may)."""
    upper = key.upper()
    for prefix, why in STEERING_ENV.items():
        if upper == prefix or (prefix.endswith("_") and upper.startswith(prefix)):
            return f"'{key}' cannot be set by a job: {why}"
    return ""


@extend_schema_field(
    {
        "oneOf": [
            {"type": "integer", "minimum": 1, "maximum": 8},
            {"type": "number", "enum": [0.125, 0.25, 0.5]},
        ]
    }
)
class GpusField(serializers.Field):
    """``gpus``: an integer count of whole GPUs, or 0.125 / 0.25 / 0.5 of one."""

    default_error_messages = {
        "invalid": "gpus must be a number: 1-8 whole GPUs, or 0.125, 0.25 or 0.5 for a shared slice",
    }

    def to_internal_value(self, data) -> int:
        if isinstance(data, bool) or not isinstance(data, int | float | str):
            self.fail("invalid")
        try:
            value = Decimal(str(data))
        except InvalidOperation:
            self.fail("invalid")
        if not value.is_finite() or value <= 0 or value > 8:
            self.fail("invalid")
        milli = value * MILLI_PER_GPU
        if milli != milli.to_integral_value():
            self.fail("invalid")
        return int(milli)

    def to_representation(self, value):
        return value


class EnvField(serializers.DictField):
    child = serializers.CharField(allow_blank=True, max_length=MAX_ARG_LEN)

    def to_internal_value(self, data):
        env = super().to_internal_value(data)
        if len(env) > MAX_ENV:
            raise serializers.ValidationError(f"at most {MAX_ENV} variables")
        for key in env:
            if not key or not key.replace("_", "a").isalnum() or key[0].isdigit() or not key.isascii():
                raise serializers.ValidationError(f"'{key}' is not a valid variable name (letters, digits, _)")
            refusal = env_name_refusal(key)
            if refusal:
                raise serializers.ValidationError(refusal)
        return env


@extend_schema_field(
    {
        "oneOf": [
            {
                "type": "object",
                "properties": {"count": {"type": "integer", "minimum": 1, "maximum": MAX_TASKS}},
                "required": ["count"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"range": {"type": "string", "maxLength": 400, "example": "1-1000"}},
                "required": ["range"],
                "additionalProperties": False,
            },
        ],
        "description": "Submit an array of tasks (like sbatch --array): {count: N} is indices 0..N-1; "
        '{range: "1-1000"} takes A-B, A-B:STEP and comma lists ("1,3,5-7"). Each task is a job with '
        "$GPUSHARE_ARRAY_INDEX set; the answer is the array (see /api/v1/arrays/).",
    }
)
class ArrayField(serializers.Field):
    """``array``: ``{"count": N}`` or ``{"range": "1-1000"}`` (scheduler.arrays has the grammar)."""

    def to_internal_value(self, data) -> ArraySpec:
        try:
            return array_parse(data)
        except ArrayError as exc:
            raise serializers.ValidationError(str(exc)) from exc

    def to_representation(self, value):
        return value


class JobCreateSerializer(FieldsBuiltOnce, StrictStrings, serializers.Serializer):
    name = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    kind = serializers.ChoiceField(choices=JobKind.choices)
    gpus = GpusField()
    command = serializers.ListField(
        child=serializers.CharField(max_length=MAX_ARG_LEN, allow_blank=True),
        min_length=1,
        max_length=MAX_COMMAND_ARGS,
    )
    image = serializers.CharField(max_length=300, required=False, allow_blank=True, default="")
    env = EnvField(required=False, default=dict)
    gpu_model = serializers.CharField(max_length=64, required=False, allow_blank=True, default="")
    gpu_memory_mb = serializers.IntegerField(min_value=1, max_value=10_000_000, required=False, allow_null=True)
    priority = serializers.CharField(max_length=50, required=False, allow_blank=True, default="")
    max_runtime_seconds = serializers.IntegerField(min_value=1, max_value=90 * 24 * 3600, required=False)
    array = ArrayField(required=False)

    def validate_image(self, value: str) -> str:
        problem = image_check(value)
        if problem:
            raise serializers.ValidationError(problem)
        return value

    def validate(self, attrs: dict) -> dict:
        if attrs.get("image"):
            broken = sorted(k for k, v in attrs.get("env", {}).items() if "\n" in v or "\r" in v)
            if broken:
                raise serializers.ValidationError(
                    {"env": f"an image job's variables cannot hold line breaks ({', '.join(broken)})"}
                )
        return attrs

    @staticmethod
    def spec(v: dict) -> JobSpec:
        """The service's job spec from this serializer's validated data (API and portal form alike)."""
        return JobSpec(
            kind=v["kind"],
            gpu_milli=v["gpus"],
            command=v["command"],
            name=v["name"],
            env=v["env"],
            image=v["image"],
            gpu_model=v["gpu_model"],
            gpu_memory_mb=v.get("gpu_memory_mb"),
            priority=v["priority"],
            max_runtime_s=v.get("max_runtime_seconds"),
        )


class JobUsageSerializer(serializers.Serializer):
    gpu_seconds = serializers.FloatField(help_text="Allocated GPU-seconds (x the fraction for a slice).")
    sm_util_avg = serializers.FloatField(allow_null=True, help_text="Mean SM utilisation over the job's GPUs, %.")
    memory_peak_mb = serializers.IntegerField()
    energy_wh = serializers.FloatField()


ISOLATION_CHOICES = ["exclusive", "mig", "mps", "none"]


class JobArrayRefSerializer(serializers.Serializer):
    id = serializers.IntegerField(help_text="The array (GET /api/v1/arrays/{id}/).")
    index = serializers.IntegerField(help_text="This task's index: $GPUSHARE_ARRAY_INDEX in its environment.")


class JobArraySerializer(serializers.ModelSerializer):
    """An array as the API shows it (its shape, for the schema; :func:`job_array_body` writes it); ``states``
    (task count per state) comes from ``states_by_array`` in the context (one query for a whole page)."""

    states = serializers.DictField(child=serializers.IntegerField(), read_only=True)
    tasks = serializers.CharField(read_only=True)

    class Meta:
        model = JobArray
        fields = ["id", "name", "indices", "task_count", "submitted_at", "states", "tasks"]
        read_only_fields = fields

    def to_representation(self, instance: JobArray) -> dict:
        return job_array_body(instance, self.context.get("states_by_array", {}).get(instance.pk, {}))


def job_array_body(array: JobArray, states: dict[str, int]) -> dict:
    """An array as the API shows it (the fields of :class:`JobArraySerializer`, which renders through this),
    written out: a ModelSerializer builds its fields on every instance, ~0.4 ms an array submit."""
    return {
        "id": array.pk,
        "name": array.name,
        "indices": array.indices,
        "task_count": array.task_count,
        "submitted_at": _iso(array.submitted_at),
        "states": states,
        "tasks": f"/api/v1/jobs/?array={array.pk}",
    }


def _iso(value: datetime | None) -> str | None:
    """A datetime as DRF's DateTimeField renders it in the API's time zone, UTC (settings.TIME_ZONE; nothing
    activates another): ISO 8601 with ``Z``. Four per job on a list page: DRF's own path cost ~10 us each."""
    if value is None:
        return None
    if value.tzinfo is not UTC:  # what PostgreSQL gives is UTC already (the connection's time zone)
        value = value.astimezone(UTC)
    return value.isoformat()[:-6] + "Z"


def sm_util_tenths(sm_util_ms: int, gpu_held_ms: int) -> int:
    """Mean SM utilisation in tenths of a percent, rounded half up on the exact ratio (integers only, so the
    page PostgreSQL writes, ``page_selectors.job_page_statement``, reads the same figure)."""
    return (2000 * sm_util_ms + gpu_held_ms) // (2 * gpu_held_ms)


def energy_ten_thousandths(energy_mj: int) -> int:
    """Energy in 1/10,000 Wh (3,600,000 mJ a Wh), rounded half up, in integers (as ``sm_util_tenths``)."""
    return (2 * energy_mj + 360) // 720


def job_body(row: Mapping) -> dict:
    """A job as the API shows it, from a plain row: the columns of ``JOB_API_COLUMNS`` (``.values()`` names)
    plus ``gpu_uuids`` and ``queue_position``. A list page renders its rows with this directly (no model
    instance, no DRF field); :class:`JobSerializer` renders a model instance through it, so the two agree."""
    milli = row["gpu_milli"]
    whole, rest = divmod(milli, MILLI_PER_GPU)
    gpu_ms = row["gpu_ms"]
    held_ms = gpu_ms * MILLI_PER_GPU // milli if milli else 0
    array_id = row["array_id"]
    return {
        "id": row["id"],
        "array": None if array_id is None else {"id": array_id, "index": row["array_index"]},
        "name": row["name"],
        "kind": row["kind"],
        "gpus": whole if rest == 0 else milli / MILLI_PER_GPU,
        "mode": row["mode"],
        "state": row["state"],
        "pending_reason": row["pending_reason"],
        "queue_position": row["queue_position"] if row["state"] == JobState.QUEUED else None,
        "estimated_start": _iso(row["estimated_start_at"]),
        "priority": row["priority__name"],
        "node": row["node__name"],
        "gpu_uuids": list(row["gpu_uuids"]),
        "isolation": row["isolation"] or None,
        "command": row["command"],
        "image": row["image"],
        "gpu_model": row["gpu_model"],
        "gpu_memory_mb": row["gpu_memory_mb"],
        "max_runtime_seconds": row["max_runtime_s"],
        "submitted_at": _iso(row["submitted_at"]),
        "started_at": _iso(row["started_at"]),
        "finished_at": _iso(row["finished_at"]),
        "exit_code": row["exit_code"],
        "stop_reason": row["stop_reason"],
        "preemption_count": row["preemption_count"],
        "cost": money_exact(row["cost"]),  # the API's money is exact (docs/billing.md)
        "usage": {
            "gpu_seconds": gpu_ms / 1000,
            "sm_util_avg": sm_util_tenths(row["sm_util_ms"], held_ms * max(1, whole)) / 10 if held_ms else None,
            "memory_peak_mb": row["memory_peak_mb"],
            "energy_wh": energy_ten_thousandths(row["energy_mj"]) / 10_000,
        },
    }


# job_body's columns a model instance has as attributes (the class's and the node's names are read through them).
JOB_INSTANCE_COLUMNS = [c for c in JOB_API_COLUMNS if "__" not in c]


class JobSerializer(serializers.ModelSerializer):
    """The job as the API shows it. ``queue_positions`` in the context (job id -> position) saves a query per job;
    ``gpu_uuids`` (job id -> uuids) saves reading the allocations of a job known to hold none."""

    gpus = serializers.SerializerMethodField()
    priority = serializers.CharField(source="priority.name")
    node = serializers.CharField(source="node.name", default=None, allow_null=True)
    gpu_uuids = serializers.SerializerMethodField()
    isolation = serializers.SerializerMethodField()
    queue_position = serializers.SerializerMethodField()
    estimated_start = serializers.DateTimeField(source="estimated_start_at", allow_null=True)
    max_runtime_seconds = serializers.IntegerField(source="max_runtime_s")
    cost = serializers.SerializerMethodField()
    usage = serializers.SerializerMethodField()
    array = serializers.SerializerMethodField()

    class Meta:
        model = Job
        fields = [
            "id",
            "array",
            "name",
            "kind",
            "gpus",
            "mode",
            "state",
            "pending_reason",
            "queue_position",
            "estimated_start",
            "priority",
            "node",
            "gpu_uuids",
            "isolation",
            "command",
            "image",
            "gpu_model",
            "gpu_memory_mb",
            "max_runtime_seconds",
            "submitted_at",
            "started_at",
            "finished_at",
            "exit_code",
            "stop_reason",
            "preemption_count",
            "cost",
            "usage",
        ]
        read_only_fields = fields

    def to_representation(self, job: Job) -> dict:
        """:func:`job_body` of the instance (the same dict as DRF's field-by-field rendering,
        ``fields_representation``; a test compares them on jobs in every state)."""
        row = {column: getattr(job, column) for column in JOB_INSTANCE_COLUMNS}
        row["priority__name"] = job.priority.name
        row["node__name"] = job.node.name if job.node_id is not None else None
        row["gpu_uuids"] = self.get_gpu_uuids(job)
        row["queue_position"] = self.get_queue_position(job)
        return job_body(row)

    def fields_representation(self, job: Job) -> dict:
        """DRF's own rendering, field by field (the reference the fast path is tested against)."""
        return super().to_representation(job)

    @extend_schema_field(JobArrayRefSerializer(allow_null=True))
    def get_array(self, job: Job) -> dict | None:
        return None if job.array_id is None else {"id": job.array_id, "index": job.array_index}

    @extend_schema_field(OpenApiTypes.NUMBER)
    def get_gpus(self, job: Job):
        gpus = job.gpus
        return gpus if isinstance(gpus, int) else float(gpus)

    @extend_schema_field(serializers.ListField(child=serializers.CharField()))
    def get_gpu_uuids(self, job: Job) -> list[str]:
        annotated = getattr(job, "api_gpu_uuids", None)  # scheduler.api.selectors.with_api_fields
        if annotated is not None:
            return list(annotated)
        known = self.context.get("gpu_uuids", {}).get(job.pk)
        return known if known is not None else job_gpu_uuids(job)

    @extend_schema_field(serializers.ChoiceField(choices=ISOLATION_CHOICES, allow_null=True))
    def get_isolation(self, job: Job) -> str | None:
        return job.isolation or None

    @extend_schema_field(serializers.IntegerField(allow_null=True, min_value=1))
    def get_queue_position(self, job: Job) -> int | None:
        if job.state != JobState.QUEUED:
            return None
        if hasattr(job, "api_queue_position"):  # scheduler.api.selectors.with_api_fields
            return job.api_queue_position
        positions = self.context.get("queue_positions")
        if positions is None:
            positions = queue_positions_page(tenant=job.tenant_id, job_ids=[job.pk])  # raw SQL, no ORM build
        return positions.get(job.pk)

    @extend_schema_field(serializers.DecimalField(max_digits=20, decimal_places=10, coerce_to_string=True))
    def get_cost(self, job: Job) -> str:
        return money_exact(job.cost)  # the API's money is exact (docs/billing.md)

    @extend_schema_field(JobUsageSerializer)
    def get_usage(self, job: Job) -> dict:
        seconds = job.gpu_ms / 1000
        held_ms = job.gpu_ms * MILLI_PER_GPU // job.gpu_milli if job.gpu_milli else 0
        return {
            "gpu_seconds": round(seconds, 3),
            "sm_util_avg": round(job.sm_util_ms / held_ms / job.gpu_count * 100, 1) if held_ms else None,
            "memory_peak_mb": job.memory_peak_mb,
            "energy_wh": round(job.energy_mj / 3_600_000, 4),
        }


class JobLogSerializer(serializers.Serializer):
    job = serializers.IntegerField()
    offset = serializers.IntegerField(help_text="The byte offset this answer starts at.")
    next_offset = serializers.IntegerField(help_text="Ask again from here to follow the log.")
    data = serializers.CharField(help_text="Log text (UTF-8; undecodable bytes replaced).")
    complete = serializers.BooleanField(help_text="The job has ended and every byte of its log is here.")


class MetricPointSerializer(serializers.Serializer):
    start_ms = serializers.IntegerField()
    end_ms = serializers.IntegerField()
    sm_util_pct = serializers.FloatField()
    memory_avg_mb = serializers.IntegerField()
    memory_peak_mb = serializers.IntegerField()
    power_w = serializers.FloatField()
    gpu_seconds = serializers.FloatField()


class JobMetricsSerializer(serializers.Serializer):
    job = serializers.IntegerField()
    bucket_ms = serializers.IntegerField(help_text="Width of a point in ms (windows are merged to bound the size).")
    points = MetricPointSerializer(many=True)
