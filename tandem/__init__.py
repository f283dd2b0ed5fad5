"""tandem: speculative decoding across mismatched hardware.

The shared core used by the three services: the llama.cpp engine wrapper with per-session KV state
(`engine`, `sessions`), the lossless sampling math (`sampling`), configuration (`config`), typed errors
(`errors`), the gRPC server scaffolding (`grpc_server`) and the generated contract (`tandem.v1`, from `make proto`).
"""

__version__ = "0.1.0"
