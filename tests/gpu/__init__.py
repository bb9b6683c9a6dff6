"""Tests that need a CUDA device; each module skips cleanly where there is none."""
