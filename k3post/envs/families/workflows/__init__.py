"""The professional-workflow families ``agents.data_report`` and ``agents.contracts`` (family.py).

The registry (`k3post.envs.families.registry.BUILTIN_MODULES`) imports ``family.py``, which registers them."""
