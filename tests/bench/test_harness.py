"""Fast tests of the benchmark harness's pure logic (no processes, no database)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.__main__ import external_rows
from bench.api_load import duration_ms, wrk_parse, wrk_script
from bench.ingest import windows_for
from bench.slurm import GPUS, SHARDS_PER_GPU, SlurmPaths, gres_conf, gres_for_fraction, slurm_conf
from bench.stats import Row, fmt_number, median, percentile, rate, table_markdown, table_text
from bench.workload import api_body, chunks, workload

WRK_OUTPUT = """Running 4s test @ http://127.0.0.1:39755/api/v1/
  2 threads and 50 connections
  Latency Distribution
     50%  542.89ms
     75%  868.97ms
     90%    1.07s \x20
     99%  850.00us
  347 requests in 4.03s, 123.35KB read
  Socket errors: connect 0, read 2, write 1, timeout 4
  Non-2xx or 3xx responses: 3
Requests/sec:     86.17
"""


def test_percentile_interpolates_between_ranks():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5, 1, 3], 0) == 1
    assert percentile([5, 1, 3], 100) == 5
    assert percentile(list(range(101)), 95) == 95
    assert percentile([7], 99) == 7
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_median_and_rate():
    assert median([3, 1, 2]) == 2
    assert rate(100, 4) == 25
    assert rate(5, 0) == 0


def test_ratio_reads_the_same_way_whichever_direction_is_better():
    throughput = Row("b", "m", ours=200, unit="/s", reference=100)
    assert throughput.ratio == 2
    latency = Row("b", "m", ours=0.5, unit="s", reference=2.0, higher_is_better=False)
    assert latency.ratio == 4
    assert Row("b", "m", ours=1, unit="s").ratio is None
    assert Row("b", "m", ours=0, unit="s", reference=1, higher_is_better=False).ratio is None
    assert throughput.as_dict()["ratio"] == 2


def test_tables_show_figures_ratio_and_goal():
    rows = [
        Row("vs-slurm", "submit", 150.0, "jobs/s", 115.0, "slurm tuned", goal=">= Slurm", goal_met=True, runs=3),
        Row("ingest", "win/s", 1339.4, "win/s", None, goal="x|y", goal_met=False),
    ]
    text = table_text(rows)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["benchmark", "metric", "ours"]
    assert "150 jobs/s" in lines[2] and "115 jobs/s" in lines[2] and "1.30x" in lines[2] and " yes " in lines[2]
    assert "1,339 win/s" in lines[3] and " NO " in lines[3]
    md = table_markdown(rows)
    assert md.splitlines()[1].count("---") == 9
    assert "x\\|y" in md


def test_fmt_number_keeps_three_significant_figures_or_so():
    assert fmt_number(None) == "-"
    assert fmt_number(0) == "0"
    assert fmt_number(12345.6) == "12,346"
    assert fmt_number(0.01234) == "0.0123"
    assert fmt_number(3.14159) == "3.14"


def test_slurm_conf_declares_one_node_with_gpus_and_shards(tmp_path):
    paths = SlurmPaths(tmp_path)
    conf = slurm_conf(paths, hostname="h", user="root", ctld_port=1, slurmd_port=2, scheduler_parameters="x=1")
    lines = conf.splitlines()
    assert "AuthType=auth/munge" in lines
    assert "SelectType=select/cons_tres" in lines
    assert f"AuthInfo=socket={paths.munge_socket}" in lines
    assert "SchedulerParameters=x=1" in lines
    node = next(line for line in lines if line.startswith("NodeName="))
    assert f"Gres=gpu:{GPUS},shard:{GPUS * SHARDS_PER_GPU}" in node
    assert all(str(tmp_path) in line for line in lines if line.startswith(("StateSave", "SlurmdSpool", "SlurmctldLog")))
    defaults = slurm_conf(paths, hostname="h", user="root", ctld_port=1, slurmd_port=2)
    assert "SchedulerParameters" not in defaults


def test_gres_conf_points_every_gpu_and_shard_at_a_stand_in_file(tmp_path):
    paths = SlurmPaths(tmp_path)
    lines = gres_conf(paths).splitlines()
    assert lines[0] == "AutoDetect=off"
    gpu_files = [line.split("File=")[1] for line in lines if "Name=gpu" in line]
    assert gpu_files == [str(tmp_path / "dev" / f"nvidia{i}") for i in range(GPUS)]
    shards = [line for line in lines if "Name=shard" in line]
    assert len(shards) == GPUS and all(f"Count={SHARDS_PER_GPU}" in s for s in shards)


def test_gres_for_fraction_maps_slices_to_shards():
    assert gres_for_fraction(1000) == "gpu:1"
    assert gres_for_fraction(2000) == "gpu:2"
    assert gres_for_fraction(500) == "shard:4"
    assert gres_for_fraction(250) == "shard:2"
    assert gres_for_fraction(125) == "shard:1"
    with pytest.raises(ValueError):
        gres_for_fraction(300)


def test_workload_cycles_shares_and_submits_slices_first():
    shares = workload(10)
    assert sorted(shares) == sorted([1000, 500, 250, 125] * 2 + [1000, 500])
    first_whole = shares.index(1000)
    assert all(s == 1000 for s in shares[first_whole:])
    assert shares[:3] == [500, 250, 125]


def test_api_body_is_a_valid_request_for_each_share():
    assert api_body(1000, "true") == {"kind": "training", "gpus": 1, "command": ["sh", "-c", "true"]}
    assert api_body(125, "x")["gpus"] == 0.125
    assert api_body(500, "x")["kind"] == "inference"


def test_chunks_split_contiguously_and_evenly():
    parts = chunks(list(range(10)), 4)
    assert [len(p) for p in parts] == [3, 3, 2, 2]
    assert [x for p in parts for x in p] == list(range(10))


def test_wrk_output_is_parsed():
    parsed = wrk_parse(WRK_OUTPUT)
    assert parsed["rps"] == 86.17
    assert parsed["p50_ms"] == 542.89
    assert parsed["p90_ms"] == 1070.0
    assert parsed["p99_ms"] == pytest.approx(0.85)
    assert parsed["requests"] == 347
    assert parsed["non_2xx"] == 3
    assert parsed["socket_errors"] == 7
    assert duration_ms("2m") == 120_000
    with pytest.raises(ValueError):
        duration_ms("fast")


def test_wrk_script_quotes_the_json_body():
    script = wrk_script("POST", "tok", {"command": ["sh", "-c", 'echo "hi"']})
    assert 'wrk.method = "POST"' in script
    assert 'wrk.body = "{\\"command\\": [\\"sh\\", \\"-c\\", \\"echo \\\\\\"hi\\\\\\"\\"]}"' in script


def test_usage_messages_are_agent_shaped_batches():
    messages = windows_for([1, 2], per_job=450, start_ms=1000)
    assert [len(m) for m in messages] == [200, 200, 200, 200, 50, 50]
    assert {w["job_id"] for w in messages[0]} == {1} and {w["job_id"] for w in messages[1]} == {2}
    job1 = [w for m in messages for w in m if w["job_id"] == 1]
    assert [w["seq"] for w in job1] == list(range(450))
    assert all(a["end_ms"] == b["start_ms"] for a, b in zip(job1, job1[1:], strict=False))


def test_external_results_become_rows():
    rows = external_rows("packing", {"allocated_share": 0.97, "label": "x", "ok": True})
    assert [(r.bench, r.metric, r.ours) for r in rows] == [("packing", "allocated_share", 0.97)]
    given = external_rows("s", {"rows": [{"bench": "s", "metric": "m", "ours": 1.0, "unit": "/s", "other": 1}]})
    assert given[0].unit == "/s"


def test_results_folder_is_ignored_by_git_except_gitkeep():
    root = Path(__file__).resolve().parents[2]
    assert (root / "bench" / "results" / ".gitkeep").exists()
    assert "/bench/results/*.json" in (root / ".gitignore").read_text()


def test_report_renders_stored_results(tmp_path):
    import json

    from bench.__main__ import report_markdown

    row = Row("ingest", "windows/s", 1500.0, "win/s", 9000.0, "COPY", goal="x", goal_met=False, runs=3)
    (tmp_path / "ingest.json").write_text(
        json.dumps(
            {
                "name": "ingest",
                "quick": False,
                "at": "2026-11-29T17:00:00Z",
                "seconds": 80,
                "load_average_before": [6.5, 6, 5],
                "rows": [row.as_dict()],
            }
        )
    )
    (tmp_path / "chaos.json").write_text(
        json.dumps(
            [{"name": "agent kill -9", "passed": True, "figures": {"lost_after_s": 4.5}, "checks": {}, "error": ""}]
        )
    )
    text = report_markdown(tmp_path)
    assert "### ingest (full run at 2026-11-29T17:00:00Z, 80 s, load average 6.5 before)" in text
    assert "| ingest | windows/s | 1,500 win/s | 9,000 win/s | COPY | 0.17x | x | NO | 3 |" in text
    assert "| agent kill -9 | PASS | lost_after_s=4.5 |" in text


class _FakeSystem:
    """A system for the side-by-side harness that records what it was asked, in order (shared ``log``)."""

    def __init__(self, name: str, log: list):
        self.name, self.log, self.next_id = name, log, 0

    def hold(self) -> None:
        self.log.append((self.name, "hold"))

    def submit_one(self, milli: int, session: dict, command: str = "true") -> int:
        self.next_id += 1
        return self.next_id

    def submit_array(self, n: int, milli: int) -> int:
        self.log.append((self.name, f"array {n}"))
        return 1

    def discard(self, ids) -> None:
        self.log.append((self.name, "discard"))

    def cpu_groups(self) -> dict:
        return {}


def test_submit_rounds_alternate_which_system_goes_first_and_keep_every_figure(monkeypatch):
    import bench.side_by_side as sbs

    monkeypatch.setattr(sbs, "ARRAY_SETTLE_S", 0)
    log: list = []
    ours, theirs = _FakeSystem("gpushare", log), _FakeSystem("slurm-tuned", log)
    figures = sbs.submit_rounds(ours, theirs, n=8, log=lambda _: None)
    holds = [name for name, what in log if what == "hold"]
    arrays = sbs.ARRAY_ROUND_CALLS
    per_round = (len(sbs.CLIENTS) + arrays) * 2  # one-job submits per client count, then the arrays, for both
    firsts = [holds[i * per_round] for i in range(sbs.SUBMIT_ROUNDS)]
    assert firsts == ["slurm-tuned", "gpushare", "slurm-tuned"][: sbs.SUBMIT_ROUNDS]
    array_turns = [holds[i * per_round + len(sbs.CLIENTS) * 2 :][: arrays * 2] for i in range(sbs.SUBMIT_ROUNDS)]
    assert array_turns[0] == ["slurm-tuned", "gpushare"] * arrays  # the arrays take turns, in the round's order
    assert array_turns[1] == ["gpushare", "slurm-tuned"] * arrays
    for name in ("gpushare", "slurm-tuned"):
        assert {k: len(v) for k, v in figures[name].items()} == {
            "submit_1c_per_s": sbs.SUBMIT_ROUNDS,
            "submit_4c_per_s": sbs.SUBMIT_ROUNDS,
            "cpu_1c_ms": sbs.SUBMIT_ROUNDS,
            "cpu_4c_ms": sbs.SUBMIT_ROUNDS,
            "array_submit_s": sbs.SUBMIT_ROUNDS * arrays,
            sbs.CPU_SPLIT: len(sbs.CLIENTS),
        }
        for clients in sbs.CLIENTS:  # each round's split per submit: the whole machine, the client, the rest
            splits = figures[name][sbs.CPU_SPLIT][clients]
            assert len(splits) == sbs.SUBMIT_ROUNDS and {"machine", "client", "other"} <= set(splits[0])
    assert (("gpushare", "array 8") in log) and log.count(("gpushare", "discard")) == per_round // 2 * sbs.SUBMIT_ROUNDS


def test_rows_pair_our_submit_figures_with_the_rounds_of_the_profile_they_ran_beside():
    from bench.side_by_side import rounds_apply, rows_for

    base = {"n": 1000, "latency_s": [0.1], "latency_p50_s": 0.1, "latency_p95_s": 0.1, "drain_per_s": 50.0}
    base |= {"array_drain_s": 10.0, "array_submit_s": 0.009}
    ours = {**base, "submit_1c_per_s": 150.0, "submit_4c_per_s": 300.0}
    slurm = {
        p: {**base, "submit_1c_per_s": 240.0, "submit_4c_per_s": 450.0, "drain_per_s": 20.0}
        for p in ("defaults", "tuned")
    }
    ours_vs = {}
    for profile, mine, theirs_1c in (
        ("defaults", [260.0, 250.0, 270.0], [240.0, 245.0, 235.0]),
        ("tuned", [200.0, 210.0, 190.0], [230.0, 235.0, 220.0]),
    ):
        rounds_apply(
            slurm[profile],
            {"submit_1c_per_s": theirs_1c, "submit_4c_per_s": [450.0] * 3, "array_submit_s": [0.006] * 3},
        )
        ours_vs[profile] = {**ours}
        rounds_apply(
            ours_vs[profile], {"submit_1c_per_s": mine, "submit_4c_per_s": [400.0] * 3, "array_submit_s": [0.005] * 3}
        )
    rows = {(r.metric, r.reference_name): r for r in rows_for(ours, slurm, ours_vs)}
    one = rows[("submit, 1 client", "slurm defaults")]
    assert (one.ours, one.reference, one.goal_met, one.runs) == (260.0, 240.0, True, 3)
    tuned = rows[("submit, 1 client", "slurm tuned")]
    assert (tuned.ours, tuned.reference, tuned.goal_met) == (200.0, 230.0, False)
    assert ours_vs["tuned"]["submit_1c_per_s_alone"] == 150.0  # the one-system-at-a-time figure is kept
    array = rows[("array of 1000 tasks (1/8 GPU each), submit", "slurm tuned")]
    assert (array.ours, array.reference, array.goal_met, array.runs) == (0.005, 0.006, True, 3)
    # Without rounds: the one-system-at-a-time figures.
    plain = {(r.metric, r.reference_name): r for r in rows_for(ours, slurm)}
    assert plain[("submit, 1 client", "slurm tuned")].ours == 150.0
    assert not any(metric.startswith("CPU per submit") for metric, _ in plain)  # no rounds, no CPU figures


def test_cpu_rows_come_from_the_rounds_and_read_lower_as_better():
    from bench.side_by_side import CPU_SPLIT, rounds_apply, rows_for

    base = {"n": 1000, "latency_s": [0.1], "latency_p50_s": 0.1, "latency_p95_s": 0.1, "drain_per_s": 50.0}
    base |= {"array_drain_s": 10.0, "array_submit_s": 0.009, "submit_1c_per_s": 150.0, "submit_4c_per_s": 300.0}
    split = {"machine": 9.0, "client": 1.0, "other": 8.0}
    slurm = {"tuned": {**base}}
    rounds_apply(slurm["tuned"], {"cpu_1c_ms": [6.0, 5.0, 7.0], "cpu_4c_ms": [6.5] * 3, CPU_SPLIT: {1: [split]}})
    ours_vs = {"tuned": {**base}}
    rounds_apply(ours_vs["tuned"], {"cpu_1c_ms": [9.0, 8.0, 10.0], "cpu_4c_ms": [8.5] * 3, CPU_SPLIT: {1: [split]}})
    assert ours_vs["tuned"][CPU_SPLIT] == {1: [split]}  # kept as it was, not a median
    rows = {(r.metric, r.reference_name): r for r in rows_for(base, slurm, ours_vs)}
    row = rows[("CPU per submit, 1 client (whole machine)", "slurm tuned")]
    assert (row.ours, row.reference, row.higher_is_better, row.unit) == (9.0, 6.0, False, "ms")


def test_the_cpu_meter_counts_the_client_and_each_group_per_operation():
    import subprocess
    import sys
    import time

    from bench import cpu

    burn = (
        "import sys, time\nsys.stdin.readline()\n"
        "t = time.process_time()\nwhile time.process_time() - t < 0.4: pass\ntime.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, text=True)
    try:
        time.sleep(1)  # started, waiting for its line
        meter = cpu.Meter(lambda: {"child": cpu.tree(child.pid)})
        meter.start()
        child.stdin.write("go\n")
        child.stdin.flush()
        spent = time.process_time()
        while time.process_time() - spent < 0.3:  # this process: the client
            pass
        time.sleep(0.6)  # the child's burn ends inside the run
        split = meter.stop(10)
    finally:
        child.kill()
        child.wait()
    assert 29 <= split["client"] <= 36  # ms per operation: 0.3 s over 10
    assert 39 <= split["child"] <= 46  # the child's 0.4 s
    assert split["machine"] >= split["client"] + split["child"] - 5  # /proc/stat counts in 10 ms ticks


def test_a_process_that_ends_during_the_run_counts_in_other_not_against_its_group():
    from bench import cpu

    assert cpu.spent_s({1: 5.0, 2: 9.0}, {1: 5.5, 3: 1.0}) == 0.5  # 2 ended, 3 started: neither counts
