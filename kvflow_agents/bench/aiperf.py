"""``kvflow bench aiperf``: NVIDIA AIPerf (``aiperf`` on PyPI), a client we did not write, against
``kvflow serve``, one server per policy.

AIPerf's dependency set (datasets, pyarrow, dash, kubernetes, transformers …) is far from ours,
so it runs from **its own virtualenv**: ``--aiperf-bin PATH``, else ``aiperf`` on ``PATH``, else
``<venv>/bin/aiperf`` where ``<venv>`` (default ``.venv-aiperf``) is created by this command with
``python -m venv`` + ``pip install aiperf==0.13.0`` when it is missing (:func:`ensure_aiperf`).
AIPerf needs a tokenizer for its token counts; it would download one by name, so a local
Hugging Face tokenizer directory is written from the served model's own tokenizer
(``ChatTokenizer.save``) and passed as ``--tokenizer``.

Two workloads, both AIPerf sessions (multi-turn, the turns of a session in order):

- ``agentic`` (default): our synthetic agent workflow (``bench.workload``: a cycle of agents, a
  fixed system prompt each, a dynamic user message per call) as AIPerf ``raw-payload`` sessions:
  one JSONL file per workflow, one verbatim request body per call. The bodies carry hints v1
  (``custom_params``) computed by a :class:`~kvflow_agents.graph.WorkflowTracker` for the call
  sequence, corrupted or dropped per ``--hints`` (``none``: what a plain AIPerf user sends). One
  warm-up round per workflow is sent first by our own client (unmeasured, same workflow ids);
  AIPerf then runs the measured rounds with ``--concurrency`` = workflows.
- ``multi-turn``: AIPerf's own synthetic multi-turn conversations (``--conversation-num``,
  ``--conversation-turn-mean``, each turn carrying the conversation so far) behind a shared
  system prompt (``--shared-system-prompt-length``). AIPerf sends no hints: the no-hints case.

Per policy AIPerf's own metrics are read from ``profile_export_aiperf.json`` (TTFT, inter-token
latency, request latency percentiles, request and output-token throughput), the session
(workflow) latencies from its per-request records (``profile_export.jsonl``: last end - first
start per session), and the server's cache counters (``/kvflow/v1/cache``) around each run.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median
from typing import Any, Callable, Optional, Sequence

AIPERF_VERSION = "0.13.0"
WORKLOADS = ("agentic", "multi-turn")


class AIPerfUnavailable(RuntimeError):
    pass


# ------------------------------------------------------------------------------ the executable
def find_aiperf(explicit: Optional[str] = None, venv: str = ".venv-aiperf") -> Optional[str]:
    """``explicit`` if given (and executable), else ``aiperf`` on PATH, else ``venv``'s."""
    cands = (explicit,) if explicit else (shutil.which("aiperf"), str(Path(venv) / "bin" / "aiperf"))
    for cand in cands:
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


def ensure_aiperf(explicit: Optional[str] = None, venv: str = ".venv-aiperf", install: bool = True,
                  log: Callable[[str], Any] = lambda s: None) -> str:
    """The ``aiperf`` executable; creates ``venv`` with aiperf in it when none is found."""
    found = find_aiperf(explicit, venv)
    if found:
        return found
    if explicit:
        raise AIPerfUnavailable(f"--aiperf-bin {explicit}: not an executable file")
    if not install:
        raise AIPerfUnavailable(f"aiperf not found (not on PATH, not in {venv}); run without "
                                f"--no-install to create {venv}, or: python -m venv {venv} && "
                                f"{venv}/bin/pip install aiperf=={AIPERF_VERSION}")
    log(f"installing aiperf=={AIPERF_VERSION} into its own virtualenv {venv} (its dependencies "
        "differ from ours; a few minutes, once) …")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    pip = [str(Path(venv) / "bin" / "python"), "-m", "pip", "install", "-q"]
    for args in (["--upgrade", "pip"], [f"aiperf=={AIPERF_VERSION}"]):
        r = subprocess.run(pip + args, capture_output=True, text=True)
        if r.returncode != 0:
            raise AIPerfUnavailable(f"pip install {' '.join(args)} failed:\n{r.stderr[-2000:]}")
    found = find_aiperf(None, venv)
    if not found:
        raise AIPerfUnavailable(f"aiperf was installed into {venv} but {venv}/bin/aiperf is missing")
    return found


def write_tokenizer(model: str, path: Path) -> Path:
    """The served model's tokenizer as a Hugging Face directory (AIPerf loads it offline)."""
    from kvflow_agents.serving.embedded.model.tokenizer import ChatTokenizer

    if model.startswith("tiny-random"):
        tok = ChatTokenizer.byte_level()
    elif model == "smollm2-135m":
        from kvflow_agents.serving.embedded.model.gguf_loader import ensure_converted

        tok = ChatTokenizer.from_dir(ensure_converted())
    else:
        tok = ChatTokenizer.from_dir(model)
    tok.save(path)
    return path


# ------------------------------------------------------------------------------ the dataset
def agentic_sessions(spec, counter, *, model: str, run_id: str, trial: int = 0,
                     first_round: int = 1) -> dict[str, list[dict]]:
    """``{workflow id: [request body, ...]}``: rounds ``first_round .. first_round+rounds-1`` of
    every workflow as verbatim chat bodies (streamed, ``ignore_eos``), with the hints the
    tracker computes at each call (after ``spec.hints``'s corruption; none under ``none``).
    The tracker is advanced through the earlier rounds too, so the hint steps continue those of
    the warm-up our own client sends."""
    from .hint_modes import HintMangler
    from .workload import Prompts, build_graph, steps

    if spec.variant != "cycle":
        raise ValueError("AIPerf sessions are sequential: only the cycle variant")
    prompts = Prompts(spec, counter, trial)
    graph = build_graph(spec)
    mangle = HintMangler(spec.hints, seed=spec.seed, lag=spec.hint_lag)
    out: dict[str, list[dict]] = {}
    for w in range(spec.workflows):
        wf = f"bench-{run_id}-wf{w}"
        tr = graph.tracker(wf)
        bodies = []
        for rnd in range(first_round + spec.rounds):
            for group in steps(spec):
                for agent in group:
                    tr.start(agent)
                    if rnd >= first_round:
                        from kvflow_agents.protocol import Hints

                        h = mangle(Hints(workflow=wf, agent=agent, step=tr.step, ste=tr.ste(),
                                         next=tr.next_agents(), app=spec.app, fixed_messages=1))
                        body = {"model": model, "messages": prompts.messages(w, rnd, agent),
                                "max_tokens": spec.output, "temperature": 0, "ignore_eos": True,
                                "stream": True, "stream_options": {"include_usage": True}}
                        if h is not None:
                            body["custom_params"] = h.to_custom_params()
                        bodies.append(body)
                    tr.finish(agent)
        out[wf] = bodies
    return out


def write_sessions(sessions: dict[str, list[dict]], directory: Path) -> Path:
    """One JSONL file per session (AIPerf ``raw-payload`` directory mode: file = session,
    line = turn, sent verbatim). Files sort in workflow order."""
    directory.mkdir(parents=True, exist_ok=True)
    for i, (wf, bodies) in enumerate(sessions.items()):
        with open(directory / f"{i:05d}.jsonl", "w") as f:
            for b in bodies:
                f.write(json.dumps(b, separators=(",", ":")) + "\n")
    return directory


@dataclass
class AIPerfRun:
    """The ``aiperf profile`` command line of one run (everything but the server URL and the
    artifact directory, which differ per policy)."""

    model: str
    tokenizer: str
    concurrency: int
    workload: str = "agentic"
    input_dir: Optional[str] = None        # agentic: the raw-payload session directory
    request_count: Optional[int] = None
    conversations: int = 8                 # multi-turn
    turns: int = 5
    system_prompt_tokens: int = 1024
    isl: int = 64
    osl: int = 16
    seed: int = 0
    extra: list = field(default_factory=list)

    def argv(self, aiperf_bin: str, url: str, artifact_dir: str) -> list[str]:
        a = [aiperf_bin, "profile", "--model", self.model, "--url", url, "--endpoint-type", "chat",
             "--streaming", "--tokenizer", self.tokenizer, "--concurrency", str(self.concurrency),
             "--artifact-dir", artifact_dir, "--ui-type", "none", "--random-seed", str(self.seed),
             "--use-server-token-count"]
        if self.workload == "agentic":
            a += ["--custom-dataset-type", "raw-payload", "--input-file", str(self.input_dir)]
            if self.request_count:
                a += ["--request-count", str(self.request_count)]
        else:
            a += ["--conversation-num", str(self.conversations), "--conversation-turn-mean",
                  str(self.turns), "--conversation-turn-stddev", "0",
                  "--shared-system-prompt-length", str(self.system_prompt_tokens),
                  "--isl", str(self.isl), "--osl", str(self.osl),
                  "--extra-inputs", "ignore_eos:true",
                  "--request-count", str(self.conversations * self.turns)]
        return a + list(self.extra)


# ------------------------------------------------------------------------------ results
METRICS = (  # (AIPerf key, stat, our name)
    ("time_to_first_token", "avg", "ttft_avg_ms"), ("time_to_first_token", "p50", "ttft_p50_ms"),
    ("time_to_first_token", "p90", "ttft_p90_ms"),
    ("inter_token_latency", "avg", "itl_avg_ms"), ("inter_token_latency", "p50", "itl_p50_ms"),
    ("request_latency", "avg", "latency_avg_ms"), ("request_latency", "p50", "latency_p50_ms"),
    ("request_latency", "p90", "latency_p90_ms"), ("request_latency", "p99", "latency_p99_ms"),
    ("request_throughput", "avg", "requests_per_s"), ("output_token_throughput", "avg", "output_tokens_per_s"),
    ("request_count", "avg", "requests"), ("benchmark_duration", "avg", "duration_s"),
)


def read_export(artifact_dir: Path) -> dict:
    """AIPerf's own summary metrics (``profile_export_aiperf.json``) plus session latencies from
    its per-request records, in our names."""
    doc = json.loads((artifact_dir / "profile_export_aiperf.json").read_text())
    out: dict = {}
    for key, stat, name in METRICS:
        v = (doc.get(key) or {}).get(stat)
        out[name] = float(v) if isinstance(v, (int, float)) else None
    out["errors"] = sum(int(e.get("count", 1)) for e in (doc.get("error_summary") or []))
    sessions: dict[str, list[int]] = {}
    rec_path = artifact_dir / "profile_export.jsonl"
    if rec_path.is_file():
        for line in rec_path.read_text().splitlines():
            try:
                m = json.loads(line).get("metadata") or {}
            except ValueError:
                continue
            cid = m.get("conversation_id") or m.get("x_correlation_id")
            s, e = m.get("request_start_ns"), m.get("request_end_ns")
            if cid is None or s is None or e is None or m.get("benchmark_phase", "profiling") != "profiling":
                continue
            lo_hi = sessions.setdefault(cid, [s, e])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], s), max(lo_hi[1], e)
    lat = sorted((e - s) / 1e9 for s, e in sessions.values())
    out["sessions"] = len(lat)
    out["session_latency_p50_s"] = median(lat) if lat else None
    out["session_latency_mean_s"] = sum(lat) / len(lat) if lat else None
    out["session_latency_p90_s"] = lat[min(len(lat) - 1, max(0, math.ceil(0.9 * len(lat)) - 1))] if lat else None
    return out


def merge_trials(trials: Sequence[dict]) -> dict:
    """Per policy over trials: medians of AIPerf's summaries, sums of counts, per-trial session
    p50s (the runner's ``workflow_latency_trials_s`` shape, so the saving ratio pairs trials)."""
    out: dict = {}
    for key in trials[0]:
        vals = [t[key] for t in trials if isinstance(t.get(key), (int, float))]
        if key in ("requests", "errors", "sessions"):
            out[key] = sum(vals)
        elif vals:
            out[key] = median(vals)
        else:
            out[key] = None
    out["trials"] = len(trials)
    return out


def as_policy_result(policy: str, trials: Sequence[dict], server: Optional[dict], argv: list):
    """A :class:`~kvflow_agents.bench.runner.PolicyResult` whose workflow latency is AIPerf's
    session latency (so the report's ratios and achievable saving apply) with AIPerf's metrics
    next to it."""
    from .runner import PolicyResult

    m = merge_trials(trials)
    w = {"aiperf": m, "calls": int(m.get("requests") or 0), "errors": int(m.get("errors") or 0),
         "workflow_latency_p50_s": m.get("session_latency_p50_s"),
         "workflow_latency_mean_s": m.get("session_latency_mean_s"),
         "workflow_latency_p90_s": m.get("session_latency_p90_s"),
         "workflow_latency_trials_s": [[i, t.get("session_latency_p50_s")] for i, t in enumerate(trials)
                                       if t.get("session_latency_p50_s")],
         # the server's model seconds per decode step in each trial (bench.speed)
         "decode_step_trials_s": [[i, t["decode_step_s"]] for i, t in enumerate(trials)
                                  if t.get("decode_step_s")],
         "ttft_mean_s": (m["ttft_avg_ms"] / 1e3) if m.get("ttft_avg_ms") else None,
         "call_latency_mean_s": (m["latency_avg_ms"] / 1e3) if m.get("latency_avg_ms") else None,
         "trials": len(trials)}
    return PolicyResult(policy, w, server, argv)


AIPERF_ROWS = (("TTFT avg (ms)", "ttft_avg_ms", "{:.1f}"), ("TTFT p50 (ms)", "ttft_p50_ms", "{:.1f}"),
               ("TTFT p90 (ms)", "ttft_p90_ms", "{:.1f}"), ("ITL avg (ms)", "itl_avg_ms", "{:.2f}"),
               ("ITL p50 (ms)", "itl_p50_ms", "{:.2f}"), ("latency avg (ms)", "latency_avg_ms", "{:.1f}"),
               ("latency p50 (ms)", "latency_p50_ms", "{:.1f}"), ("latency p90 (ms)", "latency_p90_ms", "{:.1f}"),
               ("latency p99 (ms)", "latency_p99_ms", "{:.1f}"), ("requests/s", "requests_per_s", "{:.2f}"),
               ("output tokens/s", "output_tokens_per_s", "{:.1f}"),
               ("session p50 (s)", "session_latency_p50_s", "{:.3f}"),
               ("session mean (s)", "session_latency_mean_s", "{:.3f}"), ("requests (errors)", None, None))


def rows(results) -> list[tuple[str, list[str]]]:
    """AIPerf's metrics (one row each), then throughput ratios, then ours (hits, loads, saving)."""
    from . import report_rows

    out = []
    for name, key, fmt in AIPERF_ROWS:
        vals = []
        for r in results:
            a = r.workload.get("aiperf") or {}
            if key is None:
                vals.append(f"{int(a.get('requests') or 0)} ({int(a.get('errors') or 0)})")
            else:
                v = a.get(key)
                vals.append("-" if v is None else fmt.format(v))
        out.append((f"aiperf: {name}", vals))
    thr = {r.policy: (r.workload.get("aiperf") or {}).get("requests_per_s") for r in results}
    for base in ("lru", "hicache"):
        if thr.get(base):
            out.append((f"throughput vs {base}", [f"{thr[r.policy] / thr[base]:.2f}x" if thr.get(r.policy) else "-"
                                                   for r in results]))
    ours = dict(report_rows.rows(results, wide=False))
    for name in ("hit device (usage)", "load hidden (s)", "load exposed (s)", "prefetch used/issued",
                 "speedup vs lru", "speedup vs hicache", "saving vs lru", "saving vs hicache"):
        if name in ours:
            label = "ours: " + name.replace(" (usage)", "").replace("speedup", "session speedup")
            if name.startswith("hit"):   # the usage rows need per-call records; use the server's
                label, vals = "ours: hit device (server)", [
                    report_rows.fmt((r.server or {}).get("device_rate"), "%") for r in results]
            else:
                vals = ours[name]
            out.append((label, vals))
    return out


def render_table(results, title: str):
    from rich import box
    from rich.table import Table

    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")
    t.add_column("metric", no_wrap=True)
    for r in results:
        t.add_column(r.policy, justify="right", no_wrap=True)
    for name, vals in rows(results):
        t.add_row(name, *vals)
    return t


def markdown(results) -> str:
    head = "| metric | " + " | ".join(r.policy for r in results) + " |"
    lines = [head, "|---|" + "---:|" * len(results)]
    lines += ["| " + n + " | " + " | ".join(v) + " |" for n, v in rows(results)]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ running
def run_aiperf(aiperf_bin: str, run: AIPerfRun, url: str, artifact_dir: Path, *,
               timeout_s: float = 3600.0) -> dict:
    artifact_dir.mkdir(parents=True, exist_ok=True)
    argv = run.argv(aiperf_bin, url, str(artifact_dir))
    env = {**os.environ, "NO_COLOR": "1"}
    with open(artifact_dir / "aiperf_stdout.log", "w") as logf:
        r = subprocess.run(argv, stdout=logf, stderr=subprocess.STDOUT, env=env, timeout=timeout_s,
                           stdin=subprocess.DEVNULL)
    if r.returncode != 0 or not (artifact_dir / "profile_export_aiperf.json").is_file():
        tail = (artifact_dir / "aiperf_stdout.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"aiperf exited with {r.returncode}:\n{tail}")
    out = read_export(artifact_dir)
    out["argv"] = argv
    return out


def run_aiperf_bench(*, aiperf_bin: str, spec, counter, policies: Sequence[str], server, run: AIPerfRun,
                     workdir: Path, trials: int = 1, log: Callable[[str], Any] = lambda s: None,
                     progress: Optional[Callable[[str], Any]] = None) -> list:
    """Per trial, per policy (order rotated): counters, (agentic) our warm-up round, AIPerf,
    counters. Returns :class:`PolicyResult` s."""
    import asyncio

    from .runner import (ServerSet, _add_counters, decode_step_s, fetch_cache_metrics,
                         finish_counters, metrics_delta, rotated, warm_kernels)
    from .driver import WorkflowDriver

    per: dict[str, list[dict]] = {p: [] for p in policies}
    counters: dict[str, Optional[dict]] = {}
    with ServerSet(server, policies, log=log) as ss:
        for t in range(trials):
            for p in rotated(list(policies), t):
                url = ss.servers[p].base_url
                run_id = f"aiperf-{p}-t{t}-{int(time.time())}"
                this = AIPerfRun(**{**asdict(run)})
                if run.workload == "agentic":
                    warm = WorkflowDriver(
                        type(spec)(**{**spec.as_dict(), "rounds": spec.warmup_rounds or 1, "warmup_rounds": 0}),
                        url, server.model, counter=counter, run_id=run_id, trial=t)
                    asyncio.run(warm_kernels(url, server.model))
                    if spec.warmup_rounds:
                        if progress is not None:
                            progress(f"{p} trial {t + 1}: warm-up round")
                        asyncio.run(_warm(warm))
                    sessions = agentic_sessions(spec, counter, model=server.model, run_id=run_id, trial=t,
                                                first_round=spec.warmup_rounds)
                    this.input_dir = str(write_sessions(sessions, workdir / f"data-{p}-t{t}"))
                    this.request_count = sum(len(b) for b in sessions.values())
                before = asyncio.run(fetch_cache_metrics(url))
                if progress is not None:
                    progress(f"{p} trial {t + 1}: aiperf")
                res = run_aiperf(aiperf_bin, this, ss.servers[p].url, workdir / f"aiperf-{p}-t{t}")
                delta = metrics_delta(before, asyncio.run(fetch_cache_metrics(url)))
                counters[p] = _add_counters(counters.get(p), delta)
                per[p].append({**res, "decode_step_s": decode_step_s(delta)})
                log(f"[{p}] trial {t + 1}: {res.get('requests'):.0f} requests, session p50 "
                    f"{res.get('session_latency_p50_s') or 0:.3f} s, TTFT avg {res.get('ttft_avg_ms') or 0:.1f} ms")
        argv = {p: ss.argv(p) for p in policies}
    return [as_policy_result(p, per[p], finish_counters(counters.get(p)), argv[p]) for p in policies]


async def _warm(driver) -> None:
    """Our client's warm-up round (hinted per the spec; not measured)."""
    await driver.run(end=False)   # AIPerf continues these workflows
