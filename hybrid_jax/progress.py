"""A one-line progress bar on stderr for long start-up work (compiling, loading weights)."""

from __future__ import annotations

import sys

__all__ = ["Progress"]


class Progress:
    """``total`` items, one ``__call__(label)`` each: a bar redrawn in place on a terminal, a
    plain line every ``every`` items (and at the end) otherwise; silent when not ``enabled``.

    ``doing`` / ``done`` / ``items`` word the lines: "compiling [###   ] 3/8 label" and
    "compiled 8/8 executables".
    """

    def __init__(
        self,
        total: int,
        enabled: bool = True,
        *,
        doing: str = "compiling",
        done: str = "compiled",
        items: str = "executables",
        every: int = 8,
    ):
        self.total, self.count, self.enabled = total, 0, enabled
        self.doing, self.done, self.items, self.every = doing, done, items, every
        self.interactive = sys.stderr.isatty()

    def __call__(self, label: str = "") -> None:
        self.count += 1
        if not self.enabled:
            return
        if self.interactive:
            bar = "#" * (30 * self.count // max(self.total, 1))
            end = "\n" if self.count == self.total else ""
            print(
                f"\r{self.doing} [{bar:<30}] {self.count}/{self.total} {label:<24}",
                end=end,
                file=sys.stderr,
                flush=True,
            )
        elif self.count == self.total or self.count % self.every == 0:
            print(
                f"{self.done} {self.count}/{self.total} {self.items}", file=sys.stderr, flush=True
            )
