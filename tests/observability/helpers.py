"""Reading Prometheus text with prometheus-client's own parser, and small process helpers."""

from __future__ import annotations

import requests
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str, token: str = "") -> dict[str, list[tuple[dict, float]]]:
    """``{sample name: [(labels, value), ...]}`` from a /metrics endpoint (raises on a non-200)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = requests.get(f"{url}/metrics", headers=headers, timeout=30)
    response.raise_for_status()
    samples: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def value(samples: dict, name: str, **labels) -> float | None:
    """The value of the one sample of ``name`` whose labels include ``labels`` (None: absent)."""
    found = [
        v
        for sample_labels, v in samples.get(name, [])
        if all(sample_labels.get(k) == str(w) for k, w in labels.items())
    ]
    assert len(found) <= 1, f"{name}{labels} matches {len(found)} samples"
    return found[0] if found else None


def status(url: str, path: str) -> int:
    try:
        return requests.get(f"{url}{path}", timeout=30).status_code
    except (requests.ConnectionError, requests.Timeout):
        return 0
