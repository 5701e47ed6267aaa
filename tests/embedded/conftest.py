"""Shared fixtures for the embedded-engine model tests."""

import pytest

from kvflow_agents.serving.embedded.model import load_model


@pytest.fixture(scope="session")
def tiny32():
    return load_model("tiny-random", dtype="float32")


@pytest.fixture(scope="session")
def tiny16():
    return load_model("tiny-random")  # bf16, the default


@pytest.fixture(scope="session")
def smollm2():
    from kvflow_agents.serving.embedded.model.gguf_loader import ModelNotFoundError, locate_gguf
    try:
        locate_gguf()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    return load_model("smollm2-135m")

