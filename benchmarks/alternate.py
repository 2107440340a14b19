"""Two trainers timed in turn, each in this process or in a child process of its own.

A trainer in a child process runs under its own process settings (glibc's malloc, thread
pools, the other framework absent), so each side can run as its users run it: train.py's
malloc setting on our side only, glibc's defaults on PyTorch's. The parent sends a line per
command on the child's stdin and reads one JSON line back (after `REPLY`); the child times
its own steps, so the pipe is outside the timed region. While one side runs, the other waits
on its stdin and takes no CPU.
"""

import contextlib
import json
import resource
import subprocess
import sys

REPLY = "@@alternate "  # the prefix of the child's protocol lines; other output passes through


class InProcess:
  """A trainer (`run(steps) -> seconds`) in this process; `info()` describes it."""

  def __init__(self, trainer, info):
    self.trainer, self.info = trainer, info

  def run(self, steps: int) -> tuple[float, int]:
    """Seconds for `steps` steps, and the page faults (fresh pages mapped in) they took."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    seconds = self.trainer.run(steps)
    return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

  def close(self, wait: bool = True) -> None:
    pass


class ChildError(RuntimeError):
  """A child process ended or answered out of protocol."""


class ChildProcess:
  """A trainer served by `serve()` in a child process started with `cmd`."""

  def __init__(self, cmd: list[str], name: str, env: dict | None = None):
    # stderr passes through: a child's traceback reaches the user as it is written.
    self.name = name
    self.proc = subprocess.Popen(
      cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    self._ready = None

  def _reply(self) -> dict:
    for line in self.proc.stdout:
      # A reply may follow output the child wrote without a newline (a C library's, say).
      output, found, reply = line.partition(REPLY)
      if output:
        sys.stdout.write(output if found else line)  # the child's own prints
      if found:
        return json.loads(reply)
    code = self.proc.wait()
    raise ChildError(f"the {self.name} process exited with status {code} before answering")

  def _ask(self, command: str) -> dict:
    if self._ready is None:
      self.wait_ready()
    try:
      self.proc.stdin.write(command + "\n")
      self.proc.stdin.flush()
    except BrokenPipeError:
      raise ChildError(f"the {self.name} process exited with status {self.proc.wait()}") from None
    return self._reply()

  def wait_ready(self) -> None:
    """Blocks until the child has built, compiled and warmed up its trainer."""
    if self._ready is None:
      self._ready = self._reply()

  def run(self, steps: int) -> tuple[float, int]:
    reply = self._ask(f"run {steps}")
    return reply["seconds"], reply["faults"]

  def info(self) -> dict:
    return self._ask("info")

  def close(self, wait: bool = True) -> None:
    """Ends the child: at the end of its input (serve() returns) when `wait`, else at once (it
    may still be compiling, after an error elsewhere)."""
    with contextlib.suppress(BrokenPipeError):
      self.proc.stdin.close()
    if self.proc.poll() is None:
      if not wait:
        self.proc.terminate()
      try:
        self.proc.wait(timeout=60 if wait else 10)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
    self.proc.stdout.close()


def serve(side: InProcess) -> None:
  """The child's loop: `run N` -> {"seconds", "faults"}; `info` -> side.info(); EOF ends it.

  Call it once the trainer is built and warmed up: the first line it writes says so.
  """

  def reply(obj: dict) -> None:
    sys.stdout.write(REPLY + json.dumps(obj) + "\n")
    sys.stdout.flush()

  reply({"ready": True})
  for line in sys.stdin:
    command, *args = line.split()
    if command == "run":
      seconds, faults = side.run(int(args[0]))
      reply({"seconds": seconds, "faults": faults})
    elif command == "info":
      reply(side.info())
    else:
      raise ValueError(f"unknown command {line!r}")


def alternate(sides: list, steps: int, repeats: int) -> list[list[tuple[float, int]]]:
  """`repeats` rounds of `steps` steps of each side in turn; per side, (seconds, faults) each
  round. Every side has warmed up before (a child, when it says it is ready: its first `run`
  waits for that)."""
  runs = [[] for _ in sides]
  for _ in range(repeats):  # in turn, so both see the same machine load
    for side, out in zip(sides, runs, strict=True):
      out.append(side.run(steps))
  return runs
