"""Model weights in the formats other tools read and write (Hugging Face folders).

hf_files.py   Hugging Face weight files: any element range of a tensor read, safetensors folders
              written in pieces (pure file I/O, no process group)
"""
