import pytest

from kvflow_agents.testing import RecordingOpenAIServer


@pytest.fixture
def recording_server():
    """A real OpenAI-shaped HTTP server on 127.0.0.1 that records every request."""
    with RecordingOpenAIServer() as srv:
        yield srv
