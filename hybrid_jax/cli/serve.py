"""``hybrid-jax serve``: the OpenAI-compatible HTTP server (``hybrid_jax.server``) on uvicorn.

The engine flags are those of ``generate``; the model is the built-in tiny one unless
``--checkpoint`` names a folder. Ctrl-C or SIGTERM stops accepting requests, lets those in
flight finish for up to ``--drain-s`` seconds, then aborts the rest and exits.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from hybrid_jax.cli.serving import _engine, _engine_arguments

__all__ = ["add_serve_parser", "build_server"]


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="an OpenAI-compatible HTTP server",
    )
    _engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument(
        "--max-waiting", type=int, default=256,
        help="requests that may wait for a slot before new ones get 503",
    )  # fmt: skip
    p.add_argument("--model-name", default=None, help="the id /v1/models lists")
    p.add_argument("--drain-s", type=float, default=30.0, help="grace period at shutdown (s)")
    p.set_defaults(func=serve)


def build_server(engine, *, host: str, port: int, model_name: str, max_waiting: int = 256,
                 drain_s: float = 30.0, log_level: str = "info"):  # fmt: skip
    """A ``uvicorn.Server`` of the API over ``engine`` (its worker started), not yet running."""
    try:
        import uvicorn

        from hybrid_jax.server.app import create_app
        from hybrid_jax.server.metrics import ServerMetrics
        from hybrid_jax.server.worker import EngineWorker
    except ImportError as err:
        raise ImportError(
            f"the server needs the serve extra: pip install 'hybrid-jax[serve]' ({err})"
        ) from err
    worker = EngineWorker(engine, max_waiting=max_waiting)
    metrics = ServerMetrics(worker.stats)
    worker.on_result = metrics.observe
    app = create_app(worker.start(), model_name=model_name, metrics=metrics)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # uvicorn re-raises a captured signal once it has shut down gracefully, so the
            # process would end killed by it; after a clean shutdown we exit with status 0.
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_s
    )
    return Server(config)


def serve(args: argparse.Namespace) -> int:
    if args.max_waiting < 1:
        print(f"hybrid-jax serve: --max-waiting={args.max_waiting} must be >= 1", file=sys.stderr)
        return 2
    if not 0 < args.port < 65536:
        print(f"hybrid-jax serve: --port={args.port} must be in 1..65535", file=sys.stderr)
        return 2
    engine = _engine(args, "serve", speculative=True)
    if engine is None:
        return 2
    name = args.model_name or (pathlib.Path(args.checkpoint).name if args.checkpoint else "tiny")
    server = build_server(
        engine, host=args.host, port=args.port, model_name=name, max_waiting=args.max_waiting,
        drain_s=args.drain_s,
    )  # fmt: skip
    server.run()
    return 0
