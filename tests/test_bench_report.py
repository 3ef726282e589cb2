"""The bench report says how each figure was timed (no GPU needed)."""

from __future__ import annotations

from tools.bench import _timing_note, table


def test_report_names_kernels_timed_call_by_call() -> None:
    rows = [{"kernel": "mmq", "timing": "graph"}, {"kernel": "cublas_f16", "timing": "events"},
            {"kernel": "cublas_f16", "timing": "events"}, {"kernel": "cublas_f32", "timing": "events"}]
    note = _timing_note({"rows": rows})
    assert "`cublas_f16`, `cublas_f32`" in note and "launch cost" in note and "mmq" not in note


def test_report_says_when_every_row_came_from_graphs() -> None:
    assert "Every row" in _timing_note({"rows": [{"kernel": "mmq", "timing": "graph"}]})


def test_table_gives_each_rows_read_only_floor_and_leaves_it_blank_in_older_results() -> None:
    """bench.md's table: the read-only floor of the row's shape beside its times; rows of a bench.json written
    before the floor was measured (no read_only_us) still render, with that cell empty."""
    row = {"type": "Q4_0", "K": 4096, "M": 1, "kernel": "gemv", "quantize_us": 1.0, "gemm_us": 4.0, "total_us": 4.6,
           "total_same_us": 4.4, "llama_cpp_us": 7.15, "tops": 0.1, "gbps": 2000.0, "floor_us": 2.2,
           "speedup_vs_naive": None, "nmse": 1.7e-4}
    lines = table({"rows": [{**row, "read_only_us": 3.68}, row]}).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    col = head.index("read-only µs (HBM)")
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert len(lines[1].strip("|").split("|")) == len(head) and all(len(c) == len(head) for c in cells)
    assert cells[0][col] == "3.7" and cells[1][col] == ""
    assert cells[0][head.index("total µs (HBM)")] == "4.6"


def test_tuning_table_of_some_shapes_keeps_the_others(tmp_path) -> None:
    """`qgemm bench --tune --types Q4_1 --m 1` replaces Q4_1's M = 1 entries and keeps the others, whatever device
    measured them, each entry naming its own."""
    import json

    from kernels.tuning import write_table

    def row(t: str, m: int, kernel: str, us: float) -> dict:
        return {"type": t, "K": 4096, "N": 4096, "M": m, "kernel": kernel, "total_us": us, "nmse": 1e-5}

    path = tmp_path / "table.json"
    write_table({"device": "GPU", "date": "d1", "rows": [row("Q4_0", 1, "gemv", 5.0), row("Q4_1", 1, "gemv", 9.0)]},
                path)
    write_table({"device": "GPU", "date": "d2", "rows": [row("Q4_1", 1, "gemv_rows", 4.0),
                                                         row("Q4_1", 1, "gemv", 6.0)]}, path)
    entries = {e["type"]: e for e in json.loads(path.read_text())["entries"]}
    assert entries["Q4_0"]["ranking"] == ["gemv"] and entries["Q4_0"]["date"] == "d1"
    assert entries["Q4_1"]["ranking"] == ["gemv_rows", "gemv"] and entries["Q4_1"]["date"] == "d2"
    write_table({"device": "other GPU", "date": "d3", "rows": [row("Q4_1", 8, "gemv", 7.0)]}, path)
    table = json.loads(path.read_text())
    entries = {(e["type"], e["M"]): e for e in table["entries"]}
    assert sorted(entries) == [("Q4_0", 1), ("Q4_1", 1), ("Q4_1", 8)]
    assert entries["Q4_1", 1]["device"] == "GPU" and entries["Q4_1", 1]["date"] == "d2"
    assert entries["Q4_1", 8]["device"] == "other GPU" and table["devices"] == ["GPU", "other GPU"]


def test_tuning_table_ranks_the_kernels_that_compute_their_formula(tmp_path) -> None:
    """A kernel competes when its error is its formula's (within 2x of the best kernel of that formula), whatever
    that error is for this X: one that computes something else is left out, however fast."""
    import json

    from kernels.tuning import write_table

    def row(kernel: str, us: float, nmse: float) -> dict:
        return {"type": "Q5_0", "K": 4096, "N": 4096, "M": 1, "kernel": kernel, "total_us": us, "nmse": nmse}

    path = tmp_path / "table.json"
    write_table({"device": "GPU", "date": "d", "rows": [row("gemv", 5.0, 1.7e-4), row("gemv_rows", 6.0, 1.8e-4),
                                                        row("vec_dp4a", 1.0, 0.5), row("mmq", 9.0, 2.7e-5)]}, path)
    assert json.loads(path.read_text())["entries"][0]["ranking"] == ["gemv", "gemv_rows", "mmq"]


PERF = """Backend 1/2: CUDA0
  MUL_MAT(type_a=q4_0,type_b=f32,m=4096,n=1,k=14336,bs=[1,1],nr=[1,1],per=[0,1,2,3],k_v=0,o=1):   13400 runs -    14.91 us/run - 117.44 MFLOP/run -   7.87 TFLOPS
  MUL_MAT(type_a=q2_K,type_b=f32,m=4096,n=8,k=4096,bs=[1,1],nr=[1,1],per=[0,1,2,3],k_v=0,o=1):   1300 runs -   21.10 us/run -  17.18 GFLOP/run - \x1b[1;34m110.91 TFLOPS\x1b[0m
  MUL_MAT(type_a=iq4_xs,type_b=f32,m=4096,n=8,k=4096,bs=[1,1],nr=[1,1],per=[0,1,2,3],k_v=0,o=1): not supported
"""  # noqa: E501  (test-backend-ops perf's own lines)


def _bench_row(t: str, k: int, m: int, kernel: str, same: float, auto: str) -> dict:
    return {"type": t, "K": k, "N": 4096, "M": m, "kernel": kernel, "auto_kernel": auto, "total_same_us": same,
            "total_us": same * 1.1, "bw_share": 0.8, "nmse": 1e-6}


def test_llama_cpp_times_are_read_from_test_backend_ops_output(tmp_path) -> None:
    from tools.side_by_side import load_llama_cpp, parse_perf

    assert parse_perf(PERF) == {("Q4_0", 14336, 1): 14.91, ("Q2_K", 4096, 8): 21.10}  # ggml's n is our M
    path = tmp_path / "perf.txt"
    path.write_text(PERF)
    assert load_llama_cpp(path)[("Q4_0", 14336, 1)] == 14.91
    (tmp_path / "other.txt").write_text("no MUL_MAT here")
    import pytest

    with pytest.raises(ValueError, match="no MUL_MAT lines"):
        load_llama_cpp(tmp_path / "other.txt")


def test_side_by_side_takes_autos_kernel_and_round_trips(tmp_path) -> None:
    """The row of a shape is the kernel auto runs there (not the fastest); the written JSON gives llama.cpp's
    column back to `qgemm bench --llama-cpp`."""
    import json

    from tools.side_by_side import join, load_llama_cpp, markdown, parse_perf

    bench = {"device": "GPU", "date": "2026-11-25", "copy_bandwidth_gbps": 3000.0,
             "rows": [_bench_row("Q4_0", 14336, 1, "gemv", 13.6, "gemv"),
                      _bench_row("Q4_0", 14336, 1, "mmq", 9.0, "gemv"),
                      _bench_row("Q2_K", 4096, 8, "gemv", 23.2, "gemv")]}
    doc = join(bench, parse_perf(PERF))
    rows = {(r["type"], r["M"]): r for r in doc["rows"]}
    assert rows[("Q4_0", 1)]["kernel"] == "gemv" and rows[("Q4_0", 1)]["ratio"] == round(13.6 / 14.91, 3)
    assert rows[("Q2_K", 8)]["ratio"] > 1
    table = markdown(doc)
    assert "**1.10** (23.2 µs, gemv)" in table and "0.91 (13.6 µs, gemv)" in table  # slower: in bold
    path = tmp_path / "side-by-side.json"
    path.write_text(json.dumps(doc))
    assert load_llama_cpp(path) == {("Q4_0", 14336, 1): 14.91, ("Q2_K", 4096, 8): 21.10}


def test_side_by_side_update_replaces_only_the_shapes_measured_and_names_each_rows_session() -> None:
    """`--update`: a later session's shapes replace the file's, the others keep their own session, a session no row
    comes from any more goes, and the table says which session gave which rows."""
    from tools.side_by_side import join, markdown, parse_perf, update

    first = {"device": "GPU", "date": "2026-11-24", "copy_bandwidth_gbps": 3000.0,
             "rows": [_bench_row("Q4_0", 14336, 1, "gemv", 13.6, "gemv"),
                      _bench_row("Q2_K", 4096, 8, "gemv", 23.2, "gemv")]}
    old = join(first, parse_perf(PERF))
    del old["sessions"]  # a file written before rows named their session
    for r in old["rows"]:
        del r["session"]
    later = {**first, "date": "2026-11-25", "copy_bandwidth_gbps": 3010.0,
             "rows": [_bench_row("Q2_K", 4096, 8, "gemv", 19.0, "gemv")]}
    doc = update(old, join(later, parse_perf(PERF), "2026-11-25T21:47Z"))
    rows = {(r["type"], r["M"]): r for r in doc["rows"]}
    assert rows[("Q4_0", 1)]["session"] == "2026-11-24" and rows[("Q4_0", 1)]["qgemm_us"] == 13.6
    assert rows[("Q2_K", 8)]["session"] == "2026-11-25T21:47Z" and rows[("Q2_K", 8)]["qgemm_us"] == 19.0
    assert list(doc["sessions"]) == ["2026-11-24", "2026-11-25T21:47Z"] and doc["date"] == "2026-11-25"
    table = markdown(doc)
    assert "2 machine sessions" in table and "- 2026-11-24 (3000 GB/s copy bandwidth): Q4_0 at M=1\n" in table
    assert "- 2026-11-25T21:47Z (3010 GB/s copy bandwidth): Q2_K at M=8" in table
    again = update(doc, join({**later, "rows": [_bench_row("Q4_0", 14336, 1, "gemv", 12.0, "gemv")]},
                             parse_perf(PERF), "2026-11-25T21:47Z"))
    assert list(again["sessions"]) == ["2026-11-25T21:47Z"] and "one machine session" in markdown(again)


def test_bench_refuses_a_llama_cpp_file_it_cannot_read_before_any_gpu_work(tmp_path, capsys) -> None:
    from tools.cli import main

    (tmp_path / "perf.txt").write_text("not test-backend-ops output")
    assert main(["bench", "--llama-cpp", str(tmp_path / "perf.txt")]) == 2
    assert "no MUL_MAT lines" in capsys.readouterr().out
    assert main(["bench", "--llama-cpp", str(tmp_path / "missing.txt")]) == 2


def test_model_bench_sums_a_files_matmuls_from_times_measured_on_a_cut(tmp_path, capsys) -> None:
    """`qgemm bench --model FILE --times JSON`: each tensor gets its shape's time, summed for the file, its blocks
    and the rest; llama.cpp's times join by (type, N, K, M); a shape without a time is refused, not left out."""
    import argparse
    import json

    import numpy as np
    from gguf import GGMLQuantizationType as Q

    from models.demo import write_gguf
    from tools.bench import add_arguments, main

    rng = np.random.default_rng()  # the values do not matter here: the times are given
    w = lambda n, k: rng.standard_normal((n, k)).astype(np.float32)  # noqa: E731
    path = write_gguf(tmp_path / "m.gguf", [("blk.0.q.weight", Q.Q8_0, w(96, 64)),
                                            ("blk.1.q.weight", Q.Q8_0, w(96, 64)),
                                            ("blk.0.norm.weight", Q.F32, w(1, 64)[0]),
                                            ("output.weight", Q.Q4_0, w(160, 64))],
                      uints={"qgemm-demo.block_count": 2})
    row = {"kernel": "k", "weight_bytes": 1, "bound": "launch", "timing": "graph", "bw_share": 0.5}
    rows = [{**row, "type": "Q8_0", "N": 96, "K": 64, "M": m, "hbm_us": 3.0 * m, "same_us": 2.0 * m,
             "floor_us": 1.5 * m} for m in (1, 8)]
    times = tmp_path / "times.json"
    times.write_text(json.dumps({"device": "GPU", "copy_bandwidth_gbps": 1000.0, "date": "d", "rows": rows}))
    perf = tmp_path / "perf.txt"
    perf.write_text("  MUL_MAT(type_a=q8_0,type_b=f32,m=96,n=1,k=64,bs=[1,1],nr=[1,1],per=[0,1,2,3],"
                    "v=0,o=1): 1000 runs - 4.00 us/run - ...\n")
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--model", str(path), "--times", str(times), "--llama-cpp", str(perf),
                         "--out", str(tmp_path / "out")])
    assert main(args) == 2  # output.weight's shape has no time
    assert "no time for Q4_0 [160, 64]" in capsys.readouterr().out
    rows += [{**row, "type": "Q4_0", "N": 160, "K": 64, "M": m, "hbm_us": 10.0, "same_us": 9.0, "floor_us": 5.0}
             for m in (1, 8)]
    times.write_text(json.dumps({"device": "GPU", "copy_bandwidth_gbps": 1000.0, "date": "d", "rows": rows}))
    assert main(args) == 0
    doc = json.loads((tmp_path / "out" / "model-bench.json").read_text())
    one = doc["totals"]["1"]
    assert one["file"]["hbm_us"] == 2 * 3.0 + 10.0 and one["blocks"]["same_us"] == 2 * 2.0
    assert one["per_block"]["hbm_us"] == 3.0 and one["outside"]["hbm_us"] == 10.0
    assert one["blocks"]["llama_cpp_us"] == 8.0 and one["file"]["llama_cpp_us"] is None  # Q4_0 has none
    assert doc["totals"]["8"]["blocks"]["llama_cpp_us"] is None
    q8 = next(r for r in doc["rows"] if r["type"] == "Q8_0" and r["M"] == 1)
    assert q8["tensors"] == 2 and q8["ratio"] == 0.5
    assert doc["blocks_in_file"] == 2 and doc["block_count"] == 2
    assert "| 1 | 16.0 µs |" in (tmp_path / "out" / "model-bench.md").read_text()
