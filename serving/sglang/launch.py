"""Launcher fallback: start stock SGLang with KVFlow on, entry point installed or not.

    python -m kvflow_agents.serving.sglang.launch --model-path M [any SGLang flag]
    kvflow serve --engine sglang --model-path M [...]        (calls serve_sglang(argv))

Adds, unless the caller already chose them: ``--enable-hierarchical-cache``,
``--radix-cache-backend kvflow``, ``--radix-eviction-policy kvflow``; forces SGLang's Python
TreeCore (``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python``: the Rust core rejects custom
eviction policies). Our own flags are taken out of argv and passed through the environment,
which SGLang's spawned processes inherit: ``--kvflow-lookahead N``, ``--kvflow-busy-lookahead
N`` (agents further ahead load only on an idle link), ``--kvflow-lease-s S``,
``--kvflow-max-prefetch N``, ``--kvflow-admission fcfs|workflow`` (the waiting queue's order,
``hooks.after_calc_priority``), ``--kvflow-skip-scope all|workflow`` (who may go ahead of a
request whose prefix is loading, ``hooks.around_add_one_req``), ``--kvflow-api-keys-file F``,
``--kvflow-tenant-header H``, ``--kvflow-host-link-gbps X`` (an emulated host link of X GB/s under SGLang's host->device
copies, for CPU studies; see ``host_link.py``).

Why the module registers the plugin at import time: SGLang starts its scheduler processes with
``multiprocessing`` *spawn*, which re-imports the parent's main module in every child as
``__mp_main__``. This module is that main module, so importing it registers the plugin in every
SGLang process even without the entry point. (It must not be a ``__main__.py``: spawn does not
re-import modules named ``__main__``.) SGLang's own ``load_plugins()`` then applies the hooks.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from kvflow_agents.serving.policy.admission import check_admission, check_skip_scope

DEFAULT_FLAGS = (
    ("--enable-hierarchical-cache", None),
    ("--radix-cache-backend", "kvflow"),
    ("--radix-eviction-policy", "kvflow"),
)
OWN_FLAGS = {"--kvflow-lookahead": "KVFLOW_LOOKAHEAD",
             "--kvflow-busy-lookahead": "KVFLOW_BUSY_LOOKAHEAD", "--kvflow-lease-s": "KVFLOW_LEASE_S",
             "--kvflow-max-prefetch": "KVFLOW_MAX_PREFETCH",
             "--kvflow-admission": "KVFLOW_ADMISSION",
             "--kvflow-skip-scope": "KVFLOW_SKIP_SCOPE",
             "--kvflow-api-keys-file": "KVFLOW_API_KEYS_FILE",  # tenants (serving/tenancy.py)
             "--kvflow-tenant-header": "KVFLOW_TENANT_HEADER",
             "--kvflow-host-link-gbps": "KVFLOW_HOST_LINK_GBPS"}
_POSITIVE = {"--kvflow-lease-s", "--kvflow-host-link-gbps"}
_CHOICES = {"--kvflow-admission": check_admission, "--kvflow-skip-scope": check_skip_scope}


def _has_flag(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def build_args(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """SGLang argv with the KVFlow defaults added, and the environment to set."""
    out: list[str] = []
    env = {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}
    it = iter(list(argv))
    for a in it:
        name, eq, val = a.partition("=")
        if name in OWN_FLAGS:
            if not eq:
                val = next(it, None)
                if val is None:
                    raise SystemExit(f"{name} needs a value")
            if name in _POSITIVE:
                try:
                    ok = float(val) > 0 and float(val) != float("inf")
                except ValueError:
                    ok = False
                if not ok:
                    raise SystemExit(f"{name}: expected a positive number, got {val!r}")
            if name in _CHOICES:
                try:
                    _CHOICES[name](val)
                except ValueError as e:
                    raise SystemExit(f"{name}: {e}") from None
            env[OWN_FLAGS[name]] = val
            continue
        out.append(a)
    for flag, value in DEFAULT_FLAGS:
        if flag == "--enable-hierarchical-cache" and _has_flag(out, "--disable-hierarchical-cache"):
            continue
        if not _has_flag(out, flag):
            out.append(flag)
            if value is not None:
                out.append(value)
    return out, env


def _register_plugin() -> None:
    try:
        from kvflow_agents.serving.sglang.plugin import register
    except ImportError:  # SGLang not installed: main() reports it
        return
    register()


def serve_sglang(argv: list[str]) -> int:
    """Run SGLang's HTTP server with KVFlow (blocks). ``argv``: SGLang flags, e.g.
    ``["--model-path", "Qwen/Qwen3-8B", "--port", "30000"]``."""
    try:
        import sglang  # noqa: F401
    except ImportError:
        print("kvflow: SGLang is not installed (pip install 'kvflow-agents[sglang]' on a GPU "
              "machine, or serving/sglang/install-cpu.sh for the CPU test venv)", file=sys.stderr)
        return 2
    args, env = build_args(argv)
    os.environ.update(env)
    # Children started by spawn re-import sys.modules["__main__"]; when called from another
    # entry point (the kvflow CLI), they would not import us. The entry point covers that
    # case when installed; SGLANG_PLUGINS is left alone so a whitelist still applies.
    _register_plugin()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(args)
    try:
        launch_server(server_args)
    finally:
        try:
            from sglang.srt.utils import kill_process_tree

            kill_process_tree(os.getpid(), include_parent=False)
        except Exception:
            pass
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return serve_sglang(list(sys.argv[1:] if argv is None else argv))


# Import-time registration: this is what makes the fallback work in spawned children
# (they import this module as __mp_main__). Cheap and idempotent.
if __name__ in ("__main__", "__mp_main__"):
    _register_plugin()

if __name__ == "__main__":
    sys.exit(main())
