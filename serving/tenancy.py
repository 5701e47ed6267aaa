"""Tenants of a kvflow server: who a request belongs to, and the namespace of its workflows.

A **tenant is the API key** a request authenticates with: ``--api-key K`` (one tenant; repeat the
flag for more) or ``--api-keys-file F`` (``{"tenant-name": "key", ...}`` or ``name key`` lines).
When several apps share one key, the operator may declare a header (``--tenant-header
x-kvflow-tenant``): its value (``[A-Za-z0-9._-]{1,64}``) then splits the key's tenant further
(``name+value``). The header is only as trustworthy as the clients holding the key: use separate
keys where tenants do not trust each other. Without keys and without a declared header the
server is single-tenant (tenant ``None``): nothing is namespaced, as before.

Rules, the same in the embedded server and the SGLang plugin's endpoints:

- a tenant's workflow ids live in its own namespace (:func:`scope_hints`): another tenant
  using the same workflow id names a different workflow, so it cannot end, alter or revive
  someone else's workflow, and ``/kvflow/v1/cache`` lists only the caller's workflows, with
  their ids as the caller sent them (:func:`visible_key`);
- the tenant is the *client* the policy core's per-client cap counts hints against
  (``kvflow serve --client-cap``; default: a fair share of the device pool per active tenant),
  so one tenant's flood of urgent hints cannot evict another tenant's prefixes.

Scoped keys: ``T::workflow``, or ``T::app/workflow`` when the hint names an app (the app is
scoped: app-wide prefix sharing stays within a tenant). Tenant names cannot contain ``:``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
SEP = "::"
DEFAULT_TENANT = "default"


class TenantError(ValueError):
    """Bad credentials (``status`` 401) or a bad tenant header (400)."""

    def __init__(self, message: str, status: int = 401) -> None:
        super().__init__(message)
        self.status = status


def key_tenant_name(key: str) -> str:
    """The tenant name of an unnamed key: stable, and no secret in logs."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:10]


def load_keys_file(path: "str | Path") -> dict[str, str]:
    """``{tenant: key}`` from a JSON object or from ``tenant key`` lines (``#`` comments)."""
    text = Path(path).read_text()
    if text.lstrip().startswith("{"):
        data = json.loads(text)
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise ValueError(f"{path}: expected a JSON object of tenant name -> key")
        return dict(data)
    out = {}
    for i, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(None, 1)
        if len(parts) != 2:
            raise ValueError(f"{path}:{i}: expected 'tenant-name key'")
        out[parts[0]] = parts[1].strip()
    return out


class Tenancy:
    """Authenticates a request and names its tenant. ``keys``: ``{tenant: key}``."""

    def __init__(self, keys: Optional[Mapping[str, str]] = None,
                 tenant_header: Optional[str] = None) -> None:
        self.keys = dict(keys or {})
        for name, key in self.keys.items():
            if not TENANT_NAME.fullmatch(name):
                raise ValueError(f"tenant name {name!r}: use 1-64 of A-Z a-z 0-9 . _ -")
            if not key:
                raise ValueError(f"tenant {name!r}: empty key")
        if len(set(self.keys.values())) != len(self.keys):
            raise ValueError("two tenants share one key")
        self.tenant_header = tenant_header.lower() if tenant_header else None
        self._encoded = [(name, key.encode()) for name, key in self.keys.items()]

    @classmethod
    def from_options(cls, api_key: "str | Sequence[str] | Mapping[str, str] | None" = None,
                     tenant_header: Optional[str] = None) -> "Tenancy":
        if api_key is None:
            keys: dict[str, str] = {}
        elif isinstance(api_key, str):
            keys = {key_tenant_name(api_key): api_key} if api_key else {}
        elif isinstance(api_key, Mapping):
            keys = dict(api_key)
        else:
            keys = {key_tenant_name(k): k for k in api_key if k}
        return cls(keys, tenant_header)

    @property
    def shared(self) -> bool:
        """Several tenants share this server (then operator endpoints are closed to them)."""
        return len(self.keys) > 1 or self.tenant_header is not None

    @property
    def enabled(self) -> bool:
        """Whether requests are namespaced (keys or a tenant header are configured)."""
        return bool(self.keys) or self.tenant_header is not None

    def authenticate(self, headers: Mapping[str, str]) -> Optional[str]:
        """The request's tenant (``None``: single-tenant server). Raises :class:`TenantError`."""
        tenant = None
        if self.keys:
            auth = headers.get("authorization", "")
            given = (auth[7:].strip() if auth.lower().startswith("bearer ")
                     else headers.get("x-api-key", "")).encode()
            for name, key in self._encoded:  # compare against every key: constant time
                if hmac.compare_digest(given, key):
                    tenant = name
            if tenant is None:
                raise TenantError("invalid or missing API key")
        if self.tenant_header is not None:
            sub = headers.get(self.tenant_header)
            if sub is None:
                sub = DEFAULT_TENANT
            elif not TENANT_NAME.fullmatch(sub):
                raise TenantError(f"header {self.tenant_header}: use 1-64 of A-Z a-z 0-9 . _ -", 400)
            tenant = sub if tenant is None else f"{tenant}+{sub}"
        return tenant


def scope_hints(hints: Any, tenant: Optional[str]) -> Any:
    """The hints with their workflow (or app) id in ``tenant``'s namespace (unchanged for
    ``None``). Works on :class:`~kvflow_agents.protocol.Hints` (pydantic, frozen)."""
    if tenant is None or hints is None:
        return hints
    if hints.app:
        return hints.model_copy(update={"app": f"{tenant}{SEP}{hints.app}"})
    return hints.model_copy(update={"workflow": f"{tenant}{SEP}{hints.workflow}"})


def scope_params(params: Mapping[str, Any], tenant: Optional[str]) -> dict:
    """The same scoping on the flat wire form (``kvflow_workflow`` / ``kvflow_app``)."""
    out = dict(params)
    if tenant is None:
        return out
    if out.get("kvflow_app"):
        out["kvflow_app"] = f"{tenant}{SEP}{out['kvflow_app']}"
    elif isinstance(out.get("kvflow_workflow"), str):
        out["kvflow_workflow"] = f"{tenant}{SEP}{out['kvflow_workflow']}"
    return out


def visible_key(key: str, tenant: Optional[str]) -> Optional[str]:
    """A scoped workflow key as ``tenant`` sees it, or ``None`` if it is not ``tenant``'s."""
    if tenant is None:
        return key
    prefix = tenant + SEP
    return key[len(prefix):] if key.startswith(prefix) else None
