"""Model weights in the formats other tools read and write (Hugging Face folders), streamed.

format.py, reader.py, writer.py   the files: any element range read, a safetensors folder written in pieces
conversions.py                    the file's tensors as transformers' loading rules make them for the model
names.py                          which model tensor each key is: tied weights, PEFT and prefix renamings
stream.py                         load_weights / save_weights / from_pretrained, each rank its part
rank0.py                          a whole state dict on rank 0 (Lightning), streamed and spilled
"""
from shardopt.weights.stream import (WeightsError, from_pretrained, load_weights, parameters_on_meta,  # noqa: F401
                                     save_weights)
