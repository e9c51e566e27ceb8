"""Pure rating: price changes, month boundaries, multipliers, discounts and exact splits."""

from __future__ import annotations

from datetime import date
from decimal import Decimal

from hypothesis import given, settings
from hypothesis import strategies as st

from billing.rating import DiscountSpan, PricePoint, Usage, line_round, rate_usage
from tests.billing.conftest import ms

OLD, NEW = Decimal("2.49"), Decimal("3.60")


def test_dedicated_window_straddling_a_price_change_is_rated_per_piece():
    change = ms(2026, 3, 10, 12, 0)
    prices = [PricePoint(ms(2020, 1, 1), OLD, 1), PricePoint(change, NEW, 2)]
    usage = Usage(start_ms=change - 60_000, end_ms=change + 60_000, gpu_milli=2000)

    pieces = rate_usage(usage, prices=prices)

    assert [(p.start_ms, p.end_ms, p.price_id) for p in pieces] == [
        (change - 60_000, change, 1),
        (change, change + 60_000, 2),
    ]
    assert [p.gpu_ms for p in pieces] == [120_000, 120_000]
    # 2 GPUs × 60 s = 120 GPU-s at 2.49/h, then at 3.60/h
    assert pieces[0].amount == Decimal("0.0830000000")
    assert pieces[1].amount == Decimal("0.1200000000")


def test_shared_slice_across_a_month_boundary_is_split_by_month():
    midnight = ms(2026, 4, 1)
    usage = Usage(
        start_ms=midnight - 30_000,
        end_ms=midnight + 30_000,
        gpu_milli=250,
        sm_util_ms=45_001,
        memory_avg_mb=1000,
        energy_mj=7,
    )

    pieces = rate_usage(usage, prices=[PricePoint(ms(2020, 1, 1), Decimal("2.99"), 9)])

    assert [p.month for p in pieces] == [date(2026, 3, 1), date(2026, 4, 1)]
    assert [p.gpu_ms for p in pieces] == [7_500, 7_500]  # 60 s × 1/4 GPU
    assert sum(p.sm_util_ms for p in pieces) == 45_001
    assert sum(p.energy_mj for p in pieces) == 7
    assert sum(p.memory_mb_ms for p in pieces) == 1000 * 60_000
    assert pieces[0].amount == Decimal("0.0062291667")  # 7.5 GPU-s × 2.99 / 3600


def test_multiplier_and_discount_apply_from_their_dates():
    start = ms(2026, 5, 1, 10)
    prices = [PricePoint(ms(2020, 1, 1), Decimal("1.00"), 1)]
    discounts = [DiscountSpan(start + 1_800_000, None, Decimal("10"))]
    usage = Usage(start_ms=start, end_ms=start + 3_600_000, gpu_milli=1000)

    pieces = rate_usage(usage, prices=prices, multiplier=Decimal("0.6"), discounts=discounts)

    assert [p.rate_per_gpu_hour for p in pieces] == [Decimal("0.6000000000"), Decimal("0.5400000000")]
    assert sum(p.amount for p in pieces) == Decimal("0.5700000000")


def test_time_before_the_first_price_is_rated_zero_without_a_price():
    pieces = rate_usage(Usage(start_ms=0, end_ms=1000, gpu_milli=1000), prices=[PricePoint(500, Decimal(1), 1)])
    assert [(p.price_id, p.amount) for p in pieces] == [(None, Decimal(0)), (1, Decimal("0.0001388889"))]


def test_odd_splits_add_up_exactly():
    change = ms(2026, 1, 1, 0, 0, 7)
    usage = Usage(start_ms=change - 3_333, end_ms=change + 6_667, gpu_milli=3125, sm_util_ms=29_999, energy_mj=101)
    pieces = rate_usage(usage, prices=[PricePoint(0, OLD, 1), PricePoint(change, NEW, 2)])
    assert sum(p.gpu_ms for p in pieces) == 10_000 * 3125 // 1000
    assert sum(p.sm_util_ms for p in pieces) == 29_999
    assert sum(p.energy_mj for p in pieces) == 101


def test_line_rounding_is_half_up_to_cents():
    assert line_round(Decimal("0.0050000000")) == Decimal("0.01")
    assert line_round(Decimal("0.0049999999")) == Decimal("0.00")
    assert line_round(Decimal("12.345")) == Decimal("12.35")


def test_month_to_close_waits_an_hour_after_the_month_ends():
    from billing.rating import month_to_close

    assert month_to_close(now_ms=ms(2026, 4, 1, 0, 30)) is None
    assert month_to_close(now_ms=ms(2026, 4, 1, 1, 0)) == date(2026, 3, 1)
    assert month_to_close(now_ms=ms(2027, 1, 15)) == date(2026, 12, 1)


@settings(max_examples=300, deadline=None)
@given(
    start=st.integers(min_value=ms(2026, 1, 31, 23), max_value=ms(2026, 2, 1, 1)),
    duration=st.integers(min_value=1, max_value=15 * 60_000),
    gpu_milli=st.sampled_from([125, 250, 500, 1000, 2000, 8000]),
    sm=st.integers(min_value=0, max_value=10**6),
    energy=st.integers(min_value=0, max_value=10**9),
    changes=st.lists(st.integers(min_value=ms(2026, 1, 31, 23), max_value=ms(2026, 2, 1, 1)), max_size=4, unique=True),
)
def test_pieces_tile_the_window_and_add_up_exactly(start, duration, gpu_milli, sm, energy, changes):
    prices = [PricePoint(0, Decimal("1.00"), 0)] + [
        PricePoint(at, Decimal(i + 2), i + 1) for i, at in enumerate(sorted(changes))
    ]
    usage = Usage(start_ms=start, end_ms=start + duration, gpu_milli=gpu_milli, sm_util_ms=sm, energy_mj=energy)

    pieces = rate_usage(usage, prices=prices)

    assert pieces[0].start_ms == usage.start_ms and pieces[-1].end_ms == usage.end_ms
    assert all(a.end_ms == b.start_ms for a, b in zip(pieces, pieces[1:], strict=False))
    assert sum(p.gpu_ms for p in pieces) == duration * gpu_milli // 1000
    assert sum(p.sm_util_ms for p in pieces) == sm and sum(p.energy_mj for p in pieces) == energy
    for p in pieces:  # each piece is rated at the price in force at its start, and stays in one month
        in_force = max((pt for pt in prices if pt.from_ms <= p.start_ms), key=lambda pt: pt.from_ms)
        assert p.price_id == in_force.price_id
        assert not any(p.start_ms < pt.from_ms < p.end_ms for pt in prices)
        assert p.month == date(2026, 1, 1) if p.start_ms < ms(2026, 2, 1) else p.month == date(2026, 2, 1)
        assert p.end_ms <= ms(2026, 2, 1) or p.start_ms >= ms(2026, 2, 1)
