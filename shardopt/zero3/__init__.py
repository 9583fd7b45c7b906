"""Stage 3 (ZeRO-3): parameters sharded too; the wing that answers "what differs at stage 3?".

store.py      the sharded parameter store (Note [One parameter store] in param_store.py): this rank's
              chunks, a bucket's full parameters while gathered, the life cycle of a bucket
              (BucketState) and of a pass (Pass), meta-device models built shard by shard
schedule.py   which bucket every rank gathers when (pure: Note [Stage-3 schedule])
hooks.py      where the model's modules and autograd call into the store
inference.py  a frozen model sharded for forwards without gradients (shard_for_inference: a DPO reference,
              a teacher), the same store with no optimizer (Note [Models sharded for inference])
"""
