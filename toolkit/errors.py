"""The one error type users see: a message that names the file or option and what is wrong; and
signals that end a command the way Ctrl-C does."""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


class SpecPrefetchError(Exception):
    """A user-facing error. The CLI prints its message without a traceback and exits non-zero."""


def _interrupt(signum, frame):  # noqa: ARG001
    raise KeyboardInterrupt(signal.Signals(signum).name)


def install_signal_handlers() -> None:
    """Make SIGTERM and SIGHUP raise KeyboardInterrupt in the main thread, as SIGINT does, so a
    killed command takes the same cleanup paths as Ctrl-C (work directories and temporary files
    removed, resumable work kept). Idempotent; does nothing outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not _interrupt:
            signal.signal(sig, _interrupt)


@contextlib.contextmanager
def interrupt_on_signals() -> Iterator[None]:
    """For the duration of a write: SIGTERM and SIGHUP raise KeyboardInterrupt (as with
    install_signal_handlers), then the previous handlers are put back. Lets library callers (not
    only the CLI) clean up a killed write. Does nothing outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        old = signal.getsignal(sig)
        if old is not _interrupt:
            previous[sig] = old
            signal.signal(sig, _interrupt)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


def note_interrupt(e: BaseException, text: str) -> None:
    """Record on an interrupt (KeyboardInterrupt) what the interrupted writer left behind."""
    notes = getattr(e, "__notes__", None)
    if notes is None or text not in notes:
        e.add_note(text)


def interrupted_message(e: BaseException,
                        default: str = "nothing was written under the output name") -> str:
    """The one line to print for an interrupted command: what its writers say they kept (a
    resumable trace's OUT.partial) or removed, else `default`."""
    notes = [n for n in getattr(e, "__notes__", None) or () if n]
    return "interrupted: " + ("; ".join(notes) if notes else default)
