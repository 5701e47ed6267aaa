"""A compact Llama forward (RMSNorm, RoPE, GQA, SwiGLU) over a paged KV pool.

KV layout (one tensor per tier, see ``kv_pool.PagedKVPool``)::

    kv[layer, 0=K|1=V, page, slot, kv_head, head_dim]      # contiguous, dtype = weights' dtype

A sequence's KV is addressed by its page list: token position ``p`` lives in
``pages[p // page_size]`` at slot ``p % page_size``. The caller (the radix cache) owns placement;
the model only reads/writes the slots it is told to.

Public API (all under ``torch.inference_mode``; ``kv`` is ``pool.device_kv``):

- ``LlamaModel.prefill(kv, tokens, pages, cached_len, *, chunk_size=512, return_all=False)``:
  positions ``[0, cached_len)`` are already in ``pages``; the ``len(tokens)`` new tokens are
  written at ``[cached_len, cached_len+n)`` (``pages`` must cover them) and attend over
  prefix + new, in chunks. Returns fp32 logits ``[vocab]`` of the last token
  (``[n, vocab]`` with ``return_all``).
- ``LlamaModel.decode_batch(kv, [(token, pages, cached_len), ...], *, invariant_rows=None)``:
  one new token per sequence, written at position ``cached_len``; batched across sequences
  (pages padded, keys masked). Returns fp32 logits ``[B, vocab]``. With ``invariant_rows=R``
  it is *batch-invariant*: a sequence's logits are bit-identical whatever else is in the batch.

Batch invariance (the deterministic mode, after SGLang's ``--enable-deterministic-inference``
and vLLM's batch-invariant kernels): a GEMM's result for one row depends on the kernel the BLAS
picks for the whole shape (small-M paths reduce in another order; on this project's CPU, fp32
rows differ between M < 4 and M >= 4), and padding keys to the longest sequence of the batch
changes the attention reductions' lengths. So ``invariant_rows`` runs every linear layer on
exactly R rows (the batch padded; R = the engine's max batch), and attention per sequence over
its own pages only. Costs: a lone sequence pays an R-row GEMM, and B small attention calls
replace one batched call (``kvflow bench reliability`` measures it).

Numerics: weights, activations and KV in ``config.dtype`` (bf16 by default); RMSNorm, RoPE,
q·k scores and softmax in fp32. Attention is plain matmuls (faster than torch SDPA on CPU).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .config import LlamaConfig


def _rope_inv_freq(c: LlamaConfig) -> torch.Tensor:
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
    rs = c.rope_scaling or {}
    if rs.get("rope_type", rs.get("type")) == "llama3":
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(is_mid, mid, scaled)
    return inv.float()


def resolve_device(device: str | torch.device) -> torch.device:
    """``"cuda"`` -> ``cuda:<current>``, so device equality checks hold."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


class LlamaModel:
    """Weights of one Llama model on one device; stateless apart from them.

    ``weights``: HF Llama names (``model.layers.N.self_attn.q_proj.weight``, ...); the dict is
    consumed. q/k/v and gate/up are fused at load."""

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor],
                 device: str | torch.device = "cpu") -> None:
        self.config = c = config
        self.device = resolve_device(device)
        dt = c.torch_dtype

        def w(name, dtype=dt):  # consumes the entry, so unfused copies are freed early
            return weights.pop(name).to(device=self.device, dtype=dtype)

        self.embed = w("model.embed_tokens.weight")
        self.lm_head = (self.embed if c.tie_embeddings or "lm_head.weight" not in weights
                        else w("lm_head.weight"))
        self.norm = w("model.norm.weight", torch.float32)
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(dict(
                ln1=w(p + "input_layernorm.weight", torch.float32),
                ln2=w(p + "post_attention_layernorm.weight", torch.float32),
                qkv=torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"]).contiguous(),
                o=w(p + "self_attn.o_proj.weight"),
                gate_up=torch.cat([w(p + "mlp.gate_proj.weight"),
                                   w(p + "mlp.up_proj.weight")]).contiguous(),
                down=w(p + "mlp.down_proj.weight")))
        inv = _rope_inv_freq(c)
        ang = torch.outer(torch.arange(c.max_position, dtype=torch.float32), inv)
        self.cos = torch.cat([ang.cos(), ang.cos()], -1).to(self.device)  # [max_pos, head_dim]
        self.sin = torch.cat([ang.sin(), ang.sin()], -1).to(self.device)
        self._q = c.num_heads * c.head_dim
        self._dt = dt
        self._kv = c.num_kv_heads * c.head_dim

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path, config: LlamaConfig, device="cpu") -> "LlamaModel":
        """Load HF-named safetensors (``model.safetensors`` or shards) from ``path``."""
        from safetensors.torch import load_file
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors files")
        weights: dict[str, torch.Tensor] = {}
        for f in files:
            weights.update(load_file(str(f)))
        return cls(config, weights, device)

    @classmethod
    def random(cls, config: LlamaConfig, device="cpu", seed: int | None = None) -> "LlamaModel":
        """Seeded random weights, generated on ``device`` (an 8B shape never touches host RAM)."""
        return cls(config, random_weights(config, device, seed), device)

    def kv_shape(self, num_pages: int, page_size: int) -> tuple[int, ...]:
        c = self.config
        return (c.num_layers, 2, num_pages, page_size, c.num_kv_heads, c.head_dim)

    # -- pieces --------------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_eps)
        return (xf * w).to(self._dt)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [..., T, heads, hd] -> fp32, rotated (half-split / "rotate_half" convention)."""
        xf = x.float()
        h = xf.shape[-1] // 2
        rot = torch.cat([-xf[..., h:], xf[..., :h]], -1)
        return xf * cos.unsqueeze(-2) + rot * sin.unsqueeze(-2)

    def _mlp(self, x: torch.Tensor, L: dict) -> torch.Tensor:
        gu = self._rms(x, L["ln2"]) @ L["gate_up"].T
        g, u = gu.split(self.config.intermediate, -1)
        return (F.silu(g) * u) @ L["down"].T

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return (self._rms(x, self.norm) @ self.lm_head.T).float()

    def _check_kv(self, kv: torch.Tensor) -> None:
        c = self.config
        if kv.dtype != self._dt or kv.dim() != 6 or kv.shape[0] != c.num_layers \
                or kv.shape[4:] != (c.num_kv_heads, c.head_dim) or kv.device != self.device:
            raise ValueError(f"kv pool {tuple(kv.shape)} {kv.dtype} on {kv.device} does not fit: "
                             f"want {self.kv_shape(-1, -1)} {self._dt} on {self.device}")

    def _page_tensor(self, pages: Sequence[int], n: int) -> torch.Tensor:
        if len(pages) < n:
            raise ValueError(f"need {n} pages, got {len(pages)}")
        return torch.as_tensor(list(pages[:n]), dtype=torch.long, device=self.device)

    # -- prefill -------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, kv: torch.Tensor, tokens: Sequence[int] | torch.Tensor,
                pages: Sequence[int], cached_len: int, *, chunk_size: int = 512,
                return_all: bool = False,
                before_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Prefill ``tokens`` after the ``cached_len`` tokens whose KV ``pages`` hold.
        ``before_layer(i)`` runs before layer ``i`` reads the cached prefix's KV (a load of it
        still in flight lands layer by layer: the caller waits for layer ``i`` there)."""
        self._check_kv(kv)
        toks = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(-1)
        n, ps = toks.numel(), kv.shape[3]
        if n == 0:
            raise ValueError("prefill needs at least one new token")
        if cached_len + n > self.config.max_position:
            raise ValueError(f"sequence of {cached_len + n} exceeds max_position")
        page_t = self._page_tensor(pages, -(-(cached_len + n) // ps))
        outs = []
        for s in range(0, n, chunk_size):
            e = min(n, s + chunk_size)
            out = self._prefill_chunk(kv, toks[s:e], page_t, cached_len + s,
                                      "all" if return_all else ("last" if e == n else None),
                                      before_layer if s == 0 else None)
            if out is not None:
                outs.append(out)
        return torch.cat(outs) if return_all else outs[-1][-1]

    def _prefill_chunk(self, kv, toks, page_t, start, want, before_layer=None):
        c, ps = self.config, kv.shape[3]
        T, H, KVH, hd = toks.numel(), c.num_heads, c.num_kv_heads, c.head_dim
        G = H // KVH
        pos = torch.arange(start, start + T, device=self.device)
        slots = page_t[pos // ps] * ps + pos % ps
        pre_pages = page_t[: -(-start // ps)] if start else None
        Tk = start + T
        mask = torch.full((T, Tk), float("-inf"), device=self.device).triu_(start + 1)
        cos, sin = self.cos[pos], self.sin[pos]
        scale = 1.0 / math.sqrt(hd)
        x = self.embed[toks].float()  # fp32 residual stream
        for li, L in enumerate(self.layers):
            qkv = self._rms(x, L["ln1"]) @ L["qkv"].T
            q, k, v = qkv.split([self._q, self._kv, self._kv], -1)
            q = self._rope(q.view(T, H, hd), cos, sin) * scale               # fp32
            k = self._rope(k.view(T, KVH, hd), cos, sin).to(kv.dtype)
            v = v.reshape(T, KVH, hd)
            flat = kv[li].view(2, -1, KVH, hd)
            flat[0].index_copy_(0, slots, k)
            flat[1].index_copy_(0, slots, v)
            if pre_pages is not None:
                if before_layer is not None:
                    before_layer(li)
                kp = kv[li, 0].index_select(0, pre_pages).view(-1, KVH, hd)[:start]
                vp = kv[li, 1].index_select(0, pre_pages).view(-1, KVH, hd)[:start]
                k, v = torch.cat([kp, k]), torch.cat([vp, v])
            # GQA: query heads of one kv head side by side -> [KVH, G*T, hd]
            qg = q.view(T, KVH, G, hd).permute(1, 2, 0, 3).reshape(KVH, G * T, hd)
            sc = torch.bmm(qg, k.float().permute(1, 2, 0))                   # [KVH, G*T, Tk]
            sc = sc.view(KVH, G, T, Tk).add_(mask).softmax(-1).to(v.dtype)
            o = torch.bmm(sc.view(KVH, G * T, Tk), v.permute(1, 0, 2))      # [KVH, G*T, hd]
            o = o.view(KVH, G, T, hd).permute(2, 0, 1, 3).reshape(T, H * hd)
            x = x + (o @ L["o"].T).float()
            x = x + self._mlp(x, L).float()
        if want == "all":
            return self._logits(x)
        if want == "last":
            return self._logits(x[-1:])
        return None

    # -- decode --------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode_batch(self, kv: torch.Tensor, seqs: Sequence[tuple[int, Sequence[int], int]], *,
                     invariant_rows: int | None = None) -> torch.Tensor:
        c, ps = self.config, kv.shape[3]
        B, H, KVH, hd = len(seqs), c.num_heads, c.num_kv_heads, c.head_dim
        if B == 0:
            raise ValueError("decode_batch needs at least one sequence")
        self._check_kv(kv)
        if invariant_rows is not None:
            R = int(invariant_rows)
            return torch.cat([self._decode_invariant(kv, seqs[i:i + R], R) for i in range(0, B, R)])
        lens = [int(s[2]) for s in seqs]
        if max(lens) + 1 > c.max_position:
            raise ValueError("sequence exceeds max_position")
        npg = max(ln // ps + 1 for ln in lens)  # pages incl. the new token's
        page_rows, slot_list = [], []
        for (_, pages, ln) in seqs:
            need = ln // ps + 1
            if len(pages) < need:
                raise ValueError(f"need {need} pages for position {ln}, got {len(pages)}")
            row = list(pages[:need])
            page_rows.append(row + [row[-1]] * (npg - need))
            slot_list.append(row[-1] * ps + ln % ps)
        dev = self.device
        toks = torch.as_tensor([int(s[0]) for s in seqs], dtype=torch.long, device=dev)
        pos = torch.as_tensor(lens, dtype=torch.long, device=dev)
        slots = torch.as_tensor(slot_list, dtype=torch.long, device=dev)
        page_idx = torch.as_tensor(page_rows, dtype=torch.long, device=dev).view(-1)
        Tk = npg * ps
        mask = torch.zeros(B, Tk, 1, device=dev).masked_fill_(
            (torch.arange(Tk, device=dev)[None, :] > pos[:, None]).unsqueeze(-1), float("-inf"))
        heads, owner, qblock = self._decode_gqa_helpers()
        cos, sin = self.cos[pos], self.sin[pos]                               # [B, hd]
        scale = 1.0 / math.sqrt(hd)
        x = self.embed[toks].float()  # fp32 residual stream, [B, hidden]
        for li, L in enumerate(self.layers):
            qkv = self._rms(x, L["ln1"]) @ L["qkv"].T
            q, k, v = qkv.split([self._q, self._kv, self._kv], -1)
            q = self._rope(q.view(B, H, hd), cos, sin) * scale                # fp32
            k = self._rope(k.view(B, KVH, hd), cos, sin).to(kv.dtype)
            flat = kv[li].view(2, -1, KVH, hd)
            flat[0].index_copy_(0, slots, k)
            flat[1].index_copy_(0, slots, v.reshape(B, KVH, hd))
            # keys/values as [B, Tk, KVH*hd] straight from the gathered pages (no transposes);
            # GQA through a block-diagonal query matrix [B, KVH*hd, H]
            ka = kv[li, 0].index_select(0, page_idx).view(B, Tk, KVH * hd)
            va = kv[li, 1].index_select(0, page_idx).view(B, Tk, KVH * hd)
            qb = (q.view(B, H, 1, hd) * qblock).view(B, H, KVH * hd).transpose(1, 2)
            sc = torch.bmm(ka.float(), qb).add_(mask).softmax(1).to(va.dtype)  # [B, Tk, H]
            o = torch.bmm(sc.transpose(1, 2), va)                             # [B, H, KVH*hd]
            o = o.view(B, H, KVH, hd)[:, heads, owner].reshape(B, H * hd)  # diagonal blocks
            x = x + (o @ L["o"].T).float()
            x = x + self._mlp(x, L).float()
        return self._logits(x)

    def _decode_invariant(self, kv: torch.Tensor, seqs, R: int) -> torch.Tensor:
        """Batch-invariant decode of up to ``R`` sequences (see the module docstring): linear
        layers on exactly ``R`` rows, attention one sequence at a time over its own pages."""
        c, ps = self.config, kv.shape[3]
        B, H, KVH, hd = len(seqs), c.num_heads, c.num_kv_heads, c.head_dim
        lens = [int(s[2]) for s in seqs]
        if max(lens) + 1 > c.max_position:
            raise ValueError("sequence exceeds max_position")
        dev = self.device
        pages_of, slot_list = [], []
        for (_, pages, ln) in seqs:
            need = ln // ps + 1
            if len(pages) < need:
                raise ValueError(f"need {need} pages for position {ln}, got {len(pages)}")
            pages_of.append(torch.as_tensor(list(pages[:need]), dtype=torch.long, device=dev))
            slot_list.append(pages[need - 1] * ps + ln % ps)
        pad = R - B
        toks = torch.as_tensor([int(s[0]) for s in seqs] + [0] * pad, dtype=torch.long, device=dev)
        pos = torch.as_tensor(lens + [0] * pad, dtype=torch.long, device=dev)
        slots = torch.as_tensor(slot_list, dtype=torch.long, device=dev)
        masks = [torch.zeros(len(p) * ps, 1, device=dev).masked_fill_(
            (torch.arange(len(p) * ps, device=dev) > ln).unsqueeze(-1), float("-inf"))
            for p, ln in zip(pages_of, lens)]
        heads, owner, qblock = self._decode_gqa_helpers()
        cos, sin = self.cos[pos], self.sin[pos]
        scale = 1.0 / math.sqrt(hd)
        x = self.embed[toks].float()                                          # [R, hidden]
        for li, L in enumerate(self.layers):
            qkv = self._rms(x, L["ln1"]) @ L["qkv"].T
            q, k, v = qkv.split([self._q, self._kv, self._kv], -1)
            q = self._rope(q.view(R, H, hd), cos, sin) * scale
            k = self._rope(k.view(R, KVH, hd), cos, sin).to(kv.dtype)
            flat = kv[li].view(2, -1, KVH, hd)
            flat[0].index_copy_(0, slots, k[:B])
            flat[1].index_copy_(0, slots, v[:B].reshape(B, KVH, hd))
            qb = (q[:B].view(B, H, 1, hd) * qblock).view(B, H, KVH * hd).transpose(1, 2)
            o = torch.zeros(R, H * hd, dtype=kv.dtype, device=dev)
            for i in range(B):  # own pages only: shapes depend on this sequence alone
                Tk = len(pages_of[i]) * ps
                ka = kv[li, 0].index_select(0, pages_of[i]).view(1, Tk, KVH * hd)
                va = kv[li, 1].index_select(0, pages_of[i]).view(1, Tk, KVH * hd)
                sc = torch.bmm(ka.float(), qb[i:i + 1]).add_(masks[i]).softmax(1).to(va.dtype)
                oi = torch.bmm(sc.transpose(1, 2), va)                        # [1, H, KVH*hd]
                o[i] = oi.view(H, KVH, hd)[heads, owner].reshape(H * hd)
            x = x + (o @ L["o"].T).float()
            x = x + self._mlp(x, L).float()
        return self._logits(x)[:B]

    def _decode_gqa_helpers(self):
        if not hasattr(self, "_gqa"):
            c, dev = self.config, self.device
            heads = torch.arange(c.num_heads, device=dev)
            owner = heads // (c.num_heads // c.num_kv_heads)                    # kv head of q head
            onehot = owner[:, None] == torch.arange(c.num_kv_heads, device=dev)
            self._gqa = (heads, owner, onehot.float().view(c.num_heads, c.num_kv_heads, 1))
        return self._gqa


def random_weights(config: LlamaConfig, device="cpu", seed: int | None = None
                   ) -> dict[str, torch.Tensor]:
    """HF-named random weights, seeded (``config.extra["seed"]`` unless ``seed`` is given);
    linear layers ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norms ~ 1 + N(0, 0.1)."""
    c, dt = config, config.torch_dtype
    g = torch.Generator(device=device)
    g.manual_seed(config.extra.get("seed", 0) if seed is None else seed)

    def rnd(*shape, std=None):
        std = std if std is not None else 1.0 / math.sqrt(shape[-1])
        return torch.randn(*shape, generator=g, device=device, dtype=dt) * std

    def ones(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g, device=device, dtype=torch.float32)

    weights = {"model.embed_tokens.weight": rnd(c.vocab_size, c.hidden, std=1.0),
               "model.norm.weight": ones(c.hidden)}
    if not c.tie_embeddings:
        weights["lm_head.weight"] = rnd(c.vocab_size, c.hidden)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": ones(c.hidden),
            p + "post_attention_layernorm.weight": ones(c.hidden),
            p + "self_attn.q_proj.weight": rnd(c.num_heads * c.head_dim, c.hidden),
            p + "self_attn.k_proj.weight": rnd(c.num_kv_heads * c.head_dim, c.hidden),
            p + "self_attn.v_proj.weight": rnd(c.num_kv_heads * c.head_dim, c.hidden),
            p + "self_attn.o_proj.weight": rnd(c.hidden, c.num_heads * c.head_dim),
            p + "mlp.gate_proj.weight": rnd(c.intermediate, c.hidden),
            p + "mlp.up_proj.weight": rnd(c.intermediate, c.hidden),
            p + "mlp.down_proj.weight": rnd(c.hidden, c.intermediate)}
    return weights
