"""A minimal engine for policy tests: drives KVCacheManager the way an engine would."""

from __future__ import annotations

from types import SimpleNamespace

from kvflow_agents.serving.policy import KVCacheManager, NullTransferBackend


class VirtualClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_manager(policy, *, page_size=1, device_pages=64, host_pages=256, link=None,
                 clock=None, **kw) -> KVCacheManager:
    clock = clock or VirtualClock()
    backend = NullTransferBackend(bytes_per_page=1 if link else 0, link_bytes_per_s=link,
                                  clock=clock)
    m = KVCacheManager(policy, page_size=page_size, device_pages=device_pages,
                       host_pages=host_pages, backend=backend, **kw)
    m.clock = clock  # test convenience
    return m


def serve(m: KVCacheManager, tokens, prefix_len: int, workflow: str, agent: str, *,
          wait_loads: bool = True, tag: bool = True):
    """One request: match, load what is on host, lock, allocate the rest, insert, unlock, tag.

    Returns the first match (what the request found when it arrived) or None if the device
    could not hold the request.
    """
    first = m.match(tokens)
    pm = first
    if pm.needs_load or pm.loading:
        ready = m.load_on_demand(pm) if pm.needs_load else None
        if wait_loads:
            if ready is None and pm.loading:
                ready = max((ld.ready for ld in m.loads.inflight_loads()), default=m.clock.t)
            if ready is not None:
                m.clock.t = max(m.clock.t, ready)
                m.tick(m.clock.t)
        pm = m.match(tokens, record=False)
    handle = m.lock(pm)
    need = len(tokens) // m.page_size - len(pm.device_pages)
    pages = m.allocate(need)
    if pages is None:
        m.unlock(handle)
        return None
    m.insert(tokens, pm.device_pages + pages)
    m.unlock(handle)
    if tag:
        m.tag_fixed_prefix(tokens, prefix_len, workflow, agent)
    return first


def put(m: KVCacheManager, tokens, wf=None, agent=None, fixed=None, app=None):
    """Insert tokens as an engine would after prefill; tag when an agent is given."""
    pm = m.match(tokens, record=False)
    h = m.lock(pm)
    pages = m.allocate(len(tokens) // m.page_size - len(pm.device_pages))
    assert pages is not None
    node = m.insert(tokens, pm.device_pages + pages)
    m.unlock(h)
    if agent:
        m.tag_fixed_prefix(tokens, fixed if fixed is not None else len(tokens), wf, agent, app=app)
    return node


def hint(agent, ste, wf="w", step=0):
    """A request's hints object (the fields the manager reads)."""
    return SimpleNamespace(workflow=wf, agent=agent, ste=ste, step=step, app=None, event=None)


def to_host(m: KVCacheManager, tokens, agent, wf="w"):
    """Cache ``tokens`` as ``agent``'s tagged prefix, then push it to the host tier."""
    put(m, tokens, wf, agent, len(tokens))
    held = m.allocate(m.device.num_free + m.evictable_device_pages)
    assert m.agent_residency(wf, agent) == "host"
    m.free(held)
