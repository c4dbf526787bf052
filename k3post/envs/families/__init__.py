"""Built-in task families for the three domains (general, agents, coding). See registry.py."""

from k3post.constants import EFFORTS
from k3post.envs.families.registry import (
    TaskFamily,
    default_families,
    families,
    get_family,
    lexicon,
    register_family,
)

__all__ = ["EFFORTS", "TaskFamily", "default_families", "families", "get_family", "lexicon", "register_family"]
