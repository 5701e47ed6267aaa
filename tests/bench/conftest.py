"""Fixtures shared by the bench tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def server_set_pids(monkeypatch) -> list[dict]:
    """Every ``runner.ServerSet`` entered during the test appends ``{label: server pid}`` here
    (``--fresh-servers`` must start new processes per trial or question)."""
    from kvflow_agents.bench import runner

    pids: list[dict] = []
    real_enter = runner.ServerSet.__enter__

    def spy(self):
        got = real_enter(self)
        pids.append({p: s.proc.pid for p, s in self.servers.items()})
        return got
    monkeypatch.setattr(runner.ServerSet, "__enter__", spy)
    return pids
