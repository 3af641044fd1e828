"""Gives NIXL's progress thread a poll timeout in every process of a vLLM instance.

NIXL's Python agent (``nixl_agent``, which vLLM's ``NixlConnector`` creates in each
worker) sets ``pthrDelay`` to 0: its UCX progress thread then polls its file
descriptors with a zero timeout and spins a whole core even while the instance is
idle. On a machine of 2 cores running three instances, those three threads take
most of the CPU from vLLM itself. With ``KV_REAL_VLLM_NIXL_POLL_DELAY_US`` set (the
tier puts this directory on ``PYTHONPATH`` with it), every NIXL agent this process
creates is made with that delay instead: the thread still wakes at once on UCX's
event fd, and otherwise every delay (rounded up to whole ms).

Cost: importing ``nixl._api`` (about 0.4 s) in each process of the instance; idle CPU
of the progress thread falls from a whole core to about 2 % at 1,000 us.
"""

import os

_DELAY_US = os.environ.get("KV_REAL_VLLM_NIXL_POLL_DELAY_US")

if _DELAY_US:
    # vLLM sets this before its own first import of nixl; ours comes first.
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    import nixl._api as _api

    _make_agent = _api.nixlBind.nixlAgent

    def _agent_with_delay(name, config):
        config.pthrDelay = int(_DELAY_US)
        return _make_agent(name, config)

    _api.nixlBind.nixlAgent = _agent_with_delay
