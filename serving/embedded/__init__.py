"""The embedded engine: a real small model on CPU (or one GPU), paged device + host KV pools.

Sub-modules:
- ``model``: Llama config/presets, GGUF loader, tokenizer + chat template, the paged forward.
- ``kv_pool``: :class:`PagedKVPool`, the two KV tiers, implementing the policy's
  ``KVTransferBackend`` protocol.
"""
