"""Render chat messages with the model's own Jinja chat template (read from the GGUF by the target service).

The template runs in Jinja's sandbox: it comes from a model file, which is data, not code we trust.
"""

from __future__ import annotations

from datetime import datetime

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.gateway.errors import OpenAIError

# Used when a model has no template (base models): a plain transcript the model can continue.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


# Gemma's turn format, for a Gemma GGUF without a template (the base 270M from PyPI): no system role, so system
# messages become user turns; the model ends its turn with <end_of_turn>, an end-of-generation token.
GEMMA_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def fallback_template(architecture: str) -> str:
    """The template for a model whose GGUF has none."""
    return GEMMA_TEMPLATE if architecture.startswith("gemma") else FALLBACK_TEMPLATE


def _raise(message: str) -> None:
    raise TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", architecture: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source or fallback_template(architecture)
        self._template = env.from_string(self.source)
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """The prompt; `tools` (OpenAI's tool objects) go to templates that know tools, as Hugging Face passes them."""
        extra = {"tools": tools} if tools else {}
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except TemplateError as exc:
            raise OpenAIError(400, f"the model's chat template rejected the messages: {exc}", "messages") from exc
