"""Faults the multi-rank tests inject into one rank."""
import os
import signal

import torch.distributed


def die_at_the_next_object_broadcast() -> None:
    """This process is SIGKILLed (no cleanup, no goodbye) when it next calls broadcast_object_list: in a save's
    commit that is the broadcast of rank 0's outcome, so rank 0 has committed or will."""
    def dying(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    torch.distributed.broadcast_object_list = dying
