"""The three prebuilt-agent quickstarts end to end against ``kvflow serve --model smollm2-135m``
(one server for the module): a ``create_react_agent`` with two tools, a ``langgraph-supervisor``
team and a ``langgraph-swarm``. Each must get valid tool calls from the real model (the
server's grammar), run its tools, and carry accepted kvflow hints on every LLM call."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from langchain_core.messages import ToolMessage

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
pytest.importorskip("xgrammar")
pytest.importorskip("langgraph_supervisor")
pytest.importorskip("langgraph_swarm")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def smollm2_server():
    from kvflow_agents.bench.server import BenchServer
    from kvflow_agents.serving.embedded.model.gguf_loader import ModelNotFoundError, locate_gguf

    try:
        locate_gguf()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    srv = BenchServer(["--model", "smollm2-135m", "--log-level", "warning", "--device-tokens", "8192"])
    srv.start()
    yield srv.base_url
    srv.stop()


def check_run(res, tools, *, min_calls: int):
    from examples.agents_common import check_tool_calls

    log = res["log"]
    assert len(log.calls) >= min_calls
    assert log.all_hinted, [(c.agent, c.hints_header) for c in log.calls]  # hints on every call, accepted
    assert all(c.status == 200 for c in log.calls)
    made = [t for c in log.calls for t in c.tool_calls]
    assert made, "the model made no tool call"
    assert check_tool_calls(log.calls, tools) == []  # named tools only, arguments valid for their schema
    ran = [m for m in res["messages"] if isinstance(m, ToolMessage)]
    assert ran and all(m.status != "error" for m in ran), [(m.name, m.content) for m in ran]
    return log


def test_react_agent_with_two_tools(smollm2_server):
    qs = load("quickstart_react_agent")
    res = qs.run(smollm2_server, "smollm2-135m", echo=False)
    log = check_run(res, qs.TOOLS, min_calls=2)
    first, second = log.calls[0], log.calls[1]
    assert first.agent == second.agent == "agent" and first.tool_calls
    assert second.step == first.step + 2  # the ToolNode took the step between
    assert first.ste["tools"] == 1 and first.next == ["tools"]
    assert res["app"].kvflow_graph.agents == ["agent", "tools"]


def test_supervisor_team(smollm2_server):
    qs = load("quickstart_supervisor")
    res = qs.run(smollm2_server, "smollm2-135m", "What is 6 times 7?", echo=False)
    log = check_run(res, qs.all_tools(), min_calls=3)
    sup = [c for c in log.calls if c.agent == "supervisor/agent"]
    assert sup and sup[0].tool_calls and sup[0].tool_calls[0]["name"].startswith("transfer_to_")
    worker = sup[0].tool_calls[0]["name"].removeprefix("transfer_to_")
    mine = [c for c in log.calls if c.agent == f"{worker}/agent"]
    assert mine and mine[0].step == sup[0].step + 3  # supervisor/agent -> post hook -> tools -> worker
    assert mine[0].ste[f"{worker}/tools"] == 1 and mine[0].ste["supervisor/agent"] >= 1
    assert any(isinstance(m, ToolMessage) and m.name == f"transfer_to_{worker}" for m in res["messages"])


def test_swarm(smollm2_server):
    qs = load("quickstart_swarm")
    res = qs.run(smollm2_server, "smollm2-135m", echo=False)
    log = check_run(res, qs.all_tools(), min_calls=2)
    agents = {c.agent for c in log.calls}
    assert agents <= {"flights/agent", "hotels/agent"} and "flights/agent" in agents
    first = log.calls[0]
    assert first.agent == "flights/agent" and first.ste["flights/tools"] == 1 and first.ste["hotels/agent"] == 2
