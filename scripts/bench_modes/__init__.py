"""scripts/bench.py's modes, one module each; every module's `main(argv)` takes the arguments after the mode."""
