"""qgemm: inspect GGUF models and multiply their quantized weights the way llama.cpp does (fetch, serve, inspect,
cut; the development tools bench, side-by-side, loadtest, soak and parity run from tools/)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.settings import Settings


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _unwritable(command: str, settings: Settings, exc: OSError) -> str:
    also = (", or set QGEMM_WRITE_DEMO=false (--no-write-demo) to serve the models already there"
            if command == "serve" else "")
    return (f"qgemm {command}: cannot write the demo model into {settings.models_dir} ({exc.strerror or exc}): "
            f"point QGEMM_MODELS_DIR (--models-dir) at a folder this user can write{also}")


def _file_type_name(v: int) -> str:
    from gguf import LlamaFileType

    try:
        return LlamaFileType(v).name
    except ValueError:
        return "unknown to gguf"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def cmd_fetch(args: argparse.Namespace, settings: Settings) -> int:
    from models.demo import ensure_demo
    from models.fetch import MODELS, FetchError, fetch

    print(f"models directory: {settings.models_dir}", file=sys.stderr)
    try:
        path, wrote = ensure_demo(settings.models_dir)
    except OSError as exc:
        print(_unwritable("fetch", settings, exc), file=sys.stderr)
        return 2
    print(f"{'wrote' if wrote else 'have '} {path} ({_fmt_bytes(path.stat().st_size)}, generated)")
    if args.demo_only:
        return 0
    for name in args.model or list(MODELS):
        try:
            path, fetched = fetch(settings.models_dir, MODELS[name])
        except FetchError as exc:
            print(f"qgemm fetch: {exc}", file=sys.stderr)
            return 1
        print(f"{'fetched' if fetched else 'have   '} {path} ({_fmt_bytes(path.stat().st_size)}, sha256 verified)")
    return 0


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    import os

    import uvicorn

    from app import logs
    from app.main import create_app
    from app.settings import default_models_dir
    from models.demo import ensure_demo

    if settings.backend == "cuda":  # asked for CUDA: say in one line why it cannot serve, before anything starts
        reason = cuda_unavailable(settings)
        if reason is not None:
            print(f"qgemm serve: QGEMM_BACKEND=cuda, but no CUDA device can serve: {reason}", file=sys.stderr)
            return 2
    if settings.write_demo or (settings.write_demo is None and settings.models_dir == default_models_dir()):
        try:
            path, wrote = ensure_demo(settings.models_dir)
        except OSError as exc:
            print(_unwritable("serve", settings, exc), file=sys.stderr)
            return 2
        if wrote:
            print(f"wrote the demo model: {path}", file=sys.stderr)
    if args.ray:
        os.environ.update(settings.as_env())  # the replicas build their settings from the environment
        return serve_on_ray(settings, args.replicas)
    if settings.fronts == 0:  # one process: HTTP and the engine together
        # uvloop and httptools: the fastest event loop and HTTP parser uvicorn has (both are dependencies)
        from app.edge import bounded_http

        uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level,
                    loop="uvloop", access_log=settings.access_log,
                    http=bounded_http(settings.max_request_head_bytes, settings.request_read_timeout_s,
                                      settings.max_connections, settings.max_body_bytes),
                    log_config=logs.config(settings.log_level, settings.log_format))
        return 0
    from app.serving import supervisor

    logs.setup(settings.log_level, settings.log_format)
    from app.front_main import run_front

    return supervisor.serve(settings, run_front)


def cuda_unavailable(settings: Settings) -> str | None:
    """Why no CUDA device can serve here (with the fix), or None."""
    from kernels.devices import nvidia_driver, why_no_cuda

    try:
        from kernels.cuda.backend import cuda_device_count

        if cuda_device_count() > 0:
            return None
        cause = "CuPy sees no CUDA device"
    except ImportError as exc:
        cause = f"CuPy is not installed ({exc.name})"
    return why_no_cuda(cause, nvidia_driver())


def serve_on_ray(settings: Settings, replicas: int | None) -> int:
    """Ray Serve: joins the Ray cluster this machine is part of (`ray start`, or RAY_ADDRESS), else starts a
    local one; one replica per GPU (autoscaled, or `replicas` of them); QGEMM_* travel to the replicas."""
    import os

    import ray
    from ray import serve

    from app.ray_serve import app

    ray.init()
    gpus = ray.cluster_resources().get("GPU", 0)
    env = {k: v for k, v in os.environ.items() if k.startswith("QGEMM_")}
    env["QGEMM_MODELS_DIR"] = str(settings.models_dir.resolve())
    if not gpus:
        env.setdefault("QGEMM_BACKEND", "cpu")
    options: dict[str, Any] = {"num_gpus": 1 if gpus else 0, "env": env}
    if replicas:
        options["num_replicas"] = replicas
    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(app(**options), name="qgemm", route_prefix="/", blocking=True)
    return 0


def quant_errors(path: Path, names: list[str] | None, blocksize: int, double_quant: bool) -> dict[str, Any]:
    """{tensor: its rows of app.quant_report.error_rows} for the named matrices (default: every matmul one)."""
    from app.quant_report import error_rows
    from models.store import ModelStore

    model = ModelStore(path.parent, cache_dir=settings_cache()).read_file(path)
    assert model is not None
    infos = [model.tensors[n] for n in names if n in model.tensors] if names else \
        [t for t in model.tensors.values() if t.matmul]
    return {t.name: error_rows(model, t, blocksize, double_quant)[0] if t.matmul else t.matmul_reason for t in infos}


def settings_cache() -> Path:
    """Where the server keeps header indexes: `qgemm inspect` reads and fills the same ones."""
    return Settings.from_env().index_dir


def inspect_file(path: Path) -> dict[str, Any]:
    from models import inspect
    from models.store import ModelStore

    model = ModelStore(path.parent, cache_dir=settings_cache()).read_file(path)
    if model is None:
        raise FileNotFoundError(f"{path} is not a .gguf file")
    out: dict[str, Any] = {"file": str(path), "size_bytes": model.size_bytes, "status": model.status,
                           "error": model.error}
    if model.status == "ok":
        out |= {"header": inspect.header(model), "metadata": inspect.metadata(model),
                "tensor_types": inspect.types_summary(model), "quant_mix": inspect.quant_mix(model),
                "tensors": [inspect.tensor_row(t) for t in model.tensors.values()]}
    return out


def cmd_inspect(args: argparse.Namespace, settings: Settings) -> int:
    path = Path(args.file)
    if not path.is_file():
        print(f"qgemm inspect: {path}: no such file", file=sys.stderr)
        return 2
    info = inspect_file(path)
    if args.quant_error and info["status"] == "ok":
        missing = [n for n in args.tensor or [] if n not in {t["name"] for t in info["tensors"]}]
        if missing:
            print(f"qgemm inspect: no tensor {', '.join(missing)} in {path}", file=sys.stderr)
            return 2
        try:
            info["quant_error"] = quant_errors(path, args.tensor, args.blocksize, args.double_quant)
        except ValueError as exc:
            print(f"qgemm inspect: {exc}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0 if info["status"] == "ok" else 1
    print(f"{path}  ({_fmt_bytes(info['size_bytes'])})")
    if info["status"] != "ok":
        print(f"  error: {info['error']}")
        return 1
    h = info["header"]
    print(f"  GGUF v{h['version']}, {_count(h['tensor_count'], 'tensor')}, {_count(h['kv_count'], 'metadata key')}, "
          f"alignment {h['alignment']}, data at byte {h['data_offset']}")
    print("\nmetadata:")
    for k, v in info["metadata"].items():
        text = json.dumps(v, default=str, ensure_ascii=False)
        if k == "general.file_type" and isinstance(v, int):  # llama.cpp's enum: say its name
            text += f" ({_file_type_name(v)})"
        print(f"  {k:<44} {text if len(text) <= 100 else text[:97] + '...'}")
    print("\ntensor types:")
    for t, s in info["tensor_types"].items():
        print(f"  {t:<8} {_count(s['count'], 'tensor'):>12}  {_fmt_bytes(s['n_bytes']):>10}")
    print(f"  mix: {info['quant_mix']['summary']}")
    print(f"\n  {'name':<36} {'type':<6} {'shape [N, K]':<16} {'bytes':>10}  matmul")
    for t in info["tensors"]:
        print(f"  {t['name']:<36} {t['type']:<6} {str(t['shape']):<16} {t['n_bytes']:>10}  "
              f"{'yes' if t['matmul'] else 'no'}")
    for name, rows in info.get("quant_error", {}).items():
        print(f"\n{name}: requantized from its own values (the reference)")
        if isinstance(rows, str):
            print(f"  {rows}")
            continue
        print(f"  {'scheme':<14} {'bits/weight':>11} {'NMSE':>10} {'max |error|':>12}")
        for r in rows:
            if r["reason"]:
                print(f"  {r['tag']:<14} {r['reason']}")
            else:
                print(f"  {r['tag']:<14} {r['bits_per_weight']:>11.3f} {r['nmse']:>10.3e} {r['max_abs_error']:>12.4g}")
    return 0


def cmd_cut(args: argparse.Namespace, settings: Settings) -> int:
    from models.cut import cut

    try:
        out = cut(Path(args.src), Path(args.dst), args.tensor)
    except (KeyError, OSError, ValueError) as exc:
        print(f"qgemm cut: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({_fmt_bytes(out.stat().st_size)})")
    return 0


def add_settings(p: argparse.ArgumentParser) -> None:
    """Every setting as a flag (--models-dir for QGEMM_MODELS_DIR), its default and variable in the help."""
    group = p.add_argument_group("settings (each also a QGEMM_* environment variable; a flag wins)")
    for name, field in Settings.model_fields.items():
        default = field.get_default(call_default_factory=True)
        env = f"QGEMM_{name.upper()}"
        shown = "unset" if default is None else str(default).lower() if isinstance(default, bool) else default
        text = f"{field.description} ({env}; default: {shown})".replace("%", "%%")
        flag = "--" + name.replace("_", "-")
        if field.annotation in (bool, bool | None):
            group.add_argument(flag, dest=f"setting_{name}", action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=text)
        else:
            group.add_argument(flag, dest=f"setting_{name}", default=argparse.SUPPRESS, metavar=name.upper(),
                               help=text)


def settings_of(args: argparse.Namespace) -> Settings:
    """The environment's settings with the flags given on top; SettingsError says what is wrong, in one line."""
    from pydantic import ValidationError

    flags = {k.removeprefix("setting_"): v for k, v in vars(args).items() if k.startswith("setting_")}
    try:
        return Settings.from_env(**flags)
    except ValidationError as exc:
        problems = []
        for e in exc.errors():
            name = str(e["loc"][0]) if e["loc"] else "?"
            where = "--" + name.replace("_", "-") if name in flags else f"QGEMM_{name.upper()}"
            problems.append(f"{where}={e.get('input')!r}: {e['msg']}")
        raise SettingsError("; ".join(problems)) from None


class SettingsError(ValueError):
    pass


# the development tools' commands (tools/cli.py): `qgemm bench ...` runs `python -m tools bench ...` in this process's
# place, so that the product never imports the tools that stand on it
TOOLS = ("bench", "side-by-side", "loadtest", "soak", "parity", "ceiling", "ggml")


def main(argv: list[str] | None = None) -> int:
    from app import __version__

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in TOOLS:
        os.execv(sys.executable, [sys.executable, "-m", "tools", *argv])
    parser = argparse.ArgumentParser(prog="qgemm", description=__doc__,
                                     epilog=f"development tools ({', '.join(TOOLS)}): qgemm TOOL --help, the same as "
                                            "python -m tools TOOL --help")
    parser.add_argument("--version", action="version", version=f"qgemm {__version__}")
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("fetch", help="write the demo model and fetch the real ones: SmolLM2-135M and Gemma 3 "
                       "270M Q4_K_M (idempotent)")
    p.add_argument("--demo-only", action="store_true", help="write the demo model only (no network)")
    p.add_argument("--model", action="append", choices=["smollm2", "gemma3-q4_k_m"],
                   help="a real model to fetch (repeatable; default: every one)")
    p = sub.add_parser("serve", help="serve the HTTP API with uvicorn (or Ray Serve: --ray)",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ray", action="store_true", help="serve through Ray Serve: one replica per GPU of the Ray "
                   "cluster (joined, or started here), autoscaled (needs the ray extra)")
    p.add_argument("--replicas", type=int, default=None, help="--ray: this many replicas instead of autoscaling")
    add_settings(p)
    p = sub.add_parser("inspect", help="summarise a GGUF file")
    p.add_argument("file")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quant-error", action="store_true",
                   help="each matrix requantized to Q4_0, Q4_1, Q5_0, Q8_0, NF4 and FP4: NMSE, max error, bits/weight")
    p.add_argument("--tensor", action="append", help="--quant-error: only these tensors (repeatable)")
    p.add_argument("--blocksize", type=int, default=64, help="--quant-error: NF4/FP4 values per absmax")
    p.add_argument("--double-quant", action="store_true", help="--quant-error: NF4/FP4 with 8-bit absmax values")
    p = sub.add_parser("cut", help="write a GGUF holding only the named tensors (metadata kept)")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--tensor", action="append", required=True, help="a tensor to keep (repeatable)")
    return dispatch(parser, argv, {"fetch": cmd_fetch, "serve": cmd_serve, "inspect": cmd_inspect, "cut": cmd_cut},
                    logs_by_command=("serve",))


Command = Callable[[argparse.Namespace, Settings], int]


def dispatch(parser: argparse.ArgumentParser, argv: list[str], commands: dict[str, Command],
             logs_by_command: tuple[str, ...] = ()) -> int:
    """Parse `argv`, build the settings (a bad one: one line, exit 2), set up logging (except for the commands
    that do their own) and run the command (help where none is named); the tools' CLI runs the same way."""
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        settings = settings_of(args)
    except SettingsError as exc:
        print(f"qgemm: bad setting: {exc}", file=sys.stderr)
        return 2
    if args.command not in logs_by_command:
        from app import logs

        logs.setup(settings.log_level, settings.log_format)
    return commands[args.command](args, settings)


if __name__ == "__main__":
    sys.exit(main())
