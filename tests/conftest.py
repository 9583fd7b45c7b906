import os
import sys

# Spawned ranks import test modules by name; make tests/ importable for them.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
