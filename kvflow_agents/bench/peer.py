"""``kvflow bench peer``: the PEER example (``examples/peer_financial_qa``, LangGraph) as the workload.

Each question is one workflow: planner → 3-5 parallel executors → expresser → reviewer (→
expresser again on FAIL, at most ``max_rounds`` reviews). The app is instrumented with
``kvflow.instrument`` (hints on every request, ``end`` out of band when the run ends). Every
agent's fixed prompt is its ~1k-token system message; the same four prompts serve every
question, so across questions the cache decides whether a prompt is recomputed.

Per policy: the warm-up question(s) (not measured), then the measured questions, each asked on
a collected, frozen client heap (``runner.settled_heap``). Questions are
interleaved across the policies' servers (policy order rotated per question), so machine noise
hits every policy alike. Measured per question: wall time (the workflow latency); per LLM call:
the server-reported TTFT (``usage.kvflow.ttft_s``; the example's ``ChatOpenAI`` does not stream),
per-tier hits, load wait. Model outputs can differ between policies (recomputed and cached KV
differ in the last bits), which can change the plan size or the number of review rounds: the
table shows the calls and output tokens per policy, and the report names each question whose
answers differ from the oracle's (``report.work_differences``; each answer records its calls
and output tokens).

The example lives in the repository (``examples/``), not in the installed package: this module
finds it next to the ``kvflow_agents`` source tree (an editable install) and raises
:class:`PeerUnavailable` otherwise.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence
from uuid import UUID

from kvflow_agents.serving.policy.policies import is_reference

from .runner import (PolicyResult, ServerConfig, ServerSet, _add_counters, _raw, decode_step_s,
                     fetch_cache_metrics, finish_counters, metrics_delta, rotated, settled_heap,
                     summarize_workload)
from .workload import CallRecord, RoundRecord, WorkloadResult, token_counter

AGENTS = ("planner", "executor", "expresser", "reviewer")


class PeerUnavailable(RuntimeError):
    pass


def _repo_root() -> Path:
    import kvflow_agents

    return Path(kvflow_agents.__file__).resolve().parents[1]


def check_available(framework: str = "langgraph") -> None:
    """Make ``examples.peer_financial_qa`` importable, or raise :class:`PeerUnavailable`."""
    root = _repo_root()
    if not (root / "examples" / "peer_financial_qa" / "app.py").is_file():
        raise PeerUnavailable(f"the PEER example is not next to this installation ({root}/examples/"
                              "peer_financial_qa); run from a source checkout (pip install -e .)")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        import langchain_openai  # noqa: F401
        import langgraph  # noqa: F401

        import examples.peer_financial_qa.app  # noqa: F401
    except ImportError as e:
        raise PeerUnavailable(f"the PEER example needs the [langgraph] extra ({e})") from None
    if framework == "autogen":
        try:
            import autogen_agentchat  # noqa: F401
            import autogen_ext.models.openai  # noqa: F401

            import examples.peer_financial_qa.autogen_app  # noqa: F401
        except ImportError as e:
            raise PeerUnavailable(f"the AutoGen PEER example needs the [autogen] extra ({e})") from None


@dataclass
class PeerOptions:
    questions: int = 2
    ids: Optional[list] = None
    warmup_questions: int = 1
    jump: str = "expressing"
    max_rounds: int = 2
    max_tokens: int = 48
    seed: int = 0
    framework: str = "langgraph"  # or "autogen": the GraphFlow version of the same example
    hints: str = "on"             # on | none | random | reversed | stale (see hint_modes)
    hint_lag: int = 2
    next_run: bool = True         # questions come one after another: hints name the next planner

    def as_dict(self) -> dict:
        return asdict(self)


def pick_questions(opts: PeerOptions) -> tuple[list, list]:
    """(measured, warm-up) questions; warm-up ones are never among the measured."""
    check_available()
    from examples.peer_financial_qa.data import load_questions, select

    allq = load_questions()
    if opts.ids:
        measured = select(allq, ids=opts.ids)
    else:
        measured = select(allq, n=opts.questions)
    rest = [q for q in select(allq) if q not in measured]
    return measured, rest[:opts.warmup_questions]


def fixed_prompt_tokens(model: str) -> dict[str, int]:
    """Tokens of each agent's system prompt (as a rendered system message, approximately)."""
    check_available()
    from examples.peer_financial_qa import prompts

    counter = token_counter(model)
    return {a: counter.count(getattr(prompts, f"{a.upper()}_SYSTEM")) + 5 for a in AGENTS}


def largest_completion(framework: str, max_tokens: int) -> int:
    """The most tokens one PEER call may write. The LangGraph app caps each agent's calls
    itself (``app.MAX_TOKENS``, bound per agent: they override the client's ``max_tokens``);
    the AutoGen app's calls write at most ``max_tokens`` (``--max-tokens``)."""
    if framework == "langgraph":
        from examples.peer_financial_qa.app import MAX_TOKENS

        return max(MAX_TOKENS.values())
    return max_tokens


def min_device_tokens(fixed: dict[str, int], max_tokens: int, page: int, user_tokens: int = 768) -> int:
    """Device tokens the largest single PEER request needs (fixed + user message + output;
    ``max_tokens``: :func:`largest_completion`)."""
    n = max(fixed.values()) + user_tokens + max_tokens
    return -(-n // page) * page + page


# ------------------------------------------------------------------------------ per-call capture
class CallCapture:
    """LangChain callback: one :class:`CallRecord` per LLM call (agent = LangGraph node)."""

    def __new__(cls, *a, **kw):  # build the BaseCallbackHandler subclass lazily (langchain import)
        from langchain_core.callbacks import BaseCallbackHandler

        class _Capture(BaseCallbackHandler):
            raise_error = False

            def __init__(self, on_call: Optional[Callable[[CallRecord], None]] = None) -> None:
                super().__init__()
                self.lock = threading.Lock()
                self.runs: dict[UUID, tuple[str, float]] = {}
                self.calls: list[CallRecord] = []
                self.on_call = on_call
                self.workflow = 0
                self.round = 0
                self.measured = False

            def on_chat_model_start(self, serialized, messages, *, run_id: UUID, metadata=None, **kw):
                from examples.peer_financial_qa.usage import agent_of

                with self.lock:
                    self.runs[run_id] = (agent_of(metadata), time.perf_counter())

            def on_llm_error(self, error, *, run_id: UUID, **kw):
                from examples.peer_financial_qa.usage import usage_of_error

                usage = usage_of_error(error)  # a reply cut by max_tokens: answered, counted
                if usage is not None:
                    self._record(run_id, usage)
                    return
                with self.lock:
                    agent, t0 = self.runs.pop(run_id, ("?", time.perf_counter()))
                    self.calls.append(CallRecord(self.workflow, self.round, agent, 0, self.measured,
                                                 t0, 0.0, time.perf_counter() - t0, ok=False,
                                                 error=f"{type(error).__name__}: {error}"[:300]))

            def on_llm_end(self, response, *, run_id: UUID, **kw):
                from examples.peer_financial_qa.usage import extract_usage

                self._record(run_id, extract_usage(response))

            def _record(self, run_id: UUID, usage) -> None:
                from .workload import _usage_fields

                end = time.perf_counter()
                with self.lock:
                    agent, t0 = self.runs.pop(run_id, ("?", end))
                    rec = CallRecord(self.workflow, self.round, agent, 0, self.measured, t0, 0.0, end - t0)
                    _usage_fields(rec, usage)
                    rec.ttft_s = rec.server_ttft_s if rec.server_ttft_s is not None else rec.latency_s
                    self.calls.append(rec)
                if self.on_call is not None:
                    self.on_call(rec)

        return _Capture(*a, **kw)


class PeerApp:
    """The compiled, instrumented PEER app against one server, with its call capture."""

    def __init__(self, base_url: str, model: str, opts: PeerOptions, api_key: Optional[str],
                 on_call: Optional[Callable[[CallRecord], None]] = None) -> None:
        from examples.peer_financial_qa.app import build_graph, compile_app, make_llm

        self.capture = CallCapture(on_call)
        llm = make_llm(base_url=base_url, model=model, api_key=api_key or "kvflow",
                       max_tokens=opts.max_tokens, temperature=0.0, seed=opts.seed,
                       callbacks=[self.capture])
        self.app, self.instrumented = compile_app(build_graph(llm, jump=opts.jump,
                                                              max_rounds=opts.max_rounds),
                                                  next_run=opts.next_run)
        self.base_url = base_url
        self.result = WorkloadResult()
        self.answers: list[dict] = []

    def _invoke(self, q: Any, wf_index: int, label: str) -> dict:
        """Run one question through the app (one workflow); the final state."""
        from examples.peer_financial_qa.app import initial_state

        return self.app.invoke(initial_state(q), config={
            "recursion_limit": 64, "configurable": {"thread_id": f"bench-peer-{label}-{wf_index}-{q.id}"}})

    def ask(self, q: Any, wf_index: int, label: str, measured: bool) -> float:
        """Time one question, file its calls under ``wf_index``; returns the seconds it took."""
        cap = self.capture
        cap.workflow, cap.round, cap.measured = wf_index, 0, measured
        n0 = len(cap.calls)
        t0 = time.perf_counter()
        err = None
        try:
            out = self._invoke(q, wf_index, label)
        except Exception as e:  # noqa: BLE001 — recorded; the benchmark goes on
            out, err = {}, f"{type(e).__name__}: {e}"
        dt = time.perf_counter() - t0
        self.result.rounds.append(RoundRecord(wf_index, 0, measured, t0, dt, trial=wf_index))
        if measured:
            self.result.measured_s += dt
        mine = [c for c in cap.calls[n0:] if c.workflow == wf_index]
        # the work the question ran: what report.work_differences compares across policies
        self.answers.append({"question": q.id, "measured": measured, "seconds": dt, "error": err,
                             "calls": len(mine), "output_tokens": sum(c.completion_tokens for c in mine),
                             "executors": len(out.get("sub_questions") or []),
                             "verdicts": list(out.get("verdicts") or []),
                             "final_verdict": out.get("final_verdict")})
        return dt


def _pool_bound(res, server: ServerConfig, label: str) -> dict:
    """Reusable prefix tokens missing from device at arrival and the same-pool bound on them
    (:mod:`.pool_bound`; the bound is None for the oracle's growable pool)."""
    from .pool_bound import secs_per_page, totals

    try:
        spp = secs_per_page(server.model, server.page_size, server.host_link_gbps)
    except (KeyError, ValueError):  # not a preset: an instant link only weakens the bound
        spp = 0.0
    policy = (server.variants.get(label) or (label,))[0]
    t = totals(_raw(res)["calls"], pool_tokens=server.device_tokens, page_size=server.page_size,
               secs_per_page=spp, growable=is_reference(policy))
    return {k: t[k] for k in ("device_miss", "bound", "beat_bound")}


def _oob_flush() -> None:
    try:
        from kvflow_agents.oob import flush
        flush(5.0)
    except Exception:  # noqa: BLE001
        pass


def run_peer_bench(questions: Sequence, warmup: Sequence, opts: PeerOptions, policies: Sequence[str],
                   server: Optional[ServerConfig], *, base_url: Optional[str] = None,
                   model: str = "smollm2-135m", api_key: Optional[str] = None,
                   progress: Optional[Callable[[str, int], Any]] = None, keep_raw: bool = False,
                   fresh_servers: bool = False,
                   log: Callable[[str], Any] = lambda s: None) -> list[PolicyResult]:
    """Every policy's server asks the warm-up question(s), then the measured ones (policy order
    rotated per question). ``fresh_servers``: every measured question runs on servers started
    for it, each warmed up with the warm-up question(s) first, so what one server process drew
    (a whole process runs up to ~20 % faster or slower from one start to the next, RESULTS.md
    §6.25: the same call decoded at 55-91 ms per token between columns, §6.20) is drawn again
    per question instead of biasing a column for the whole run."""
    check_available()
    from kvflow_agents.context import set_hint_transform

    from .hint_modes import HintMangler

    # wrong / missing hints on purpose (--hints): every hint the adapter sends passes through
    set_hint_transform(None if opts.hints == "on" else HintMangler(opts.hints, seed=opts.seed,
                                                                   lag=opts.hint_lag))
    try:
        return _run_peer_bench(questions, warmup, opts, policies, server, base_url=base_url,
                               model=model, api_key=api_key, progress=progress, keep_raw=keep_raw,
                               fresh_servers=fresh_servers, log=log)
    finally:
        set_hint_transform(None)


def _run_peer_bench(questions: Sequence, warmup: Sequence, opts: PeerOptions, policies: Sequence[str],
                    server: Optional[ServerConfig], *, base_url: Optional[str], model: str,
                    api_key: Optional[str], progress: Optional[Callable[[str, int], Any]],
                    keep_raw: bool, fresh_servers: bool, log: Callable[[str], Any]) -> list[PolicyResult]:
    counters: dict[str, Optional[dict]] = {}
    speeds: dict[str, list] = {}          # label -> [question, decode_step_s] (bench.speed)
    apps: dict[str, list[PeerApp]] = {}   # label -> one app per server set it ran on

    def metrics(url: str) -> Optional[dict]:
        return asyncio.run(fetch_cache_metrics(url, api_key))

    app_cls: Any = PeerApp
    if opts.framework == "autogen":
        from examples.peer_financial_qa.autogen_app import AutoGenPeerApp as app_cls

    sets = len(questions) if fresh_servers else 1
    if progress is not None:
        for label in (["external"] if base_url else policies):  # ~8 calls per question
            progress(f"start:{label}", (len(questions) + sets * len(warmup)) * 8)

    def run_set(urls: dict[str, str], measured: Sequence[int], set_no: int) -> None:
        """The warm-up question(s), then the ``measured`` questions, on one set of servers."""
        for label, url in urls.items():
            apps.setdefault(label, []).append(app_cls(
                url, model, opts, api_key,
                on_call=(lambda rec, lb=label: progress(f"advance:{lb}", 1)) if progress is not None else None))
        for i, q in enumerate(warmup):  # warm-up: every server sees the same question(s)
            wf = -1 - i - set_no * len(warmup)   # negative: unmeasured; unique per server set
            for label in rotated(list(urls), i):
                log(f"[{label}] warm-up question {q.id}: {apps[label][-1].ask(q, wf, label, False):.1f}s")
        _oob_flush()
        for i in measured:
            q = questions[i]
            for label in rotated(list(urls), i):
                before = metrics(urls[label])
                with settled_heap():
                    dt = apps[label][-1].ask(q, i, label, True)
                _oob_flush()
                delta = metrics_delta(before, metrics(urls[label]))
                counters[label] = _add_counters(counters.get(label), delta)
                if (v := decode_step_s(delta)) is not None:
                    speeds.setdefault(label, []).append([i, v])
                log(f"[{label}] question {q.id}: {dt:.1f}s")

    if base_url:
        run_set({"external": base_url}, range(len(questions)), 0)
        argv = {"external": [base_url]}
        startup = {"external": 0.0}
    else:
        assert server is not None
        started: dict[str, list[float]] = {p: [] for p in policies}
        quiet: Callable[[str], Any] = lambda s: None  # noqa: E731
        for k in range(sets):
            with ServerSet(server, rotated(list(policies), k), log=log if k == 0 else quiet) as ss:
                for p in policies:
                    started[p].append(ss.servers[p].started_s)
                run_set({p: ss.servers[p].base_url for p in policies},
                        [k] if fresh_servers else range(len(questions)), k)
        argv = {p: server.display_argv(p) for p in policies}
        startup = {p: sum(v) / len(v) for p, v in started.items()}
    out = []
    for label, runs in apps.items():
        res = WorkloadResult(calls=[c for pa in runs for c in pa.capture.calls],
                             rounds=[r for pa in runs for r in pa.result.rounds],
                             measured_s=sum(pa.result.measured_s for pa in runs))
        summary = summarize_workload(res)
        summary["instrumented"] = all(pa.instrumented for pa in runs)
        summary["decode_step_trials_s"] = speeds.get(label, [])
        summary["answers"] = [a for pa in runs for a in pa.answers if a["measured"]]
        summary["calls_per_agent"] = {a: sum(1 for c in res.calls if c.measured and c.agent == a)
                                      for a in AGENTS}
        if fresh_servers:
            summary["server_sets"] = len(runs)
        if server is not None:  # what no policy could have had on device with this pool
            summary["pool_bound"] = _pool_bound(res, server, label)
        out.append(PolicyResult(label, summary, finish_counters(counters.get(label)), argv[label],
                                startup[label], _raw(res) if keep_raw else None))
    return out
