"""Progress for the user on stderr: one line prefixed with the program's name (`say`), or a bar for
work that reports how far it has got (`Bar`: a long prefill), shown only once it has taken a while."""

from __future__ import annotations

import sys
from typing import Any

BAR_DELAY_S = 2.0  # work shorter than this shows no bar: a bar that flashes by tells nothing


def say(progress: bool, message: str) -> None:
    """Print `specextend: message` on stderr when `progress` is on (commands turn it off with -q)."""
    if progress:
        print(f"specextend: {message}", file=sys.stderr, flush=True)


class Bar:
    """A tqdm bar on stderr fed `(done, total)` (a `ProgressCallback`), made at the first report
    and drawn only once the work has taken BAR_DELAY_S; it goes away when done reaches total."""

    def __init__(self, desc: str, unit: str = "tok", progress: bool = True) -> None:
        self.desc, self.unit, self.progress = desc, unit, progress
        self._bar: Any = None

    def __call__(self, done: int, total: int) -> None:
        if not self.progress:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=f"specextend: {self.desc}", unit=self.unit, delay=BAR_DELAY_S,
                             file=sys.stderr, leave=False, dynamic_ncols=True)
        self._bar.update(done - self._bar.n)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
