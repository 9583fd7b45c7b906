"""Model weights in the formats other tools read and write (Hugging Face folders), streamed.

hf_files.py   Hugging Face weight files: any element range of a tensor read, safetensors folders
              written in pieces (pure file I/O, no process group)
names.py      which model tensor each key of a file is: tied weights, PEFT and prefix renamings (pure)
stream.py     load_weights / save_weights / from_pretrained: every rank reads or gathers only its part,
              bucket by bucket
rank0.py      a whole state dict on rank 0 for APIs that need one object (Lightning), streamed and spilled
"""
from shardopt.weights.stream import (WeightsError, from_pretrained, load_weights, parameters_on_meta,  # noqa: F401
                                     save_weights)
