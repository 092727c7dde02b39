"""scripts/bench_join.py: the round statistics on hand-made times, and its server mode against the fake server."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.vllm.test_bench_serving import fake_server  # noqa: F401 (fixture)

_SPEC = importlib.util.spec_from_file_location("bench_join", Path(__file__).resolve().parents[2] / "scripts"
                                               / "bench_join.py")
join = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(join)


def test_join_stats_on_known_times():
    # two running sequences; the long prompt joins at t=1.0 and gets its first token at t=3.0
    running = [[0.0, 0.5, 1.0, 2.5, 3.0], [0.2, 0.7, 1.2, 1.4, 3.1]]
    got = join.join_stats(running, joined_at=1.0, first=3.0)
    gaps = [0.5, 0.5, 1.5, 0.5, 0.5, 0.5, 0.2, 1.7]
    assert got["itl_max_ms"] == pytest.approx(1700.0)
    assert got["stall_ms"] == pytest.approx(1700.0)  # 1.4 -> 3.1 overlaps the join window
    assert got["itl_p50_ms"] == pytest.approx(500.0) and got["join_ttft_s"] == pytest.approx(2.0)
    assert got["itl_p90_ms"] == pytest.approx(1e3 * join.percentile(gaps, 90))


def test_server_mode_runs_rounds_against_a_streaming_server(fake_server, capsys):  # noqa: F811
    rc = join.main(["--server", f"a={fake_server}", "--server", f"b={fake_server}", "--rounds", "2",
                    "--running", "2", "--running-input", "8", "--running-output", "12", "--join-after", "3",
                    "--join-input", "40", "--join-output", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("round 1 ") == 2 and out.count("round 2 ") == 2
    assert "   a |" in out and "   b |" in out


def test_server_mode_rejects_a_bad_server_spec(capsys):
    with pytest.raises(SystemExit):
        join.main(["--server", "http://127.0.0.1:1"])
    assert "NAME=URL" in capsys.readouterr().err
