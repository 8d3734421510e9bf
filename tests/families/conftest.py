from __future__ import annotations

import pytest

from batchvlm.config import ModelConfig
from batchvlm.families import FAMILIES, load_family


@pytest.fixture(scope="session", params=sorted(FAMILIES))
def family(request):
    """Each family with its tiny demo checkpoint."""
    return load_family(ModelConfig(family=request.param))
