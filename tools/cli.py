"""The development tools' commands: bench, side-by-side, loadtest, soak, ceiling, ggml and parity (`python -m tools
COMMAND`, or `qgemm COMMAND`, which hands over to this).  They stand on the product (app/, kernels/, models/);
nothing there imports them."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from app.cli import dispatch
from app.settings import Settings


def cmd_bench(args: argparse.Namespace, settings: Settings) -> int:
    from tools.bench import main as bench_main

    return bench_main(args)


def cmd_side_by_side(args: argparse.Namespace, settings: Settings) -> int:
    from tools.side_by_side import main as side_by_side_main

    try:
        return side_by_side_main(args)
    except (OSError, ValueError, KeyError) as exc:
        print(f"qgemm side-by-side: {exc}", file=sys.stderr)
        return 1


def cmd_loadtest(args: argparse.Namespace, settings: Settings) -> int:
    import httpx

    from tools import loadtest

    urls = [u.rstrip("/") for u in (args.url or ["http://127.0.0.1:8000"])]
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    k, backends = None, {}
    for url in urls:
        r = httpx.get(f"{url}/v1/models/{args.model}/tensors/{args.tensor}", headers=headers, timeout=30)
        if r.status_code != 200:
            print(f"error: {url}: {r.status_code} {r.text}", file=sys.stderr)
            return 1
        its_k = r.json()["shape"][1]
        if k is not None and its_k != k:
            print(f"error: {url}'s {args.tensor} has K={its_k}, the first server's {k}", file=sys.stderr)
            return 1
        k = its_k
        backends[url] = httpx.get(f"{url}/healthz", headers=headers, timeout=30).json().get("backend")
    assert k is not None
    rows = []
    for m in args.m:
        for clients in args.clients:
            for fmt in args.format:
                for url in loadtest.abba(urls, args.rounds):
                    plan = loadtest.Plan(url, args.model, args.tensor, k, m, args.kernel, fmt, clients, args.seconds,
                                         settings.api_key)
                    print(f"M={m} clients={clients} {fmt}" + (f" {url}" if len(urls) > 1 else "") + ":",
                          file=sys.stderr)
                    row = loadtest.run(plan, args.processes)
                    if len(urls) > 1:
                        row["url"] = url
                    rows.append({**row, "label": args.label} if args.label else row)
                    _print_run(row, backends[url])
    if len(urls) > 1 or args.rounds > 1:
        print("medians:", file=sys.stderr)
        for s in loadtest.medians(rows):
            print(f"  M={s['m']} clients={s['clients']} {s['format']}" + (f" {s['url']}" if s["url"] else "")
                  + f": {s['requests_per_s']:,.0f} req/s, p99 {s['p99_ms']} ms ({s['runs']} runs)", file=sys.stderr)
    text = json.dumps(rows, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


def _print_run(row: dict, backend: str | None) -> None:
    gpu = f"{row['gpu_share']:.1%}" if backend == "cuda" else "n/a (CPU backend)"
    print(f"  {row['requests_per_s']:,.0f} req/s, p50 {row['p50_ms']} ms, p99 {row['p99_ms']} ms, "
          f"max {row['max_ms']} ms, errors {row['errors'] or 0}, server p50 {row['server_request_p50_ms']}"
          f" ms (overhead {row['server_overhead_p50_ms']} ms), GPU share {gpu}", file=sys.stderr)
    if row["cpu_us_per_request"]:
        print("  CPU per request: " + ", ".join(f"{role}s {us:,.0f} µs" for role, us
                                                 in row["cpu_us_per_request"].items()), file=sys.stderr)
    if row.get("busiest_core_share"):
        print("  busiest process, share of a core: " + ", ".join(f"{role} {share:.0%}" for role, share
                                                                in row["busiest_core_share"].items()), file=sys.stderr)


def cmd_ceiling(args: argparse.Namespace, settings: Settings) -> int:
    from tools.ceiling import main as ceiling_main

    return ceiling_main(args)


def cmd_soak(args: argparse.Namespace, settings: Settings) -> int:
    from tools.soak import main as soak_main

    return soak_main(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "parity":  # its own parser, options and all
        from tools.parity import main as parity_main

        return parity_main(argv[1:])
    if argv and argv[0] == "ggml":
        from tools.ggml_harness import main as ggml_main

        return ggml_main(argv[1:])
    parser = argparse.ArgumentParser(prog="qgemm", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("bench", help="time every available kernel on the seeds' shapes (needs a GPU)")
    try:
        from tools.bench import add_arguments
    except ImportError:  # pragma: no cover
        add_arguments = None
    if add_arguments:
        add_arguments(p)
    p = sub.add_parser("side-by-side", help="join a bench.json with llama.cpp's perf output of the same machine "
                                            "session: a table, a picture and side-by-side.json")
    from tools.side_by_side import add_arguments as side_by_side_arguments

    side_by_side_arguments(p)
    p = sub.add_parser("loadtest", help="drive a running server with concurrent clients; report throughput, latency")
    p.add_argument("--url", action="append", help="the server (default http://127.0.0.1:8000); give it again for "
                   "each server to compare: each configuration's runs then go to them in ABBA order")
    p.add_argument("--rounds", type=int, default=1, help="runs of each configuration (on each server); with several "
                   "servers, forward then backward (2: A B B A); the medians are printed at the end")
    p.add_argument("--model", default="demo")
    p.add_argument("--tensor", default="blk.0.attn_q.weight")
    ints = lambda v: [int(x) for x in v.split(",")]  # noqa: E731
    p.add_argument("--m", type=ints, default=[1], help="rows per request (comma-separated for several runs)")
    p.add_argument("--clients", type=ints, default=[8], help="concurrent clients (comma-separated)")
    p.add_argument("--format", type=lambda v: v.split(","), default=["npy"], help="npy, json or npy,json")
    p.add_argument("--kernel", default="auto")
    p.add_argument("--seconds", type=float, default=10.0, help="duration of each run")
    p.add_argument("--processes", type=int, default=None, help="client processes (default: half the CPUs)")
    p.add_argument("--label", default=None, help="a label written into each result row")
    p.add_argument("--out", default=None, help="write the JSON rows here (default: stdout)")
    p = sub.add_parser("soak", help="run a server under concurrent products while its model files are rewritten; "
                                    "report 5xx, resets, wrong products and memory (exit 1 if any fails)")
    p.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--rewrite-every", type=float, default=2.0, help="seconds between rewrites of the soak model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON report here too")
    p = sub.add_parser("ceiling", help="serve a bare FastAPI route shaped like POST /v1/matmul (reads the body, "
                                       "answers 16 KiB) with as many workers as the fronts: loadtest's HTTP ceiling")
    from tools.ceiling import add_arguments as ceiling_arguments

    ceiling_arguments(p)
    sub.add_parser("ggml", help="build llama.cpp's ggml from a checkout you name and write its products or MUL_MAT "
                                "times on this GPU (qgemm ggml --help)")
    sub.add_parser("parity", help="qgemm's products against ggml's own on the same bytes (qgemm parity --help)")
    return dispatch(parser, argv, {"bench": cmd_bench, "side-by-side": cmd_side_by_side, "loadtest": cmd_loadtest,
                                   "soak": cmd_soak, "ceiling": cmd_ceiling})
