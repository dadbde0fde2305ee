"""Binaries run as ``python -m``/``python -c`` would, without paying
Python's start-up and imports again for each run.

A run of a binary in a fresh Python spends ~2 CPU-s on 2 cores importing
jax, flax, optax, orbax and the library before its first line of work; the
integration tests start dozens. A *zygote* is one Python that has made
those imports and nothing else (no JAX backend, no flags parsed), and
forks a child per run. The child takes the run's
environment, working directory and output files, then runs the module
(``runpy`` as ``__main__``, as ``-m`` does) or the code (as ``-c``) and
exits as CPython would: ``SystemExit``'s status, 1 and a traceback for an
exception, death by SIGINT for an uncaught ``KeyboardInterrupt``, after
joining threads and running ``atexit`` functions. XLA reads ``XLA_FLAGS``
when a backend starts, so each child picks its own device count.

What jax reads at import (its ``JAX_*`` variables, ...) is the zygote's,
so a run gets a zygote started with its environment (but for
:data:`_LATE`, read after import); one per environment and process.

CPU accounting: a child is the zygote's, not the test's, so the test's
``RUSAGE_CHILDREN`` would miss it. The zygote reaps each child with
``wait4`` and reports its user + sys (and its own start-up's) to
:data:`CPU_S`, which tests/cpu_profile.py adds to the test that waits.
"""

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CPU_S = [0.0]
"""CPU-seconds of the zygotes' children waited for, and of the zygotes'
start-up, in this process so far."""

# Read after jax's import (by XLA at a backend's start, by a binary, by
# tempfile when asked, by pytest per test): they may differ per run.
_LATE = ("XLA_FLAGS", "TMPDIR", "PYTHONUNBUFFERED", "PYTEST_CURRENT_TEST")
_LATE_PREFIXES = ("SLURM_", "HMMPROMPT_")

_DRIVER = r"""
import atexit, importlib, json, os, resource, runpy, select, signal, sys
import tempfile, threading, time, traceback, types
reply = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # nothing but replies on the pipe
for shared in ("jax", "flax.linen", "optax", "orbax.checkpoint",
               "experiments", "experiments.cli", "hmmprompt.pretrain"):
  importlib.import_module(shared)
def send(**x):
  reply.write(json.dumps(x) + "\n")
  reply.flush()
own = resource.getrusage(resource.RUSAGE_SELF)
send(ready=own.ru_utime + own.ru_stime)
wake_r, wake_w = os.pipe()
os.set_blocking(wake_w, False)
signal.signal(signal.SIGCHLD, lambda *_: None)
signal.set_wakeup_fd(wake_w)
status = {}

def finish(code):
  for f in (sys.stdout, sys.stderr):
    try:
      f.flush()
    except Exception:
      pass
  threading._shutdown()
  atexit._run_exitfuncs()
  for f in (sys.stdout, sys.stderr):
    try:
      f.flush()
    except Exception:
      pass
  if code == "SIGINT":
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    code = 130
  os._exit(code)

def child(r):
  signal.set_wakeup_fd(-1)
  signal.signal(signal.SIGCHLD, signal.SIG_DFL)
  for fd in (wake_r, wake_w, reply.fileno()):
    os.close(fd)
  if r["new_session"]:
    os.setsid()
  os.chdir(r["cwd"])
  os.environ.clear()
  os.environ.update(r["env"])
  tempfile.tempdir = None
  os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
  flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
  os.dup2(os.open(r["out"], flags), 1)
  os.dup2(os.open(r["err"], flags) if r["err"] else 1, 2)
  if r["env"].get("PYTHONUNBUFFERED"):
    sys.stdout.reconfigure(write_through=True)
  argv = r["argv"]
  try:
    if argv[0] == "-m":
      sys.argv = argv[1:]  # runpy sets [0] to the module's file
      runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
      sys.argv = ["-c", *argv[2:]]
      main = types.ModuleType("__main__")
      sys.modules["__main__"] = main
      exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    code = 0
  except SystemExit as x:
    code = x.code
    if code is None:
      code = 0
    elif not isinstance(code, int):
      print(code, file=sys.stderr)
      code = 1
  except BaseException as x:  # its traceback without this frame
    sys.excepthook(type(x), x, x.__traceback__.tb_next)
    code = "SIGINT" if isinstance(x, KeyboardInterrupt) else 1
  finish(code if code == "SIGINT" else code & 0xFF)

def reap():
  while status:
    try:
      pid, st, use = os.wait4(-1, os.WNOHANG)
    except ChildProcessError:
      return
    if pid == 0:
      return
    path = status.pop(pid)
    with open(path + ".tmp", "w") as f:
      json.dump({"returncode": os.waitstatus_to_exitcode(st),
                 "cpu_s": use.ru_utime + use.ru_stime}, f)
    os.replace(path + ".tmp", path)

buf, eof = b"", False
while not eof:
  ready, _, _ = select.select([0, wake_r], [], [])
  if wake_r in ready:
    os.read(wake_r, 512)
  reap()
  if 0 in ready:
    data = os.read(0, 1 << 16)
    eof = not data
    buf += data
    while b"\n" in buf:
      line, buf = buf.split(b"\n", 1)
      r = json.loads(line)
      pid = os.fork()
      if pid == 0:
        try:
          child(r)
        finally:  # child() ends in os._exit; this is its own failure
          traceback.print_exc()
          os._exit(1)
      status[pid] = r["status"]
      send(pid=pid)
for pid in list(status):  # the tests are over: none outlives them
  os.kill(pid, signal.SIGKILL)
while status:
  if select.select([wake_r], [], [], 1)[0]:
    os.read(wake_r, 512)
  reap()
"""

_zygotes: dict = {}
_dirs: list = []  # each run's output files, removed at exit


def _key(env: dict) -> tuple:
  return tuple(sorted((k, v) for k, v in env.items() if k not in _LATE
                      and not k.startswith(_LATE_PREFIXES)))


def _zygote(env: dict) -> subprocess.Popen:
  key = _key(env)
  z = _zygotes.get(key)
  if z is None or z.poll() is not None:
    z = subprocess.Popen([sys.executable, "-c", _DRIVER], cwd=ROOT, env=env,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    CPU_S[0] += json.loads(z.stdout.readline())["ready"]
    _zygotes[key] = z
  return z


@atexit.register
def _close():
  for z in _zygotes.values():
    z.stdin.close()
    z.wait()
  for d in _dirs:
    shutil.rmtree(d, ignore_errors=True)


class Process:
  """A run in a zygote's child, with the part of ``subprocess.Popen``'s
  interface the tests use; its output is in files (``stdout_path``,
  ``stderr_path``), read by :meth:`communicate` and :meth:`output`."""

  def __init__(self, argv, env, cwd, new_session, merge_stderr):
    self.args = argv
    self.returncode = None
    self._dir = tempfile.mkdtemp(prefix="zygote-")
    _dirs.append(self._dir)
    self.stdout_path = os.path.join(self._dir, "stdout")
    self.stderr_path = None if merge_stderr else os.path.join(self._dir,
                                                              "stderr")
    self._status = os.path.join(self._dir, "status")
    z = _zygote(env)
    z.stdin.write(json.dumps({
        "argv": argv, "env": env, "cwd": cwd, "new_session": new_session,
        "out": self.stdout_path, "err": self.stderr_path,
        "status": self._status}) + "\n")
    z.stdin.flush()
    self.pid = json.loads(z.stdout.readline())["pid"]

  def poll(self):
    if self.returncode is None and os.path.exists(self._status):
      with open(self._status) as f:
        end = json.load(f)
      CPU_S[0] += end["cpu_s"]
      self.returncode = end["returncode"]
    return self.returncode

  def wait(self, timeout=None):
    deadline = None if timeout is None else _now() + timeout
    while self.poll() is None:
      if deadline is not None and _now() > deadline:
        raise subprocess.TimeoutExpired(self.args, timeout)
      time.sleep(0.02)
    return self.returncode

  def send_signal(self, sig):
    if self.poll() is None:
      os.kill(self.pid, sig)

  def kill(self):
    self.send_signal(9)

  def output(self) -> tuple[str, str | None]:
    """``(stdout, stderr)`` as written so far (stderr ``None`` if merged)."""
    read = lambda p: None if p is None else open(p, errors="replace").read()
    return read(self.stdout_path), read(self.stderr_path)

  def communicate(self, timeout=None):
    self.wait(timeout)
    return self.output()


def _now() -> float:
  return time.monotonic()


def popen(argv: list[str], env: dict | None = None, cwd: str = ROOT,
          start_new_session: bool = False,
          merge_stderr: bool = False) -> Process:
  """``argv`` as after ``python``: ``["-m", MODULE, *ARGS]`` or ``["-c",
  CODE, *ARGS]``; ``env`` the whole environment (default: this one's)."""
  if argv[0] not in ("-m", "-c"):
    raise ValueError(f"argv starts with -m or -c, not {argv[0]!r}")
  return Process(argv, dict(os.environ if env is None else env), cwd,
                 start_new_session, merge_stderr)


def run(argv: list[str], env: dict | None = None, cwd: str = ROOT,
        timeout: float = 300) -> subprocess.CompletedProcess:
  """:func:`popen`, waited for, as ``subprocess.run(capture_output=True,
  text=True)`` returns it; killed and ``TimeoutExpired`` past ``timeout``."""
  p = popen(argv, env, cwd)
  try:
    out, err = p.communicate(timeout)
  except subprocess.TimeoutExpired:
    p.kill()
    p.wait()
    raise
  return subprocess.CompletedProcess(argv, p.returncode, out, err)
