"""`qgemm ggml` (tools/ggml_harness.py) without building ggml: the sources it accepts and refuses, and the perf
cases it writes into a copy of test-backend-ops.cpp (only the shapes asked for, ahead of ggml's own list)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import ggml_harness as H

PERF_HEAD = """static std::vector<std::unique_ptr<test_case>> make_test_cases_perf() {
    std::vector<std::unique_ptr<test_case>> test_cases;

    test_cases.emplace_back(new test_bin_bcast(ggml_add, GGML_TYPE_F32, {4096, 1, 1, 1}, {1, 1, 1, 1}));
"""


def _checkout(root: Path) -> Path:
    (root / "ggml" / "include").mkdir(parents=True)
    (root / "ggml" / "CMakeLists.txt").write_text("project(ggml)\n")
    (root / "ggml" / "include" / "ggml.h").write_text("\n")
    (root / "tests").mkdir()
    (root / "tests" / "test-backend-ops.cpp").write_text("// head\n" + PERF_HEAD + "    return test_cases;\n}\n")
    return root


def test_a_checkout_gives_ggml_and_the_timer_and_a_bare_folder_is_refused(tmp_path: Path) -> None:
    root = _checkout(tmp_path / "llama.cpp")
    ggml, tbo, commit = H.source_tree(root, tmp_path / "build")
    assert ggml == root / "ggml" and tbo == root / "tests" / "test-backend-ops.cpp" and commit
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match="no ggml sources"):
        H.source_tree(empty, tmp_path / "build")


def test_the_perf_copy_times_only_the_shapes_asked_for(tmp_path: Path) -> None:
    root = _checkout(tmp_path / "llama.cpp")
    cases = H.perf_cases(["q4_K", "f16"], 4096, [1, 8], [4096, 14336])
    copy = H.patched_test_backend_ops(root / "tests" / "test-backend-ops.cpp", tmp_path / "build", cases)
    text = copy.read_text()
    ours = text.index(H.PERF_MARK)
    assert text.index("std::vector<std::unique_ptr<test_case>> test_cases;") < ours < text.index("test_bin_bcast")
    assert "for (int kk : {4096, 14336})" in text and "for (int bs : {1, 8})" in text
    assert "{GGML_TYPE_Q4_K, GGML_TYPE_F16}" in text and "test_mul_mat(type_a, GGML_TYPE_F32, 4096, bs, kk" in text
    assert 'getenv("QGEMM_PERF_SHAPES")' in text and (root / "tests" / "test-backend-ops.cpp").read_text() != text
    stamp = copy.stat().st_mtime_ns
    H.patched_test_backend_ops(root / "tests" / "test-backend-ops.cpp", tmp_path / "build", cases)
    assert copy.stat().st_mtime_ns == stamp  # the same shapes again: not rewritten, not rebuilt


def test_a_timer_without_the_perf_list_is_refused(tmp_path: Path) -> None:
    tbo = tmp_path / "test-backend-ops.cpp"
    tbo.write_text("int main() {}\n")
    with pytest.raises(SystemExit, match="make_test_cases_perf"):
        H.patched_test_backend_ops(tbo, tmp_path / "build", "")


def test_a_models_matmul_shapes_become_its_perf_cases(models_dir: Path) -> None:
    """`--model FILE`: each distinct matmul tensor shape of a GGUF (ggml's type names), each at every M asked."""
    shapes = H.model_shapes(models_dir / "demo.gguf")
    assert shapes and len(set(shapes)) == len(shapes)
    assert ("q4_0", 33, 64) in shapes and all(n > 0 and k > 0 for _, n, k in shapes)
    cases = H.shape_cases(shapes, [1, 8])
    assert cases.count("test_cases.emplace_back(") == 2 * len(shapes)
    assert "new test_mul_mat(GGML_TYPE_Q4_0, GGML_TYPE_F32, 33, 8, 64, {1, 1}, {1, 1})" in cases
