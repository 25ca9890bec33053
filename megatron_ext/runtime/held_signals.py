"""Ctrl-C and SIGTERM held over the command-line tools' heavy imports (torch, Megatron-Core, ModelOpt).

A KeyboardInterrupt raised inside the initialisation of their C++ extensions ended in a bare traceback, or aborted
the process (pybind11's 'terminate called ... error_already_set', exit -6), before the tool's one
`error: interrupted` line could be printed. Kept apart from `signals` (the handlers themselves); the standard
library only, so that a tool imports it before anything slow.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold a Ctrl-C or SIGTERM that comes in the block and deliver it, to the handler it would have gone to,
    when the block ends; a second one is delivered at once (a block that hangs).

    The handler is the one installed when the block begins (`sigterm_as_interrupt`'s, which raises the tool's
    KeyboardInterrupt after the imports, where the tool prints its line). A signal this process ignores (SIGINT in a
    `&` background job) stays ignored. Off the main thread nothing changes (only it may set handlers).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    held = [s for s, handler in previous.items() if handler is not signal.SIG_IGN]
    got: list[int] = []

    def hold(signum: int, frame) -> None:
        got.append(signum)
        if len(got) > 1:
            signal.signal(signum, previous[signum])
            signal.raise_signal(signum)

    for s in held:
        signal.signal(s, hold)
    try:
        yield
    finally:
        for s in held:
            signal.signal(s, previous[s])
    if got:
        signal.raise_signal(got[0])  # raises here (the tool's handler), or ends the process as the signal would have
