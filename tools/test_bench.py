"""tools/bench.py's command line: `python -m tools.bench` on the CPU."""
import pytest

from tools import bench


def test_the_bench_prints_a_timed_row_per_batch_and_context(capsys):
    """`python -m tools.bench` (here on the CPU: the compiled CPU kernel against bf16
    SDPA) prints its header and one timed row per (batch, context)."""
    bench.main(["--batches", "1,2", "--contexts", "400"])
    rows = [l.split() for l in capsys.readouterr().out.splitlines()[2:]]
    assert [r[:2] for r in rows] == [["1", "400"], ["2", "400"]], rows
    assert all(float(r[2]) > 0 and r[-1].endswith("x") for r in rows), rows


def test_the_bench_refuses_a_batch_list_with_a_zero_as_a_usage_error(capsys):
    """`python -m tools.bench --batches 1,0`: argparse's error naming the flag (exit 2), before any
    timing, not a traceback from an empty batch."""
    with pytest.raises(SystemExit) as e:
        bench.main(["--batches", "1,0", "--contexts", "400"])
    assert e.value.code == 2 and "--batches" in capsys.readouterr().err


def test_the_cpu_table_prints_each_path_and_length_and_the_bytes_bound_past_the_fixed_cost():
    """`python -m tools.bench --cpu-table` (here 2 rounds, INT2 0 and 300) prints the bandwidth, a
    row per path and length (its context with the window's 320), and ns per token-head [quartiles], its
    GB/s and its time against the bytes' only past t(0)."""
    lines = []
    times = bench.cpu_table(lengths=(0, 300), reps=2, log=lines.append)
    assert set(times) == {(p, n) for p in ("int2_paged_decode_cpu", "_nb().decode") for n in (0, 300)}
    assert "GB/s" in lines[1] and "48 B" in lines[1]
    rows = [l.split() for l in lines[3:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [(p, n, c) for p in ("int2_paged_decode_cpu", "_nb().decode")
                                                  for n, c in (("0", "320"), ("300", "620"))]
    assert [len(r) for r in rows] == [5, 9, 5, 9] and all(r[-1].endswith("x") for r in rows[1::2])
    assert all(r[6].startswith("[") and r[6].endswith("]") for r in rows[1::2]), rows
