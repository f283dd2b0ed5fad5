"""The gateway: OpenAI-compatible HTTP API that drives speculative rounds over the two gRPC services."""
