"""An input serializer whose fields are built once per thread (gpushare.serializers.FieldsBuiltOnce) judges
every payload as a serializer built afresh does, one payload after another and from several threads."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from rest_framework import serializers

from scheduler.api.serializers import JobCreateSerializer

PAYLOADS = [
    {"kind": "training", "gpus": 2, "command": ["python", "train.py"]},
    {"kind": "inference", "gpus": 0.25, "command": ["serve"], "env": {"A": "1"}, "name": "x"},
    {"kind": "nonsense", "gpus": 1, "command": ["true"]},
    {"kind": "training", "gpus": 0.3, "command": []},
    {"kind": "training", "gpus": 1, "command": [1, 2], "env": {"A": 1}},
    {"kind": "inference", "gpus": 0.5, "command": ["true"], "image": "bad image name!!"},
    {"kind": "training", "gpus": 1, "command": ["true"], "array": {"count": 3}},
    {"kind": "training", "gpus": 1, "command": ["true"], "array": {"count": 0}},
]


class Fresh(JobCreateSerializer):
    fields = serializers.Serializer.__dict__["fields"]  # DRF's own: the fields deep-copied for each instance


def judged(serializer_class, payload) -> tuple:
    serializer = serializer_class(data=payload)
    valid = serializer.is_valid()
    return (valid, {k: [str(m) for m in v] for k, v in serializer.errors.items()} if not valid else None)


def test_shared_fields_judge_each_payload_as_fresh_ones_do():
    first, second = Fresh(data={}), Fresh(data={})
    assert first.fields["kind"] is not second.fields["kind"]
    expected = [judged(Fresh, p) for p in PAYLOADS]
    assert [judged(JobCreateSerializer, p) for p in PAYLOADS * 3] == expected * 3
    assert sum(1 for valid, _ in expected if valid) == 3  # both outcomes are compared

    def run(offset: int) -> list:
        order = PAYLOADS[offset:] + PAYLOADS[:offset]
        return [judged(JobCreateSerializer, p) for p in order * 20]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, range(4)))
    for offset, result in enumerate(results):
        assert result == (expected[offset:] + expected[:offset]) * 20
