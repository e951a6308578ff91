"""The SARATHI tests' model fixture (helpers live in engine_fixtures)."""

from __future__ import annotations

import pytest
from baton.model import CausalLM
from engine_fixtures import build_model


@pytest.fixture(scope="module")
def model() -> CausalLM:
    return build_model()
