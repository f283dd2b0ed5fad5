"""The speculative loop: one `Generation` per request, over one strategy per way of drafting (see generation.py)."""

from services.gateway.speculation.generation import Generation, choose_strategy
from services.gateway.speculation.state import GenerationOptions, GenerationRequest, GenerationStats

__all__ = ["Generation", "GenerationOptions", "GenerationRequest", "GenerationStats", "choose_strategy"]
