"""The ``general.visual`` family (family.py) and its image measurements (image.py).

The registry (`k3post.envs.families.registry.BUILTIN_MODULES`) imports ``family.py``, which registers them."""
