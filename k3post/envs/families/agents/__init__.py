"""The agent families ``agents.search`` and ``agents.assistant`` (family.py) and the mock mail / calendar / docs apps
the assistant works in (apps.py).

The registry (`k3post.envs.families.registry.BUILTIN_MODULES`) imports ``family.py``, which registers them."""
