"""llama.cpp as a benchmark peer: build it (build_llamacpp.py), the same weights (weights.py), the comparison (run.py)."""
