"""Command line entry point (filled in by the demo work)."""


def main() -> None:
    raise SystemExit("hybrid-jax: not built yet")
