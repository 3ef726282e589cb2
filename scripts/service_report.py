"""docs/reports/service.md's table and plot from the JSON rows `scripts/service_bench.sh on|off` wrote.
    python3 scripts/service_report.py docs/reports/service/service-on.json docs/reports/service/service-off.json
(prints the markdown table; writes docs/reports/service/service.png; needs matplotlib, the `bench` extra)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    rows = [r for path in sys.argv[1:] for r in json.loads(Path(path).read_text())]
    print("| format | M | clients | batching | req/s | p50 ms | p99 ms | max ms | server p50 ms | overhead p50 ms "
          "| GPU share | errors |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    key = lambda r: (r["format"], r["m"], r["clients"], r["label"])  # noqa: E731
    for r in sorted(rows, key=key):
        print(f"| {r['format']} | {r['m']} | {r['clients']} | {r['label'].split('-')[1]} | {r['requests_per_s']:,.0f} "
              f"| {r['p50_ms']} | {r['p99_ms']} | {r['max_ms']} | {r['server_request_p50_ms']} "
              f"| {r['server_overhead_p50_ms']} | {r['gpu_share']:.1%} | {sum(r['errors'].values()) or 0} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    for col, fmt in enumerate(("npy", "json")):
        for m, color in zip((1, 8, 64, 512), ("C0", "C1", "C2", "C3"), strict=True):
            for label, style in (("batching-on", "-"), ("batching-off", "--")):
                sel = sorted((r for r in rows if r["format"] == fmt and r["m"] == m and r["label"] == label),
                             key=lambda r: r["clients"])
                if not sel:
                    continue
                xs = [r["clients"] for r in sel]
                axes[0][col].plot(xs, [r["requests_per_s"] for r in sel], style, color=color, marker="o",
                                  label=f"M={m} {label.split('-')[1]}")
                axes[1][col].plot(xs, [r["p50_ms"] for r in sel], style, color=color, marker="o")
        axes[0][col].set_title(f"{fmt} bodies, blk.0.attn_q.weight (Q4_0 4096x4096)")
        axes[0][col].set_ylabel("requests/s")
        axes[1][col].set_ylabel("client p50 latency (ms)")
        axes[1][col].set_xlabel("concurrent clients")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle("qgemm serve on an H100 (CUDA backend), qgemm loadtest on the same machine, 2026-11-24")
    fig.tight_layout()
    fig.savefig(Path(__file__).parent.parent / "docs" / "service.png", dpi=110)


if __name__ == "__main__":
    main()
