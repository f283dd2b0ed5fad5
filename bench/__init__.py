"""Benchmarks: tandem against target-only decoding and llama.cpp's llama-server (not part of the serving path)."""
