"""Agent Step Graph and steps-to-execution (STE). Pure Python + networkx: no framework and
no engine import, so adapters, the simulator and the server policy all share it."""

from .errors import GraphError
from .step_graph import END, INF, START, AgentStepGraph, next_agents
from .tracker import WorkflowTracker

__all__ = ["AgentStepGraph", "WorkflowTracker", "GraphError", "START", "END", "INF", "next_agents"]
