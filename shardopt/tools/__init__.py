"""The command line (`shardopt ...`, `python -m shardopt`) and what it runs: demo, bench, tune, plots,
the progress bar and the demo GPT. Never imported by the engine."""
