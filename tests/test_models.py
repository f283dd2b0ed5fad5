"""Models by short name, session slots at the model's training context, and the template of a model with none."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.gateway.chat_template import FALLBACK_TEMPLATE, ChatTemplate
from tandem.config import session_layout
from tandem.models import default_model_path, resolve_model


@pytest.mark.parametrize(
    ("n_ctx", "max_sessions", "train", "expected"),
    [
        (32768, None, 8192, (4, 32768)),  # SmolLM2: four slots of its 8k
        (32768, None, 32768, (1, 32768)),  # Gemma 3 270M: one slot of 32k
        (4096, None, 8192, (1, 4096)),  # less than one training context: one slot of what there is
        (10**6, None, 8192, (16, 16 * 8192)),  # at most 16 slots, never more than the training context each
        (32768, 16, 8192, (16, 32768)),  # slots given: 2k each, as before
        (32768, 2, 8192, (2, 16384)),  # slots given: still no more than 8k each
    ],
)
def test_session_slots_follow_the_training_context(n_ctx, max_sessions, train, expected) -> None:
    assert session_layout(n_ctx, max_sessions, train) == expected


def test_models_by_short_name_or_path(tmp_path: Path) -> None:
    assert resolve_model(None) == resolve_model("smollm2-135m") == default_model_path()
    assert default_model_path().is_file()
    own = tmp_path / "mine.gguf"
    assert resolve_model(own) == own and resolve_model(str(own)) == own


def test_a_gemma_without_a_template_gets_gemmas_turn_format() -> None:
    template = ChatTemplate("", architecture="gemma3")
    prompt = template.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert prompt == (
        "<start_of_turn>user\nBe brief.<end_of_turn>\n<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    )
    assert ChatTemplate("", architecture="llama").source == FALLBACK_TEMPLATE
