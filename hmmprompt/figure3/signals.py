"""Finished cells survive SIGTERM and SIGINT: :func:`archive_on_signal`
writes a chunk's archive within seconds, even inside a long compiled program
(too late for a Python handler): a thread woken by :func:`signal.set_wakeup_fd`
writes it from the files on disk (atomic rewrites) and ends the process."""

import contextlib
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# One archive writer at a time: the watcher waits for the main thread's
# own archive to be written, then writes it again with the signal named.
_LOCK = threading.Lock()


def locked(fn: Callable[[], None]) -> None:
  """``fn()`` under the archive lock (the main thread's final archive)."""
  with _LOCK:
    fn()


@contextlib.contextmanager
def archive_on_signal(save: Callable[[str], None], workdir: str | None = None,
                      resume: str = "") -> Iterator[None]:
  """While inside, SIGTERM or SIGINT calls ``save(signal name)`` from a watcher
  thread, removes ``workdir`` (``None``: keep), prints a line naming the signal
  and ``resume``, exits with 128 + its number. A no-op off the main thread."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)  # set_wakeup_fd's requirement
  # Handlers that do nothing: the watcher thread acts; the main thread goes on.
  before = {sig: signal.signal(sig, lambda *_: None) for sig in SIGNALS}
  old_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
  done = threading.Event()
  def watch() -> None:
    while True:
      data = os.read(read_fd, 64)
      if done.is_set() or not data:
        return
      if not (sigs := [b for b in data if b in SIGNALS]):
        continue
      name = signal.Signals(sigs[0]).name
      try:
        with _LOCK:
          save(name)
        outcome = "archive written"
      except Exception as e:  # the line below must still be printed
        outcome = f"no archive ({type(e).__name__}: {e})"
      if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)
      print(f"stopped by {name}: {outcome}; {resume}", file=sys.stderr,
            flush=True)
      os._exit(128 + sigs[0])
  thread = threading.Thread(target=watch, name="archive-on-signal", daemon=True)
  thread.start()
  try:
    yield
  finally:
    done.set()
    signal.set_wakeup_fd(old_fd)
    for sig, handler in before.items():
      signal.signal(sig, handler)
    os.write(write_fd, b"\0")  # wakes the watcher, which returns
    thread.join()
    os.close(read_fd)
    os.close(write_fd)
