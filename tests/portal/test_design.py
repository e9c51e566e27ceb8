"""The design system's colour pairs meet WCAG AA contrast (4.5:1 for text)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

CSS = (Path(__file__).resolve().parents[2] / "static" / "css" / "gpushare.css").read_text()
TOKENS = dict(re.findall(r"--([a-z-]+):\s*(#[0-9a-fA-F]{6})", CSS.split("}", 1)[0]))


def luminance(hex_colour: str) -> float:
    channels = [int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast(a: str, b: str) -> float:
    high, low = sorted((luminance(a), luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


@pytest.mark.parametrize(
    ("text", "background"),
    [
        ("fg", "bg"),
        ("fg", "surface"),
        ("muted", "bg"),
        ("muted", "surface"),
        ("muted", "neutral-soft"),
        ("accent", "surface"),
        ("accent", "bg"),
        ("accent-fg", "accent"),
        ("ok", "ok-soft"),
        ("warn", "warn-soft"),
        ("danger", "danger-soft"),
        ("info", "info-soft"),
    ],
)
def test_token_pairs_are_readable(text, background):
    ratio = contrast(TOKENS[text], TOKENS[background])
    assert ratio >= 4.5, f"--{text} on --{background}: {ratio:.2f}:1"


def test_top_bar_and_log_colours_are_readable():
    assert contrast("#dbe7f3", "#10273f") >= 4.5  # nav links on the top bar
    assert contrast("#e6edf3", "#0f1b2a") >= 4.5  # log and code boxes
    assert contrast("#9fb0c0", "#0f1b2a") >= 4.5  # "No output yet."
