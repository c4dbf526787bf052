"""The agentic-engineering (AET) families: the environment, state and verifier they share (core.py) and
``coding.aet_cli``, ``agents.aet_datadir``, ``agents.aet_config`` (family.py).

The registry (`k3post.envs.families.registry.BUILTIN_MODULES`) imports ``family.py``, which registers them."""
