"""Control messages from SGLang's HTTP process to its scheduler processes (no SGLang import).

They ride SGLang's own tokenizer -> scheduler socket (wrapped with ``wrap_as_pickle`` so the
msgpack IPC carries them), are broadcast to every TP rank with the requests of that step, and
are taken out of the batch by the plugin's hook on ``Scheduler.process_input_requests`` before
SGLang's dispatcher sees them. Every rank therefore applies the same hints at the same point
of its request stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

# The token length of the fixed prefix, added to custom_params by the HTTP layer (chat template).
FIXED_TOKENS_KEY = "kvflow_fixed_prefix_tokens"


@dataclass
class KVFlowControl:
    kind: str                                   # "hints" | "snapshot"
    payload: dict = field(default_factory=dict)  # hints: the flat kvflow_* dict
    reply_to: Optional[str] = None              # snapshot: a zmq PULL address to push JSON to

    def __reduce__(self) -> Any:  # stable pickling across processes
        return (KVFlowControl, (self.kind, dict(self.payload), self.reply_to))
