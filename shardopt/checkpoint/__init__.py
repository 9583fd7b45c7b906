"""Checkpoints: shardopt's own format and the formats it reads and writes.

save_load.py        save_checkpoint / load_checkpoint (any world size, any stage)
source.py           the Source interface every reader implements (native, DeepSpeed)
files.py            the files: manifest, records, atomic writes
pieces.py           element ranges of parameters and their optimizer state
optim_state.py      torch.optim-format state dicts (consolidate_state_dict)
convert.py          `shardopt convert`: a checkpoint to one torch file
deepspeed_reader.py DeepSpeed ZeRO-1/2 checkpoint folders in
deepspeed_zero3.py  DeepSpeed ZeRO-3 checkpoint folders in (and which reader a folder needs)
dcp.py              torch.distributed.checkpoint state dicts (FSDP2 interop)

They see a ShardedOptimizer only through `opt.view` (Note [The optimizer's view] in view.py).
"""
