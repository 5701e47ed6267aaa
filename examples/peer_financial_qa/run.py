"""Run the PEER financial-QA example against an OpenAI-compatible server.

    python -m examples.peer_financial_qa.run                       # embedded `kvflow serve`
    python -m examples.peer_financial_qa.run --base-url http://127.0.0.1:30000/v1 --model M
    python examples/peer_financial_qa/run.py --ids macro-01,co-03 --jump planning
    python -m examples.peer_financial_qa.run --framework autogen   # the AutoGen GraphFlow version
    python -m examples.peer_financial_qa.run --data my_questions.txt --corpus ./my_notes

``--data`` reads this example's JSONL, agentUniverse's ``{"text": ...}`` JSONL or a plain text
file (one question per line); ``--corpus DIR`` makes the executors search your own text files
instead of the shipped snippets. For each question it prints the question, the plan, what each
executor searched for and found (``--show-findings``), the final answer, each review's verdict
and score, and the elapsed time; at the end a per-agent usage/cache table (from each response's
``usage``) and, when the server has ``GET /kvflow/v1/cache``, its per-agent residency.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):  # run as a script: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from examples.peer_financial_qa.app import build_graph, compile_app, initial_state, make_llm
from examples.peer_financial_qa.corpus import Corpus, CorpusError
from examples.peer_financial_qa.data import CATEGORIES, DATA_FILE, DataError, load_questions, select
from examples.peer_financial_qa.server import EmbeddedServer, ServerStartError
from examples.peer_financial_qa.usage import AgentUsage, CacheSampler, UsageByAgent

AGENT_ORDER = ("planner", "executor", "expresser", "reviewer")
DEFAULT_EMBEDDED_MODEL = "smollm2-135m"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="peer_financial_qa",
                                description="PEER (Plan/Execute/Express/Review) financial QA on LangGraph "
                                            "(or AutoGen), instrumented with kvflow.instrument.")
    p.add_argument("--framework", choices=("langgraph", "autogen"), default="langgraph",
                   help="langgraph (app.py, default) or autogen (autogen_app.py: an AutoGen GraphFlow)")
    p.add_argument("--executors", type=int, choices=(3, 4, 5), default=3,
                   help="autogen only: the fixed number of executor agents (default 3)")
    p.add_argument("--base-url", help="OpenAI-compatible base URL (…/v1). Default: start the embedded "
                                      "server (`kvflow serve`) on a free port and stop it at the end.")
    p.add_argument("--model", help=f"model name (default: {DEFAULT_EMBEDDED_MODEL} for the embedded "
                                   "server, else the first one /v1/models lists)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "kvflow"))
    p.add_argument("--questions", type=int, default=3, metavar="N", help="how many questions (default 3)")
    p.add_argument("--ids", help="comma-separated question ids (e.g. macro-01,co-03)")
    p.add_argument("--category", help=f"only this category: {', '.join(CATEGORIES)}")
    p.add_argument("--jump", choices=("expressing", "planning"), default="expressing",
                   help="where a failed review goes (default: expressing, as agentUniverse's PEER)")
    p.add_argument("--max-rounds", type=int, default=2, help="most reviews per question (default 2)")
    p.add_argument("--max-tokens", type=int, default=160,
                   help="max completion tokens per call (AutoGen app; the LangGraph app binds "
                        "each agent's own cap: MAX_TOKENS in app.py)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, help="sampling seed sent to the server")
    p.add_argument("--no-instrument", action="store_true", help="do not call kvflow.instrument (baseline)")
    p.add_argument("--data", type=Path, default=DATA_FILE,
                   help="questions: this example's JSONL, agentUniverse's {\"text\": ...} JSONL, or one "
                        "question per line")
    p.add_argument("--corpus", type=Path, metavar="DIR",
                   help="search your own text files (*.txt, *.md) instead of the shipped snippets")
    p.add_argument("--search-delay", type=float, default=0.0, metavar="S",
                   help="seconds each search takes (emulates a remote search backend: the tool gap)")
    p.add_argument("--server-timeout", type=float, default=600.0,
                   help="seconds to wait for the embedded server's /health (default 600)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `kvflow serve` (repeatable), e.g. --serve-arg=--policy=lru")
    p.add_argument("--cache-poll", type=float, default=0.5, metavar="S",
                   help="sample GET /kvflow/v1/cache every S seconds during the run (0: off)")
    p.add_argument("--show-findings", action="store_true", help="also print each executor's findings")
    return p.parse_args(argv)


def server_root(base_url: str) -> str:
    url = base_url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def first_model(base_url: str, api_key: str) -> Optional[str]:
    try:
        r = httpx.get(base_url.rstrip("/") + "/models", headers={"Authorization": f"Bearer {api_key}"},
                      timeout=5.0, trust_env=False)
        data = r.json().get("data") or []
        return str(data[0]["id"]) if data else None
    except Exception:  # noqa: BLE001
        return None


# -- printing ----------------------------------------------------------------------------------

def print_result(console: Console, q: Any, result: dict[str, Any], elapsed: float, show_findings: bool) -> None:
    console.rule(f"[bold]{q.id}[/] · {q.category}")
    console.print(f"[bold]Q:[/] {q.question}")
    subs = result.get("sub_questions") or []
    console.print(f"[dim]plan ({result.get('plan_source', '?')}, {result.get('plans', 0)} planner run(s)):[/]")
    for i, s in enumerate(subs, 1):
        console.print(f"[dim]  {i}. {s}[/]")
    if show_findings:
        for f in sorted(result.get("findings") or [], key=lambda f: f["index"]):
            src = ", ".join(f.get("sources") or f.get("snippets") or []) or "no passage"
            title = f"executor {f['index'] + 1}: searched {f.get('query', '')!r} -> {src}"
            console.print(Panel(f["text"] or "(empty)", title=escape(title), border_style="dim"))
    console.print(Panel(escape(result.get("draft") or "(no answer)"), title="answer", border_style="green"))
    verdicts = result.get("verdicts") or []
    scores = list(result.get("scores") or []) + [None] * len(verdicts)
    rounds = [f"{v} (score {s})" if s is not None else v for v, s in zip(verdicts, scores)]
    console.print(f"[bold]review:[/] {' → '.join(rounds) or '-'}; final: "
                  f"[bold]{result.get('final_verdict') or '?'}[/]   [dim]elapsed {elapsed:.1f}s[/]")


def _agent_names(names: Any) -> list[str]:
    names = list(names)
    return [n for n in AGENT_ORDER if n in names] + sorted(n for n in names if n not in AGENT_ORDER)


def usage_table(agents: dict[str, AgentUsage]) -> Table:
    t = Table(title="Per-agent usage (from each response's usage)")
    for col in ("agent", "calls", "prompt tok", "cached tok", "cached %", "calls w/ hit", "output tok", "LLM s"):
        t.add_column(col, justify="left" if col == "agent" else "right")
    for n in _agent_names(agents):
        a = agents[n]
        t.add_row(n, str(a.calls), str(a.prompt_tokens), str(a.cached_tokens), f"{a.hit_rate:.0%}",
                  f"{a.calls_with_hit}/{a.calls}", str(a.completion_tokens), f"{a.seconds:.1f}")
    return t


def _num(v: float) -> str:
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.3f}"


def _short(key: str) -> str:
    return key.replace("_tokens", " tok").replace("_s", " s").replace("_", " ")


def kvflow_usage_table(agents: dict[str, AgentUsage]) -> Optional[Table]:
    keys = sorted({k for a in agents.values() for k in a.kvflow})
    if not keys:
        return None
    t = Table(title="usage.kvflow per agent (summed over calls)")
    t.add_column("agent")
    for k in keys:
        t.add_column(_short(k), justify="right")
    for n in _agent_names(agents):
        t.add_row(n, *[_num(agents[n].kvflow.get(k, 0.0)) for k in keys])
    return t


_METRIC_KEYS = ("requests", "hit_rate", "device_hit_rate", "prefetch_issued", "prefetch_used",
                "prefetch_wasted", "demand_loads", "load_hidden_fraction")


def print_cache(console: Console, sampler: CacheSampler) -> None:
    """Per-agent residency of the fixed prefixes, as sampled during the run, plus the server's
    pools and cache metrics from the last read."""
    if sampler.agents:
        t = Table(title=f"Fixed-prefix residency per agent during the run "
                        f"(GET /kvflow/v1/cache, {sampler.samples} samples)")
        for col in ("agent", "seen", "device", "loading", "host", "none", "prefix tok", "last STE"):
            t.add_column(col, justify="left" if col == "agent" else "right")
        for n in _agent_names(sampler.agents):
            r = sampler.agents[n]
            pct = (lambda k: f"{r.get(k, 0) / r['seen']:.0%}") if r["seen"] else (lambda k: "-")
            t.add_row(n, str(r["seen"]), pct("device"), pct("loading"), pct("host"), pct("none"),
                      str(r["tokens"]), "∞" if r["ste"] is None else str(r["ste"]))
        console.print(t)
    else:
        console.print("[dim]/kvflow/v1/cache listed no agents during the run[/]")
    doc = sampler.last or {}
    pools = doc.get("pools") or {}
    if isinstance(pools, dict) and pools:
        console.print("[dim]pools after the run: " + "; ".join(
            f"{name} {p.get('used_tokens', '?')}/{p.get('capacity_tokens', '?')} tokens"
            for name, p in pools.items() if isinstance(p, dict)) + f"; policy {doc.get('policy', '?')}[/]")
    metrics = doc.get("metrics") or {}
    if isinstance(metrics, dict) and metrics:
        shown = {k: metrics[k] for k in _METRIC_KEYS if k in metrics}
        console.print("[dim]server cache metrics: " + ", ".join(
            f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()) + "[/]")


# -- main --------------------------------------------------------------------------------------

def run(args: argparse.Namespace, console: Console) -> int:
    try:
        questions = select(load_questions(args.data), n=args.questions,
                           ids=args.ids.split(",") if args.ids else None, category=args.category)
        corpus = Corpus.from_dir(args.corpus) if args.corpus else None
    except (DataError, CorpusError, ValueError, OSError) as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    if not questions:
        console.print("[red]error:[/] no questions selected")
        return 2

    server: Optional[EmbeddedServer] = None
    sampler: Optional[CacheSampler] = None
    peer: Any = None  # the AutoGen app (closed at the end)
    base_url = args.base_url
    model = args.model
    try:
        if not base_url:
            model = model or DEFAULT_EMBEDDED_MODEL
            server = EmbeddedServer(model=model, timeout_s=args.server_timeout, extra_args=args.serve_arg)
            console.print(f"[dim]starting the embedded server: {' '.join(server.argv)}[/]")
            t0 = time.perf_counter()
            try:
                server.start()
            except ServerStartError as e:
                console.print(f"[red]error: the embedded server did not start[/]\n{e}")
                return 3
            console.print(f"[dim]server healthy at {server.base_url} after {time.perf_counter() - t0:.1f}s[/]")
            base_url = server.base_url
        model = model or first_model(base_url, args.api_key) or "default"

        if args.framework == "autogen":
            from examples.peer_financial_qa.autogen_app import AutoGenPeer

            peer = AutoGenPeer(base_url=base_url, model=model, api_key=args.api_key, max_tokens=args.max_tokens,
                               temperature=args.temperature, seed=args.seed, jump=args.jump,
                               max_rounds=args.max_rounds, executors=args.executors,
                               instrument=not args.no_instrument)
            usage, instrumented, invoke = peer.usage, peer.instrumented, peer.invoke
        else:
            usage = UsageByAgent()
            llm = make_llm(base_url=base_url, model=model, api_key=args.api_key, max_tokens=args.max_tokens,
                           temperature=args.temperature, seed=args.seed, callbacks=[usage])
            builder = build_graph(llm, jump=args.jump, max_rounds=args.max_rounds, corpus=corpus,
                                  search_delay_s=args.search_delay)
            app, instrumented = compile_app(builder, instrument=not args.no_instrument)
            invoke = lambda q: app.invoke(initial_state(q), config={"recursion_limit": 64})  # noqa: E731
        if not args.no_instrument and not instrumented:
            console.print(f"[yellow]kvflow_agents.adapters.{args.framework} is not available: running uninstrumented[/]")
        console.print(f"[dim]{args.framework}: model {model} at {base_url}; jump={args.jump}; "
                      f"max rounds {args.max_rounds}; instrumented={instrumented}[/]")

        sampler = CacheSampler(server_root(base_url), interval_s=args.cache_poll)
        if args.cache_poll > 0:
            sampler.start()
        total0 = time.perf_counter()
        failures = 0
        for q in questions:
            t0 = time.perf_counter()
            try:
                result = invoke(q)
            except Exception as e:  # noqa: BLE001 — report and go on with the next question
                failures += 1
                console.print(f"[red]{q.id}: {type(e).__name__}: {e}[/]")
                continue
            print_result(console, q, result, time.perf_counter() - t0, args.show_findings)
        console.rule()
        console.print(f"{len(questions) - failures}/{len(questions)} questions answered in "
                      f"{time.perf_counter() - total0:.1f}s")
        sampler.stop()
        snap = usage.snapshot()
        console.print(usage_table(snap))
        kv_table = kvflow_usage_table(snap)
        if kv_table is not None:
            console.print(kv_table)
        if sampler.available:
            print_cache(console, sampler)
        elif args.cache_poll > 0:
            console.print("[dim]the server has no GET /kvflow/v1/cache (residency not shown)[/]"
                          if sampler.available is False else
                          "[dim]GET /kvflow/v1/cache did not answer during the run (residency not shown)[/]")
        return 1 if failures else 0
    finally:
        if sampler is not None:
            sampler.stop()
        if peer is not None:
            peer.close()
        if server is not None:
            server.stop()


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    return run(args, Console())


if __name__ == "__main__":
    sys.exit(main())
