"""A one-line progress bar on stderr for long start-up work (compiling, loading weights)."""

from __future__ import annotations

import sys
import time

__all__ = ["Progress"]


class Progress:
    """``total`` items, one ``__call__(label)`` each: a bar redrawn in place on a terminal, a
    plain line every ``every`` items (and at the end) otherwise; silent when not ``enabled``.

    ``doing`` / ``done`` / ``items`` word the lines: "compiling [###   ] 3/8 label 12 s, ~20 s
    left" and "compiled 8/8 executables in 31 s"; the time left assumes the items left take
    as long on average as those done.
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
        self.start = time.perf_counter()

    def _times(self) -> str:
        spent = time.perf_counter() - self.start
        if self.count >= self.total:
            return f"in {spent:.0f} s"
        left = spent / self.count * (self.total - self.count)
        return f"{spent:.0f} s, ~{left:.0f} s left"

    def __call__(self, label: str = "") -> None:
        self.count += 1
        if not self.enabled:
            return
        if self.interactive:
            bar = "#" * (30 * self.count // max(self.total, 1))
            end = "\n" if self.count == self.total else ""
            print(
                f"\r{self.doing} [{bar:<30}] {self.count}/{self.total} {label:<24} "
                f"{self._times():<22}",
                end=end,
                file=sys.stderr,
                flush=True,
            )
        elif self.count == self.total or self.count % self.every == 0:
            print(
                f"{self.done} {self.count}/{self.total} {self.items} {self._times()}",
                file=sys.stderr,
                flush=True,
            )
