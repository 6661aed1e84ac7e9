"""An episode's shape: its models, nodes, gateways and times. Four nodes of ``NODE_MEMORY`` hold some of each
model; ``DURATION`` virtual seconds of operations and faults, then ``SETTLE`` healed."""

from __future__ import annotations

import msgspec

from tests.scripted_plugin import CARD

MODELS = {
    "small": msgspec.structs.replace(CARD, name="small", size=512 << 20),
    "large": msgspec.structs.replace(CARD, name="large", size=1536 << 20),
}

NODE_MEMORY = 4 << 30
STORE_TIMEOUT = 2.0

DURATION = 30.0
RATE = 2.0  # operations a second, on average
SETTLE = 45.0
SKEW = 5.0  # each machine's wall clock is off by up to this, either way
GRACE = 8.0  # drain grace: every stream here is shorter (at most 40 tokens, 0.12 s each)
HEARTBEAT, NODE_TTL = 1.0, 3.0  # the settings' defaults
NODES = ("n1", "n2", "n3", "n4")
GATEWAYS = ("g1", "g2")
PROTOCOLS = ("openai", "anthropic", "ollama")
