"""`qgemm bench` (arrives with the GPU backend)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def main(args: argparse.Namespace) -> int:
    print("qgemm bench needs the CUDA backend")
    return 2
