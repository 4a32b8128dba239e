"""The gateway tests' tokenizer: the character tokenizer with a ChatML-like template (gateway_helpers.CHATML)."""

import pytest
from gateway_helpers import CHATML

from plait.models import build_char_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    tok = build_char_tokenizer()
    tok.chat_template = CHATML
    return tok
