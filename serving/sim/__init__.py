"""``kvflow sim``: a discrete-event simulator of one serving engine over the policy core.

- :mod:`.costs`: hardware x model cost profiles (``profiles.json``, a source per constant);
- :mod:`.workloads`: the paper's workflows, PEER-style, trace replay (and the trace format);
- :mod:`.engine`: the event loop; it drives :class:`kvflow_agents.serving.policy.KVCacheManager`
  unchanged through a virtual-clock :class:`~.state.SimBackend`;
- :mod:`.state`: that backend and the records of requests, workflows and results;
- :mod:`.paper`: the paper's figure configurations and reported ratios, the sweep, validation;
- :mod:`.report`: rich tables and matplotlib (Agg) charts.

Pure Python (stdlib + the policy core); matplotlib/rich only in :mod:`.report`. No torch.
"""

from .costs import Profile, load_profile, profile_names
from .engine import Simulator, compare, simulate
from .state import SimBackend, SimResult
from .workloads import Call, Step, Workload, WorkflowPlan, cycle, fanout, from_trace, load_trace, peer

__all__ = ["Profile", "load_profile", "profile_names", "SimBackend", "SimResult", "Simulator",
           "compare", "simulate", "Call", "Step", "Workload", "WorkflowPlan", "cycle", "fanout",
           "peer", "from_trace", "load_trace"]
