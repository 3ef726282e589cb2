"""The bench report says how each figure was timed (no GPU needed)."""

from __future__ import annotations

from kernels.bench import _timing_note


def test_report_names_kernels_timed_call_by_call() -> None:
    rows = [{"kernel": "mmq", "timing": "graph"}, {"kernel": "cublas_f16", "timing": "events"},
            {"kernel": "cublas_f16", "timing": "events"}, {"kernel": "cublas_f32", "timing": "events"}]
    note = _timing_note({"rows": rows})
    assert "`cublas_f16`, `cublas_f32`" in note and "launch cost" in note and "mmq" not in note


def test_report_says_when_every_row_came_from_graphs() -> None:
    assert "Every row" in _timing_note({"rows": [{"kernel": "mmq", "timing": "graph"}]})
