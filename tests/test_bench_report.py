"""The bench report says how each figure was timed (no GPU needed)."""

from __future__ import annotations

from tools.bench import _timing_note


def test_report_names_kernels_timed_call_by_call() -> None:
    rows = [{"kernel": "mmq", "timing": "graph"}, {"kernel": "cublas_f16", "timing": "events"},
            {"kernel": "cublas_f16", "timing": "events"}, {"kernel": "cublas_f32", "timing": "events"}]
    note = _timing_note({"rows": rows})
    assert "`cublas_f16`, `cublas_f32`" in note and "launch cost" in note and "mmq" not in note


def test_report_says_when_every_row_came_from_graphs() -> None:
    assert "Every row" in _timing_note({"rows": [{"kernel": "mmq", "timing": "graph"}]})


def test_tuning_table_of_some_types_keeps_the_others(tmp_path) -> None:
    """`qgemm bench --tune --types Q4_1` replaces Q4_1's entries and keeps the other types' from the same device."""
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
    write_table({"device": "other GPU", "date": "d3", "rows": [row("Q4_1", 1, "gemv", 6.0)]}, path)
    assert [e["type"] for e in json.loads(path.read_text())["entries"]] == ["Q4_1"]  # another device: nothing kept
