"""Helpers for the embedded-engine tests (a uniquely named module: conftest names clash
across test folders)."""

from kvflow_agents.serving.embedded.kv_pool import PagedKVPool


def make_pool(cfg, device_pages=64, host_pages=64, page_size=16, **kw):
    return PagedKVPool(cfg, device_pages=device_pages, host_pages=host_pages,
                       page_size=page_size, **kw)
