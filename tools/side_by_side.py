"""qgemm beside llama.cpp, from one machine session: `qgemm bench`'s rows and ggml's own MUL_MAT times
(test-backend-ops perf -o MUL_MAT output) joined per (type, K, M).

qgemm's figure is the kernel `auto` picks at that shape (what the service runs), quantize + GEMM timed on the same
buffers, as test-backend-ops times its op (weights of K = 4096 then mostly come from L2); `hbm_share` is the same
kernel's bytes moved over its time with rotating weights (from HBM) against the copy bandwidth of the same run.

    qgemm side-by-side --bench bench.json --llama-cpp perf.txt --out docs/perf [--update --session LABEL]
writes side-by-side.json (rows: type, K, M, qgemm_us, llama_cpp_us, ratio, kernel, hbm_share, device, date,
session), side-by-side.md (a table per K) and side-by-side.png (the ratio per type and M).  `--update` replaces only
the shapes this session measured in an existing side-by-side.json: each row's two times still come from one machine
session (its `session`), and the table says which session gave which rows."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

# one line of test-backend-ops perf: MUL_MAT(type_a=q4_0,type_b=f32,m=4096,n=1,k=14336,...): ... 14.91 us/run
# ggml's m is our N (rows of W), its n our M (rows of X), its k our K
PERF_LINE = re.compile(r"MUL_MAT\(type_a=(\w+),type_b=f32,m=(\d+),n=(\d+),k=(\d+)[^)]*\)[^\n]*?([\d.]+) us/run")

Key = tuple[str, int, int]  # (type, K, M)


def parse_perf(text: str) -> dict[Key, float]:
    """ggml's µs per MUL_MAT op by (type, K, M), from test-backend-ops perf's console output."""
    out: dict[Key, float] = {}
    for type_a, _n, m, k, us in PERF_LINE.findall(text):
        out[(type_a.upper(), int(k), int(m))] = float(us)
    return out


def parse_perf_shapes(text: str) -> dict[tuple[str, int, int, int], float]:
    """ggml's µs per MUL_MAT op by (type, N, K, M), from test-backend-ops perf's console output (any N: a model's
    shapes, `qgemm ggml perf --model`)."""
    return {(type_a.upper(), int(n), int(k), int(m)): float(us) for type_a, n, m, k, us in PERF_LINE.findall(text)}


def load_llama_cpp(path: str | Path) -> dict[Key, float]:
    """llama.cpp's times from `qgemm ggml perf`'s output, or from a side-by-side.json written by this module."""
    text = Path(path).read_text()
    if text.lstrip().startswith("{"):
        doc = json.loads(text)
        return {(r["type"], r["K"], r["M"]): r["llama_cpp_us"] for r in doc["rows"] if r["llama_cpp_us"]}
    found = parse_perf(text)
    if not found:
        raise ValueError(f"{path}: no MUL_MAT lines of test-backend-ops perf and not a side-by-side.json")
    return found


def join(bench: dict[str, Any], llama: dict[Key, float], session: str | None = None) -> dict[str, Any]:
    """One row per (type, K, M) of the bench: auto's kernel there (the fastest measured where auto's pick was not
    measured), beside llama.cpp's time; `session` names the machine session (the bench's date by default)."""
    session = session or bench["date"]
    shapes: dict[Key, list[dict[str, Any]]] = {}
    for r in bench["rows"]:
        shapes.setdefault((r["type"], r["K"], r["M"]), []).append(r)
    rows = []
    for (type_name, k, m), found in sorted(shapes.items()):
        pick = next((r for r in found if r["kernel"] == r.get("auto_kernel")), None)
        pick = pick or min(found, key=lambda r: r["total_same_us"])
        theirs = llama.get((type_name, k, m))
        rows.append({"type": type_name, "K": k, "M": m, "N": pick["N"], "kernel": pick["kernel"],
                     "auto": pick["kernel"] == pick.get("auto_kernel"),
                     "qgemm_us": round(pick["total_same_us"], 2), "qgemm_hbm_us": round(pick["total_us"], 2),
                     "llama_cpp_us": theirs, "ratio": round(pick["total_same_us"] / theirs, 3) if theirs else None,
                     "hbm_share": round(pick["bw_share"], 3), "nmse": pick["nmse"],
                     "device": bench["device"], "date": bench["date"], "session": session})
    return {"device": bench["device"], "date": bench["date"], "copy_bandwidth_gbps": bench["copy_bandwidth_gbps"],
            "method": __doc__.split("\n\n")[1].replace("\n", " "), "rows": rows,
            "sessions": {session: {"device": bench["device"], "copy_bandwidth_gbps": bench["copy_bandwidth_gbps"]}}}


def sessions_of(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The doc's machine sessions (a file written before sessions were named is one, labelled by its date)."""
    return doc.get("sessions") or {doc["date"]: {"device": doc["device"],
                                                 "copy_bandwidth_gbps": doc["copy_bandwidth_gbps"]}}


def update(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`old` with the shapes `new` measured replaced by new's rows; the sessions no row comes from any more go."""
    label = next(iter(sessions_of(old)))
    rows = {(r["type"], r["K"], r["M"]): {**r, "session": r.get("session", label)} for r in old["rows"]}
    rows.update({(r["type"], r["K"], r["M"]): r for r in new["rows"]})
    kept = {r["session"] for r in rows.values()}
    sessions = {k: v for k, v in {**sessions_of(old), **sessions_of(new)}.items() if k in kept}
    return {**old, "date": max(old["date"], new["date"]), "rows": [rows[k] for k in sorted(rows)],
            "sessions": sessions, "copy_bandwidth_gbps": new["copy_bandwidth_gbps"]}


def markdown(doc: dict[str, Any]) -> str:
    """Per K, a table of types by M: qgemm / llama.cpp (bold where qgemm is slower), and M = 1's HBM share."""
    rows = doc["rows"]
    ms = sorted({r["M"] for r in rows})
    sessions = sessions_of(doc)
    if len(sessions) == 1:
        when = f"{doc['date']}, one machine session. {doc['method']} Copy bandwidth of the run: " \
               f"{doc['copy_bandwidth_gbps']:.0f} GB/s."
    else:  # which rows each session measured, so that no one compares cells of two sessions as one run
        lines = []
        for name, info in sessions.items():
            by_ms: dict[tuple[int, ...], list[str]] = {}  # types with the same Ms from this session, together
            for type_name in dict.fromkeys(r["type"] for r in rows if r["session"] == name):
                ms_of = tuple(sorted({r["M"] for r in rows if r["session"] == name and r["type"] == type_name}))
                by_ms.setdefault(ms_of, []).append(type_name)
            what = "; ".join(f"{', '.join(t)} at M={', '.join(map(str, m))}" for m, t in by_ms.items())
            lines.append(f"- {name} ({info['copy_bandwidth_gbps']:.0f} GB/s copy bandwidth): {what}")
        when = (f"{len(sessions)} machine sessions; each row's two times come from one of them (its `session` in "
                f"side-by-side.json), so compare cells of one session only. {doc['method']}\n\n" + "\n".join(lines))
    parts = [f"# qgemm beside llama.cpp\n\n**{doc['device']}**, {when}\n\n"
             "Each cell: qgemm's time / llama.cpp's (below 1 is faster), then qgemm's µs. "
             "`HBM @ M=1`: the share of copy bandwidth at M = 1 with rotating weights.\n\n"
             "![ratio per type and M](side-by-side.png)\n"]
    for k in sorted({r["K"] for r in rows}):
        parts.append(f"\n## K = {k}\n\n| type | " + " | ".join(f"M={m}" for m in ms) + " | HBM @ M=1 |\n|---|"
                     + "---:|" * (len(ms) + 1))
        for type_name in dict.fromkeys(r["type"] for r in rows if r["K"] == k):
            cells, hbm = [], ""
            for m in ms:
                r = next((r for r in rows if (r["type"], r["K"], r["M"]) == (type_name, k, m)), None)
                if r is None:
                    cells.append("")
                    continue
                if m == 1:
                    hbm = f"{100 * r['hbm_share']:.0f}%"
                ratio = "" if r["ratio"] is None else (f"**{r['ratio']:.2f}**" if r["ratio"] > 1 else
                                                       f"{r['ratio']:.2f}")
                cells.append(f"{ratio} ({r['qgemm_us']:.1f} µs, {r['kernel']})")
            parts.append(f"| {type_name} | " + " | ".join(cells) + f" | {hbm} |")
    return "\n".join(parts) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [r for r in doc["rows"] if r["ratio"] is not None]
    ks = sorted({r["K"] for r in rows})
    ms = sorted({r["M"] for r in rows})
    types = list(dict.fromkeys(r["type"] for r in rows))
    fig, axes = plt.subplots(1, len(ks), figsize=(4.2 * len(ks) + 1, 0.42 * len(types) + 1.6), squeeze=False)
    for ax, k in zip(axes[0], ks, strict=True):
        grid = np.full((len(types), len(ms)), np.nan)
        for r in rows:
            if r["K"] == k:
                grid[types.index(r["type"]), ms.index(r["M"])] = r["ratio"]
        image = ax.imshow(grid, cmap="RdYlGn_r", vmin=0.3, vmax=1.3, aspect="auto")
        for (i, j), v in np.ndenumerate(grid):
            if v == v:
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(ms)), [str(m) for m in ms])
        ax.set_yticks(range(len(types)), types if ax is axes[0][0] else [])
        ax.set_xlabel("M")
        ax.set_title(f"K = {k}: qgemm / llama.cpp time")
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8)
    when = doc["date"] if len(sessions_of(doc)) == 1 else f"{len(sessions_of(doc))} machine sessions to {doc['date']}"
    fig.suptitle(f"{doc['device']}, {when}, N = 4096, same buffers")
    fig.savefig(path, dpi=110, bbox_inches="tight")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bench", required=True, help="bench.json of `qgemm bench` (run with --llama-cpp or not)")
    p.add_argument("--llama-cpp", required=True, help="`qgemm ggml perf`'s output (test-backend-ops perf -o MUL_MAT)")
    p.add_argument("--out", default="docs/perf", help="directory for side-by-side.json, .md and .png")
    p.add_argument("--update", action="store_true",
                   help="replace only the shapes this run measured in the side-by-side.json already in --out")
    p.add_argument("--session", help="the machine session's name in the rows (default: the bench's date)")


def main(args: argparse.Namespace) -> int:
    doc = join(json.loads(Path(args.bench).read_text()), load_llama_cpp(args.llama_cpp), args.session)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.update and (out / "side-by-side.json").is_file():
        doc = update(json.loads((out / "side-by-side.json").read_text()), doc)
    (out / "side-by-side.json").write_text(json.dumps(doc, indent=1))
    (out / "side-by-side.md").write_text(markdown(doc))
    try:
        plot(doc, out / "side-by-side.png")
    except ImportError:
        print("matplotlib is not installed: no picture (pip install -e '.[bench]')")
    missing = sum(r["llama_cpp_us"] is None for r in doc["rows"])
    print(f"{len(doc['rows'])} shapes written to {out} ({missing} without a llama.cpp time)")
    return 0
