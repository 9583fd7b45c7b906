"""save_checkpoint(..., blocking=False): the part of each rank staged now, written and committed behind training.

    handle = shardopt.save_checkpoint("ckpt", model, opt, blocking=False)   # returns once staged
    ...training goes on...
    handle.result()          # waits; the committed folder, or CheckpointError (as DCP's async_save Future)

Note [Checkpoints written behind training]
------------------------------------------
Stage, in the caller's thread while training waits: every collective of the save but the commit (the tag from
rank 0, stage 3's gather of frozen buckets) and a copy of this rank's part into host memory kept from save to
save (Note [Staging a checkpoint] in staging.py; pinned when the values are on a GPU). The manifest's head
(hyper-parameters, loss scale) is taken then too, so training after the call changes nothing saved.
Write, in a thread of this process at a lower CPU priority than training: the staged files written and
fsynced, then the exchange of a blocking save (parallel/consistency.py) over a gloo group of the save's own,
made at the first such save, so that it never interleaves with training's collectives. Rank 0 renames and
moves `latest` once every rank's files are durable; a failure anywhere leaves `latest` on the previous one.
One save in flight: the next save_checkpoint or load_checkpoint waits for it (its staging memory is the next
one's), then, on every rank (a collective), raises its failure if any rank has one that result() did not
raise there. At exit the thread is waited for (it is no daemon) and a failure nobody was told of is printed.
Call result() before destroy_process_group: the commit needs the save's group.
A thread, not a process: the writer spends its time in write(), fsync and crc32, all outside the GIL, and a
process would add shared staging memory and a second process group for the commit; benchmarks/async_checkpoint.py
measures how much each slows the training step.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref

import torch.distributed as dist

from shardopt import device_ops
from shardopt.checkpoint.staging import Staging, host_alloc, write_staged
from shardopt.files import CheckpointError
from shardopt.parallel.consistency import exchange, first_failure, lost, whoami
from shardopt.parallel.mesh import copy_group
from shardopt.parallel.peers import processes, ranks_at_address

WRITER_NICE = 10  # added to the writer thread's nice value: training's threads come first on a busy host


class AsyncSave:
    """What save_checkpoint(blocking=False) returns: `result()` waits for the background write and commit."""

    def __init__(self, path: str, tag: str):
        self.path, self.tag = path, tag
        self.reported = False  # whether result() raised or returned the outcome on this rank
        self._done = threading.Event()
        self._error: str | None = None

    def done(self) -> bool:
        """Whether the write and commit are over (done or failed)."""
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> str:
        """The committed checkpoint folder, once written on every rank; raises CheckpointError if the save failed
        (TimeoutError if still being written after `timeout` seconds)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the checkpoint {self.path} is still being written")
        self.reported = True
        if self._error is not None:
            raise CheckpointError(f"the background save of {self.path} failed: {self._error}")
        return self.path

    def _finish(self, error: str | None) -> None:
        self._error = error
        self._done.set()


class Saver:
    """One optimizer's background saves: the staging memory, the save's process group, the save in flight."""

    def __init__(self, opt):
        pin = opt.master_device.type != "cpu" and device_ops.current().can_pin()
        self.staging = Staging(host_alloc(pin))
        self.group = copy_group(opt.process_group, backend="gloo") if opt.world_size > 1 else opt.process_group
        # peers[r]: rank r's (host, pid), to name a lost one (heard when the optimizer was built)
        self.peers = processes(self.group) if opt.world_size > 1 else [whoami()]
        self.current: AsyncSave | None = None
        self.thread: threading.Thread | None = None

    def sink(self):
        """The record sink of a new save: its files staged into this saver's memory."""
        self.staging.begin()
        return self.staging.file

    def start(self, written, commit) -> AsyncSave:
        """The write and commit of `written` (save_load.Written, staged) begin in the background."""
        handle = AsyncSave(written.final, written.tag)
        self.current = handle
        self.thread = threading.Thread(target=_write_behind, args=(self, handle, written, commit),
                                       name=f"shardopt checkpoint writer ({written.tag})")
        _SAVERS.add(self)
        self.thread.start()
        return handle

    def wait(self) -> AsyncSave | None:
        """The save in flight, once its thread is over (None: there was none); it is no longer in flight."""
        handle, self.current = self.current, None
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        return handle


def saver_of(opt) -> Saver:
    """`opt`'s Saver (a collective the first time: it makes the save's process group)."""
    if opt.saver is None:
        opt.saver = Saver(opt)
    return opt.saver


def settle(opt) -> None:
    """Waits for `opt`'s save in flight; raises on every rank (a collective) if it failed on any rank and was not
    reported there (Note [Checkpoints written behind training])."""
    saver = opt.saver
    if saver is None or saver.current is None:  # the same on every rank: saves are collectives
        return
    handle = saver.wait()
    error = None
    if handle._error is not None and not handle.reported:
        error = CheckpointError(f"the background save of {handle.path} failed: {handle._error}")
    handle.reported = True
    try:
        failed = first_failure(error, opt.world_group)
    except CheckpointError:
        raise
    except Exception as e:  # a peer is gone: this rank's own failure says more than the collective's
        if error is not None:
            raise error from e
        raise
    if failed:
        rank, message = failed
        raise CheckpointError(f"rank {rank}: {message}")


def lost_while_staging(opt, path: str, error: RuntimeError) -> CheckpointError | None:
    """What save_checkpoint(blocking=False) raises instead of `error`, a failure of its call, when a peer is found
    gone (its process exited on this host, or gloo's error names its address): a CheckpointError saying so and that
    nothing of the save was committed. None: no peer is known to be gone, `error` is raised as it is."""
    if isinstance(error, CheckpointError) or opt.world_size == 1:
        return None
    group = opt.world_group
    known = processes(group)  # the world's, heard when the optimizer was built (Note [Naming a peer])
    gone = lost(group, known, otherwise=None) if known is not None else None
    gone = gone or ranks_at_address(str(error))
    if gone is None:
        return None
    return CheckpointError(f"save_checkpoint({path!r}, blocking=False) failed on rank {dist.get_rank()} while it "
                           f"staged its part: {gone} lost; nothing of this save was committed (`latest` names "
                           f"the previous checkpoint): {type(error).__name__}: {str(error).strip()}")


def _lower_priority() -> None:
    """This thread (Linux: a thread has a nice value of its own) yields the CPU to training."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICE))
    except (AttributeError, OSError):
        pass


def _write_behind(saver: Saver, handle: AsyncSave, w, commit) -> None:
    """The writer thread: the staged files, then the exchange and rank 0's commit."""
    error = None
    try:
        _lower_priority()
        if "error" not in w.mine:
            try:
                for f in w.files:
                    f.entry.update(write_staged(f.plan()))
            except Exception as e:  # noqa: BLE001 - rank 0 must learn of it and abandon the save
                w.mine = {"error": f"{w.me}: {type(e).__name__}: {e}"}
        exchange(saver.group, w.mine, commit, f"checkpoint {w.final}", CheckpointError)
    except CheckpointError as e:
        error = str(e)
    except BaseException as e:  # noqa: BLE001 - raised by result() or the next save or load
        error = f"{lost(saver.group, saver.peers)} lost while it was written: {type(e).__name__}: {e}"
    finally:
        handle._finish(error)


_SAVERS: "weakref.WeakSet[Saver]" = weakref.WeakSet()


@atexit.register
def _report_at_exit() -> None:
    """A background save that failed and that no result(), save or load reported: said once, at exit."""
    for saver in list(_SAVERS):
        handle = saver.current
        if handle is not None and handle.done() and handle._error is not None and not handle.reported:
            print(f"shardopt: the background save of {handle.path} failed: {handle._error}", file=sys.stderr)
