"""Chart tests render with the real Helm library (see chart_render.py)."""

from __future__ import annotations

import pytest
from chart_render import GPU_VALUES, values_file


@pytest.fixture(params=[None, GPU_VALUES], ids=["default", "gpu"])
def chart_values(request) -> dict:
    return values_file(request.param)
