"""Import-time shims that let stock ``sglang==0.5.23`` serve without ``sgl_kernel``.

Test/support code, never imported by the plugin or its launcher. It is what the real-server
tests (``tests/sglang_server``), ``kvflow bench workflow --engine sglang`` on a CPU and the
prepared GPU proof (``serving/sglang/gpu_check.py``) put under SGLang, and nothing else.

Activation: a process whose ``PYTHONPATH`` holds this folder imports ``sitecustomize.py`` from
here at start-up, which calls :func:`install_from_env`; it acts only when
``KVFLOW_SGLANG_SHIMS`` is ``cpu`` or ``cuda``. SGLang starts its scheduler and detokenizer
with multiprocessing *spawn*: fresh interpreters that inherit the environment, so every SGLang
process gets the same shims before it imports SGLang.

What is patched, and why (each checked against the pinned version; a moved name fails loudly
with :class:`ShimError` instead of serving something half-patched):

``cpu`` (a CPU without AMX, like the dev box and CI):
- ``SGLANG_USE_CPU_ENGINE=1``: else ``is_cpu()`` is False and rotary embedding imports vllm.
- an import-only ``sgl_kernel`` stand-in: SGLang modules import CPU kernels at module level
  (``kernels/ops/kvcache/cache_move.py``, ``mem_cache/allocation.py``, speculative ops); on a
  CPU without AMX none of the fused ops is called (they dispatch to ``forward_native``), and
  a name that *is* called raises ``NotImplementedError`` naming it. Two that the CPU path
  calls get torch versions: ``assign_req_to_token_pool_cpu`` and
  ``copy_all_layer_kv_cache_cpu``.
- ``mem_cache/pool_host/common.py::_cuda_host_register`` -> no-op (host pools pin by default).
- ``mem_cache/pool_host/base.py::HICACHE_HOST_MEMORY_RESERVE_BYTES`` 10 GiB -> 256 MiB: SGLang
  keeps 10 GiB of host RAM free before sizing any host pool (a GPU server's margin); on a small
  shared CPU box that refuses even a 1 MB pool.
- HiCache copies: ``transfer_kv_direct`` (torch: ``dst[di] = src[si]`` per layer) set on
  ``mem_cache/pool_host/mha.py``; the server must run ``--hicache-io-backend direct
  --hicache-mem-layout layer_first``, the only layout with a torch path (the default kernel +
  page_first one has none). The flags: ``kvflow_agents.bench.sglang_engine.shim_args``.

``cuda`` (a GPU machine where ``sgl_kernel`` is absent): the same stand-in and the same torch
``transfer_kv_direct`` (real host->device copies through PyTorch, pinned host pool kept), plus
``SGLANG_FORCE_FUSED_OP_BACKEND=torch`` so fused ops take ``forward_native``; the server must
run ``--attention-backend torch_native --sampling-backend pytorch --disable-cuda-graph``
(``shim_args('cuda')``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

PINNED_SGLANG = "0.5.23"
ENV = "KVFLOW_SGLANG_SHIMS"

CPU_HOST_MEMORY_RESERVE_BYTES = 256 * 1024 ** 2

_installed: str | None = None


class ShimError(RuntimeError):
    """SGLang's internals are not what these shims were written against."""


# ------------------------------------------------------------------------------ sgl_kernel
class _MissingKernel:
    """Any ``sgl_kernel`` attribute: importable, fails when called."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, item: str):
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _MissingKernel(f"{self._name}.{item}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name}: sgl_kernel is not installed (kvflow shims "
                                  f"provide import-time names only)")

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in {self._name}>"


class _KernelModule(types.ModuleType):
    def __getattr__(self, item: str):
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        override = _KERNEL_OVERRIDES.get(f"{self.__name__}.{item}")
        if override is not None:
            return override
        return _MissingKernel(f"{self.__name__}.{item}")


class _KernelLoader(importlib.abc.Loader):
    def create_module(self, spec):
        m = _KernelModule(spec.name)
        m.__path__ = []
        m.__version__ = "0.0.0+kvflow-shim"
        return m

    def exec_module(self, module) -> None:
        pass


class _KernelFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "sgl_kernel" or fullname.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(fullname, _KernelLoader(), is_package=True)
        return None


def _has_real_sgl_kernel() -> bool:
    for finder in sys.meta_path:
        if isinstance(finder, _KernelFinder):
            continue
        try:
            if finder.find_spec("sgl_kernel", None) is not None:
                return True
        except Exception:  # noqa: BLE001 - a broken finder is not our business
            continue
    return False


# ------------------------------------------------------------------------------ torch kernels
def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size: int = 1):
    """Torch version of ``sgl_kernel.kvcacheio.transfer_kv_direct`` (layer_first layout):
    for each (src, dst) layer pair, ``dst[dst_indices] = src[src_indices]``. Works host->device
    and device->host; indices may live on either side."""
    for src, dst in zip(src_layers, dst_layers):
        si = src_indices.to(src.device) if src_indices.device != src.device else src_indices
        di = dst_indices.to(dst.device) if dst_indices.device != dst.device else dst_indices
        rows = src.index_select(0, si)
        if rows.device != dst.device:
            rows = rows.to(dst.device, non_blocking=rows.is_pinned())
        dst.index_copy_(0, di, rows)


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, max_context_len=None):
    """Torch version of the CPU kernel: write each request's new slots into its row."""
    pos = 0
    starts, ends = start_offset.tolist(), end_offset.tolist()
    for row, s, e in zip(req_pool_indices.tolist(), starts, ends):
        n = e - s
        req_to_token[row, s:e] = out_cache_loc[pos:pos + n].to(req_to_token.dtype)
        pos += n


def copy_all_layer_kv_cache_cpu(k_buffers, v_buffers, tgt_loc, src_loc, *args, **kwargs):
    """Torch version of the CPU kernel: move KV rows src_loc -> tgt_loc in every layer."""
    for buf in (*k_buffers, *v_buffers):
        buf[tgt_loc] = buf[src_loc]


_KERNEL_OVERRIDES = {
    "sgl_kernel.assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
    "sgl_kernel.copy_all_layer_kv_cache_cpu": copy_all_layer_kv_cache_cpu,
    "sgl_kernel.kvcacheio.transfer_kv_direct": transfer_kv_direct,
}


# ------------------------------------------------------------------------------ module patches
class _PostImportPatcher(importlib.abc.MetaPathFinder):
    """Runs a patch right after a named module is executed (before anyone uses it)."""

    def __init__(self, patches: dict) -> None:
        self.patches = patches
        self._busy: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.patches or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        patch = self.patches[fullname]
        orig_exec = spec.loader.exec_module

        def exec_module(module, _orig=orig_exec, _patch=patch):
            _orig(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


def _require(module, *names: str) -> None:
    missing = [n for n in names if not hasattr(module, n)]
    if missing:
        raise ShimError(f"{module.__name__} has no {', '.join(missing)}: SGLang's internals moved "
                        f"(shims written for sglang=={PINNED_SGLANG})")


def _patch_pool_host_common(module) -> None:
    _require(module, "_cuda_host_register")
    module._cuda_host_register = lambda *a, **k: None


def _patch_pool_host_base(module) -> None:
    _require(module, "HICACHE_HOST_MEMORY_RESERVE_BYTES", "host_memory_budget_bytes")
    module.HICACHE_HOST_MEMORY_RESERVE_BYTES = CPU_HOST_MEMORY_RESERVE_BYTES


def _patch_pool_host_mha(module) -> None:
    _require(module, "MHATokenToKVPoolHost")
    _require(module.MHATokenToKVPoolHost, "load_to_device_per_layer_physical",
             "backup_from_device_all_layer_physical")
    # the module imports transfer_kv_direct only on CUDA/XPU; set it either way
    module.transfer_kv_direct = transfer_kv_direct


def _check_version() -> None:
    try:
        from importlib.metadata import version

        got = version("sglang")
    except Exception as e:  # noqa: BLE001
        raise ShimError(f"sglang is not installed: {e}") from None
    if got != PINNED_SGLANG:
        raise ShimError(f"these shims are written for sglang=={PINNED_SGLANG}, found {got}; "
                        f"re-check every patched name before changing the pin")


def install(device: str) -> None:
    """Install the shims for ``device`` ("cpu" or "cuda") in this process (idempotent)."""
    global _installed
    if device not in ("cpu", "cuda"):
        raise ShimError(f"{ENV} must be 'cpu' or 'cuda', not {device!r}")
    if _installed == device:
        return
    if _installed is not None:
        raise ShimError(f"shims already installed for {_installed}")
    _check_version()
    for name in ("sglang.srt.mem_cache.pool_host.common", "sglang.srt.mem_cache.pool_host.mha",
                 "sglang.srt.mem_cache.pool_host.base"):
        if name in sys.modules:
            raise ShimError(f"{name} was imported before the shims; start the process with the "
                            f"shims folder on PYTHONPATH and {ENV}={device}")
    if device == "cpu":
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        patches = {"sglang.srt.mem_cache.pool_host.common": _patch_pool_host_common,
                   "sglang.srt.mem_cache.pool_host.base": _patch_pool_host_base,
                   "sglang.srt.mem_cache.pool_host.mha": _patch_pool_host_mha}
    else:
        os.environ.setdefault("SGLANG_FORCE_FUSED_OP_BACKEND", "torch")
        patches = {"sglang.srt.mem_cache.pool_host.mha": _patch_pool_host_mha}
    if not _has_real_sgl_kernel():
        sys.meta_path.insert(0, _KernelFinder())
    sys.meta_path.insert(0, _PostImportPatcher(patches))
    _installed = device


def install_from_env() -> None:
    device = os.environ.get(ENV, "").strip().lower()
    if device:
        install(device)


def installed() -> str | None:
    return _installed
