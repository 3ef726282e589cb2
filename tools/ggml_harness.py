"""`qgemm ggml`: llama.cpp's own numbers on this machine's GPU, the ground truth of docs/accuracy.md and
docs/performance.md.

It builds llama.cpp's ggml (the CUDA backend; `--cpu` for the CPU one) from a source you name, together with the
harness in tools/ggml/, and runs one of:

- `products OUT`: ggml's quantization of deterministic weights and what `ggml_mul_mat` computes with them for each
  type and M (tools/ggml/qcheck.c: OUT/TYPE.w.bin, OUT/x.f32, OUT/TYPE.M.y.f32), then, with `--compare`,
  `python -m tools.parity OUT` on the same bytes;
- `perf OUT`: ggml's `test-backend-ops perf -o MUL_MAT` on the shapes asked for (N = 4096 weight rows, each M and K,
  each type; or, with `--model FILE`, each distinct matmul shape of a GGUF file, at each M): ggml's time per op on
  the same buffers, its FP32 -> Q8_1 step included, in the format `qgemm side-by-side --llama-cpp` reads.

The source (`--ggml`) is a llama.cpp checkout (its `ggml/` and `tests/test-backend-ops.cpp`), or a ggml source tree
or a `.tar.xz` of one (products only: the timer lives in llama.cpp's tests).  The figures in docs/ were made at
llama.cpp commit PINNED; another commit works and is named in the output.  The build goes to `--build` (kept:
later runs only relink).  Run `qgemm bench` in the same machine session as `perf`: only figures of one session
compare.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

PINNED = "d99724f"
HERE = Path(__file__).parent / "ggml"
TYPES = "q4_0 q8_0 q4_1 q5_0 q5_1 q2_K q3_K q4_K q5_K q6_K iq4_nl iq4_xs mxfp4 f16 bf16"
PERF_MARK = "// qgemm ggml perf: the shapes asked for"


def _run(cmd: list[str], log: Path | None = None, **kw: object) -> None:
    print("+ " + " ".join(cmd), file=sys.stderr)
    if log is None:
        subprocess.run(cmd, check=True, **kw)  # type: ignore[call-overload]
        return
    with open(log, "ab") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kw)  # type: ignore[call-overload]
    if r.returncode:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"qgemm ggml: {cmd[0]} failed ({r.returncode}); the end of {log}:\n{tail}")


def source_tree(src: Path, build: Path) -> tuple[Path, Path | None, str]:
    """(ggml's source directory, llama.cpp's tests/test-backend-ops.cpp or None, the commit or a label)."""
    if src.is_file() and src.name.endswith((".tar.xz", ".tar.gz", ".tgz", ".tar")):
        dest = build / "src"
        if not (dest / "ggml").is_dir():
            dest.mkdir(parents=True, exist_ok=True)
            with tarfile.open(src) as tar:
                tar.extractall(dest, filter="data")
        ggml = dest / "ggml" if (dest / "ggml").is_dir() else dest
        return ggml, None, src.name
    if not src.is_dir():
        raise SystemExit(f"qgemm ggml: {src} is neither a llama.cpp checkout, a ggml tree nor a .tar.xz of one")
    ggml = src / "ggml" if (src / "ggml" / "CMakeLists.txt").is_file() else src
    if not (ggml / "CMakeLists.txt").is_file() or not (ggml / "include" / "ggml.h").is_file():
        raise SystemExit(f"qgemm ggml: no ggml sources under {src} (expected ggml/CMakeLists.txt and ggml/include)")
    tbo = src / "tests" / "test-backend-ops.cpp"
    try:
        commit = subprocess.run(["git", "-C", str(src), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "(not a git checkout)"
    return ggml, tbo if tbo.is_file() else None, commit


def perf_cases(types: list[str], n: int, ms: list[int], ks: list[int]) -> str:
    """C++ for test-backend-ops' perf list: MUL_MAT of each type at N weight rows, each M and K (ggml's test_mul_mat
    takes m = weight rows, n = activation rows, k), only these when QGEMM_PERF_SHAPES is set."""
    enum = ", ".join(f"GGML_TYPE_{t.upper()}" for t in types)
    return f"""
    {PERF_MARK}
    if (getenv("QGEMM_PERF_SHAPES")) {{
        for (int kk : {{{", ".join(map(str, ks))}}}) {{
            for (int bs : {{{", ".join(map(str, ms))}}}) {{
                for (ggml_type type_a : {{{enum}}}) {{
                    test_cases.emplace_back(new test_mul_mat(type_a, GGML_TYPE_F32, {n}, bs, kk, {{1, 1}}, {{1, 1}}));
                }}
            }}
        }}
        return test_cases;
    }}
"""


def model_shapes(path: Path) -> list[tuple[str, int, int]]:
    """(ggml type, N, K) of every distinct matmul tensor of a GGUF file, as its table says."""
    from models.store import ModelStore

    model = ModelStore(path.parent).get(path.stem)
    if model.status != "ok":
        raise SystemExit(f"qgemm ggml: {path} could not be read: {model.error}")
    return sorted({(t.type_name.lower().replace("_k", "_K"), t.shape[0], t.shape[1])
                   for t in model.tensors.values() if t.matmul})


def shape_cases(shapes: list[tuple[str, int, int]], ms: list[int]) -> str:
    """C++ for test-backend-ops' perf list: MUL_MAT of each (type, N, K) at each M, only these when
    QGEMM_PERF_SHAPES is set."""
    lines = "\n".join(f"        test_cases.emplace_back(new test_mul_mat(GGML_TYPE_{t.upper()}, GGML_TYPE_F32, {n}, "
                       f"{m}, {k}, {{1, 1}}, {{1, 1}}));" for t, n, k in shapes for m in ms)
    return f"""
    {PERF_MARK}
    if (getenv("QGEMM_PERF_SHAPES")) {{
{lines}
        return test_cases;
    }}
"""


def patched_test_backend_ops(tbo: Path, build: Path, cases: str) -> Path:
    """A copy of test-backend-ops.cpp whose perf list starts with `cases` (written only when it changes, so that a
    rerun of the same shapes does not rebuild)."""
    text = tbo.read_text()
    head = re.search(r"static std::vector<std::unique_ptr<test_case>> make_test_cases_perf\(\) \{\n"
                     r"\s*std::vector<std::unique_ptr<test_case>> test_cases;\n", text)
    if head is None:
        raise SystemExit(f"qgemm ggml: {tbo} has no make_test_cases_perf() as llama.cpp {PINNED} writes it")
    out = build / "extra" / "test-backend-ops.cpp"
    out.parent.mkdir(parents=True, exist_ok=True)
    new = text[:head.end()] + cases + text[head.end():]
    if not out.exists() or out.read_text() != new:
        out.write_text(new)
    return out


def configure_and_build(ggml: Path, build: Path, targets: list[str], cuda: bool, arch: str,
                        test_backend_ops: Path | None) -> None:
    build.mkdir(parents=True, exist_ok=True)
    log = build / "build.log"
    if not (build / "CMakeCache.txt").exists() or test_backend_ops is not None:
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        _run(["cmake", "-S", str(HERE), "-B", str(build), *generator, f"-DGGML_SRC={ggml}",
              f"-DGGML_CUDA={'ON' if cuda else 'OFF'}", "-DGGML_CUDA_FA=OFF", "-DGGML_CUDA_NCCL=OFF",
              f"-DCMAKE_CUDA_ARCHITECTURES={arch}", "-DGGML_NATIVE=OFF", "-DCMAKE_BUILD_TYPE=Release",
              f"-DTEST_BACKEND_OPS={test_backend_ops or ''}"], log)
    _run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", *targets], log)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="qgemm ggml", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["products", "perf"])
    p.add_argument("out", type=Path, help="products: a folder; perf: a file")
    p.add_argument("--ggml", type=Path, required=True,
                   help=f"a llama.cpp checkout (figures in docs/: commit {PINNED}), a ggml tree or a .tar.xz of one")
    p.add_argument("--build", type=Path, default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                   / "qgemm" / "ggml-build", help="the build folder (kept between runs)")
    p.add_argument("--cpu", action="store_true", help="ggml's CPU backend, to try the harness without a GPU (its "
                                                      "formulas are not the CUDA backend's: parity is not expected)")
    p.add_argument("--arch", default="native",
                   help="CMAKE_CUDA_ARCHITECTURES: native (this machine's GPU), or e.g. 90a for an H100 or H200")
    p.add_argument("--types", default=TYPES, help="ggml's type names, space- or comma-separated")
    p.add_argument("--n", type=int, default=None, help="weight rows (products: 511; perf: 4096)")
    p.add_argument("--k", default=None, help="products: one K (4096); perf: K values (4096,14336)")
    p.add_argument("--m", default=None, help="activation rows (products: 1,2,5,8,9,16,64,256; perf: "
                                            "1,8,32,128,512,2048)")
    p.add_argument("--seed", type=int, default=11, help="products: the weights' seed")
    p.add_argument("--seconds", type=int, default=600, help="perf: stop after this long, keeping what finished")
    p.add_argument("--compare", action="store_true", help="products: then python -m tools.parity OUT")
    p.add_argument("--model", type=Path, default=None,
                   help="perf: time each distinct matmul shape (type, N, K) of this GGUF file, at each --m")
    args = p.parse_args(argv)
    types = args.types.replace(",", " ").split()
    build = args.build.resolve()
    ggml, tbo, commit = source_tree(args.ggml.resolve(), build)
    print(f"ggml from {args.ggml} ({commit}; docs/ figures: {PINNED})", file=sys.stderr)
    if args.what == "products":
        configure_and_build(ggml, build, ["qcheck"], not args.cpu, args.arch, None)
        out = args.out.resolve()
        out.mkdir(parents=True, exist_ok=True)
        n, k, ms = args.n or 511, int(args.k or 4096), args.m or "1,2,5,8,9,16,64,256"
        for t in types:
            _run([str(build / "qcheck"), t, str(n), str(k), ms, str(args.seed), str(out)])
        (out / "ggml.txt").write_text(f"ggml {commit}\nN={n} K={k} M={ms} seed={args.seed}\n")
        if args.compare:  # its exit status: 1 where a kernel missed ggml's product
            return subprocess.run([sys.executable, "-m", "tools.parity", str(out), "--k", str(k)]).returncode
        return 0
    if tbo is None:
        raise SystemExit("qgemm ggml perf needs a llama.cpp checkout: its tests/test-backend-ops.cpp times the ops")
    ks = [int(v) for v in (args.k or "4096,14336").split(",")]
    ms_perf = [int(v) for v in (args.m or "1,8,32,128,512,2048").split(",")]
    cases = shape_cases(model_shapes(args.model.resolve()), ms_perf) if args.model is not None \
        else perf_cases(types, args.n or 4096, ms_perf, ks)
    copy = patched_test_backend_ops(tbo, build, cases)
    configure_and_build(ggml, build, ["test-backend-ops"], not args.cpu, args.arch, copy)
    backend = "CPU" if args.cpu else "CUDA0"
    with open(args.out, "w") as f:
        f.write(f"# ggml {commit}: test-backend-ops perf -o MUL_MAT -b {backend}\n")
        f.flush()
        try:
            subprocess.run([str(build / "test-backend-ops"), "perf", "-o", "MUL_MAT", "-b", backend], stdout=f,
                           stderr=subprocess.STDOUT, timeout=args.seconds, env={**os.environ, "QGEMM_PERF_SHAPES": "1"})
        except subprocess.TimeoutExpired:
            print(f"qgemm ggml perf: stopped after {args.seconds} s; the cases that finished are kept",
                  file=sys.stderr)
    timed = sum(1 for line in open(args.out) if "MUL_MAT(type_a" in line)
    print(f"{timed} MUL_MAT cases timed: {args.out}", file=sys.stderr)
    return 0
