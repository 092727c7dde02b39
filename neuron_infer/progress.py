"""Progress of the slow steps (converting the embedded model, compiling graphs, loading an artifact) on stderr.

On a terminal each step is a tqdm bar with elapsed time and ETA; anywhere else (logs, CI, pipes, tests) each step
prints one plain line through the caller's `say`, with the elapsed time and an ETA from the steps done so far.
The CLI turns bars off under --json (`set_bars(False)`); stdout is never written.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")
Say = Callable[[str], None]
_bars_allowed = True


def set_bars(allowed: bool) -> None:
    """Allow (default) or forbid progress bars in this process; bars also need stderr to be a terminal."""
    global _bars_allowed
    _bars_allowed = allowed


def bars_on() -> bool:
    return _bars_allowed and sys.stderr.isatty()


def clock(seconds: float) -> str:
    """12.3 s -> '0:12', 754 s -> '12:34', 4000 s -> '1:06:40'."""
    m, s = divmod(int(seconds + 0.5), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def steps(items: Iterable[T], what: str, say: Say, name: Callable[[T], str] = str, unit: str = "step") -> Iterator[T]:
    """Yield `items`, reporting each one as `what name` (e.g. "compiling ctx_128 (cpu)") before its work starts."""
    items = list(items)
    if bars_on():
        from tqdm import tqdm

        with tqdm(total=len(items), desc=what, unit=unit, file=sys.stderr, dynamic_ncols=True) as bar:
            for item in items:
                bar.set_postfix_str(name(item), refresh=True)
                yield item
                bar.update(1)
        return
    t0 = time.perf_counter()
    for i, item in enumerate(items):
        elapsed = time.perf_counter() - t0
        eta = f", ETA {clock(elapsed / i * (len(items) - i))}" if i else ""
        say(f"[{i + 1}/{len(items)}] {what} {name(item)} ({clock(elapsed)} elapsed{eta})")
        yield item


@contextmanager
def stages(what: str, names: list[str], say: Say | None, leave: bool = True) -> Iterator[Callable[[str], None]]:
    """A fixed list of named stages; the body calls `stage(name)` as each one starts (a bar on a terminal, else a
    line per stage through `say`; nothing when `say` is None)."""
    if not bars_on():
        t0 = time.perf_counter()
        if say is None:
            yield lambda s: None
        else:
            yield lambda s: say(f"{what}: {s} ({clock(time.perf_counter() - t0)} elapsed)")
        return
    from tqdm import tqdm

    with tqdm(total=len(names), desc=what, unit="stage", file=sys.stderr, dynamic_ncols=True, leave=leave) as bar:
        started: list[str] = []

        def stage(s: str) -> None:
            if started:
                bar.update(1)
            started.append(s)
            bar.set_postfix_str(s, refresh=True)

        yield stage
        bar.update(len(names) - bar.n)
