"""The ``coding.webdev`` family (family.py), its page specs and checks (specs.py) and the headless browser that runs
them (browser.py).

The registry (`k3post.envs.families.registry.BUILTIN_MODULES`) imports ``family.py``, which registers them."""
