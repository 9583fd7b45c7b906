"""Stage 3 (ZeRO-3): parameters sharded too.

store.py composes the sharded parameter store (Note [One parameter store] in param_store.py) of buckets.py,
rounds.py, build.py, whole.py and hooks.py; schedule.py and passes.py plan and agree on the passes;
inference.py shards a frozen model for forwards without gradients.
"""
