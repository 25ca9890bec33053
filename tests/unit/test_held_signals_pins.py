"""Pins of megatron_ext.runtime.held_signals found by mutation audit round 9: each held signal reaches the handler it
would have gone to, once (the second at once, the first when the block ends), and off the main thread the block
just runs (Python lets only the main thread set handlers)."""

from __future__ import annotations

import os
import signal
import threading

from megatron_ext.runtime.held_signals import interrupts_held


def test_two_signals_reach_their_own_handlers_once_each():
    """A Ctrl-C then a SIGTERM, to handlers that record them (not raise): the SIGTERM, the second, goes to its
    handler at once, inside the block; the Ctrl-C when the block ends (HS7 delivered the SIGTERM twice and the Ctrl-C
    never, HS9 dropped the Ctrl-C); after a quiet block the handlers are back, and a signal goes straight to its
    own (HS6: the holding handler stayed, and swallowed it)."""
    seen = []
    previous = {s: signal.signal(s, lambda signum, frame: seen.append(signal.Signals(signum).name))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
            inside = list(seen)
        after = list(seen)
        with interrupts_held():
            pass
        os.kill(os.getpid(), signal.SIGTERM)  # after a quiet block: straight to the handler, nothing held
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert (inside, after, seen) == (["SIGTERM"], ["SIGTERM", "SIGINT"], ["SIGTERM", "SIGINT", "SIGTERM"])


def test_off_the_main_thread_the_block_just_runs():
    """In a worker thread the block runs and ends normally (HS1: signal.signal raised ValueError there)."""
    ran, errors = [], []

    def work():
        try:
            with interrupts_held():
                ran.append(True)
        except BaseException as e:  # reported to the main thread
            errors.append(e)

    before = signal.getsignal(signal.SIGINT)
    t = threading.Thread(target=work)
    t.start()
    t.join(10)
    assert (ran, errors) == ([True], []) and signal.getsignal(signal.SIGINT) is before
