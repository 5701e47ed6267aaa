import pytest

from kvflow_agents.testing import RecordingOpenAIServer


@pytest.fixture
def recording_server():
    """A real OpenAI-shaped HTTP server on 127.0.0.1 that records every request."""
    with RecordingOpenAIServer() as srv:
        yield srv


@pytest.fixture(autouse=True)
def _fresh_default_transitions():
    """Each test starts from an empty process-wide transition model (the adapters learn into it;
    without a reset, one test's runs would change another's expected STE)."""
    from kvflow_agents.graph.learned import default_model

    default_model().reset()
    yield
    default_model().reset()
