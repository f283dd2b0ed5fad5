"""The draft service: proposes the next tokens, with a small model or a model-free n-gram lookup."""
