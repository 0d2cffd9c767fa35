"""``hybrid-jax``: the command line.

``hybrid-jax generate`` and ``hybrid-jax bench`` serve the built-in tiny Qwen3-Next model (or a
checkpoint) through the engine (``serving.py``); ``hybrid-jax serve`` puts it behind the
OpenAI-compatible HTTP API (``serve.py``); ``hybrid-jax demo`` runs the backend alone
(``demo.py``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Sequence

from hybrid_jax.cli.demo import add_demo_parser
from hybrid_jax.cli.serve import add_serve_parser
from hybrid_jax.cli.serving import add_bench_parser, add_generate_parser

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hybrid-jax", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"hybrid-jax {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_demo_parser(sub)
    add_generate_parser(sub)
    add_bench_parser(sub)
    add_serve_parser(sub)
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except KeyboardInterrupt:
        print("hybrid-jax: interrupted", file=sys.stderr)
        code = 130
    raise SystemExit(code)


def _version() -> str:
    try:
        return importlib.metadata.version("hybrid-jax")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"
