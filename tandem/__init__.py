"""tandem: speculative decoding across mismatched hardware.

The shared core used by the three services: the llama.cpp engine wrapper with per-session KV state
(`engine`, `sessions`), warping and sampling (`sampling`) and the lossless acceptance rule (`acceptance`), prompt
lookup (`ngram`), continuous batching on one engine thread (`scheduler`, `worker`), configuration (`config`), typed
errors (`errors`), the gRPC server scaffolding (`grpc_server`), telemetry, and the generated contract (`tandem.v1`,
from `make proto`).
"""

__version__ = "0.1.0"
# The gRPC contract's revision (InfoResponse.protocol_version): raised on any change an older peer would misread.
# With the draft on another node versions can skew; the gateway refuses a service whose revision differs.
PROTOCOL_VERSION = 3
