"""The general-domain families: ``general.arithmetic``, ``general.faithfulness``, ``general.writing`` (family.py).

The registry (`k3post.envs.families.registry.BUILTIN_MODULES`) imports ``family.py``, which registers them."""
