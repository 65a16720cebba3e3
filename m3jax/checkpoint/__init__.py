"""Checkpoint I/O: the only package that knows MiniMax / HF tensor names."""
