"""Recorded workflow runs: what :class:`~.learned.LearnedTracker` writes and ``kvflow bench
predict --traces`` reads.

JSONL: a ``{"type": "graph", "app": ..., "asg": <AgentStepGraph JSON>}`` line per app, then one
``{"type": "run", "app": ..., "workflow": ..., "steps": [[agent, ...], ...]}`` line per run
(the agents that ran in each step, in order). Pure Python: no framework import.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, Mapping

from .errors import GraphError
from .step_graph import AgentStepGraph

__all__ = ["TraceRun", "TraceRecorder", "write_traces", "read_traces"]


@dataclass
class TraceRun:
    """One observed run: the agents that ran in each step, in order."""

    app: str
    steps: list[list[str]]
    workflow: str | None = None

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"type": "run", "app": self.app, "steps": self.steps}
        if self.workflow is not None:
            doc["workflow"] = self.workflow
        return doc


class TraceRecorder:
    """Collects runs (and the graphs they ran on) for replay; optionally appends JSONL to a file."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.graphs: dict[str, AgentStepGraph] = {}
        self.runs: list[TraceRun] = []
        self._lock = threading.Lock()
        self._written_graphs: set[str] = set()

    def add_graph(self, app: str, graph: AgentStepGraph) -> None:
        with self._lock:
            self.graphs[app] = graph

    def add_run(self, run: TraceRun) -> None:
        with self._lock:
            self.runs.append(run)
            if self.path is not None:
                with self.path.open("a") as f:
                    if run.app not in self._written_graphs and run.app in self.graphs:
                        f.write(json.dumps(_graph_doc(run.app, self.graphs[run.app])) + "\n")
                        self._written_graphs.add(run.app)
                    f.write(json.dumps(run.to_doc()) + "\n")

    def write(self, path: str | Path) -> None:
        write_traces(path, self.graphs, self.runs)


def _graph_doc(app: str, graph: AgentStepGraph) -> dict[str, Any]:
    return {"type": "graph", "app": app, "asg": json.loads(graph.to_json())}


def write_traces(path_or_file: str | Path | IO[str], graphs: Mapping[str, AgentStepGraph],
                 runs: Iterable[TraceRun]) -> None:
    """Write graphs then runs as JSONL."""
    lines = [json.dumps(_graph_doc(app, g)) for app, g in graphs.items()]
    lines += [json.dumps(r.to_doc()) for r in runs]
    text = "".join(line + "\n" for line in lines)
    if isinstance(path_or_file, (str, Path)):
        Path(path_or_file).write_text(text)
    else:
        path_or_file.write(text)


def _iter_lines(path_or_file: str | Path | IO[str]) -> Iterator[str]:
    if isinstance(path_or_file, (str, Path)):
        with open(path_or_file) as f:
            yield from f
    else:
        yield from path_or_file


def read_traces(path_or_file: str | Path | IO[str]) -> tuple[dict[str, AgentStepGraph], list[TraceRun]]:
    """Read a JSONL trace file: ``(graphs by app, runs)``. :class:`GraphError` names the line."""
    graphs: dict[str, AgentStepGraph] = {}
    runs: list[TraceRun] = []
    for no, line in enumerate(_iter_lines(path_or_file), 1):
        line = line.strip()
        if not line:
            continue
        try:
            doc = json.loads(line)
            kind = doc["type"]
            if kind == "graph":
                graphs[doc["app"]] = AgentStepGraph.from_json(json.dumps(doc["asg"]))
            elif kind == "run":
                steps = doc["steps"]
                if not isinstance(steps, list) or not all(
                        isinstance(s, list) and all(isinstance(a, str) for a in s) for s in steps):
                    raise GraphError("steps must be a list of lists of agent names")
                runs.append(TraceRun(app=doc["app"], steps=steps, workflow=doc.get("workflow")))
            else:
                raise GraphError(f"unknown line type {kind!r}")
        except (ValueError, KeyError, TypeError, GraphError) as e:
            raise GraphError(f"trace line {no}: {e}") from e
    return graphs, runs
