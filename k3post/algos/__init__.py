"""RL math as pure tensor functions (SPEC §3.1, §4): tensors in, ``(loss or reward, metrics)`` out.

    policy_loss.py  policy_loss: the K2.5 loss; PPO/GRPO, DAPO, Dr.GRPO, CISPO, GSPO, TIS, MIS as parameters
    advantages.py   group_advantages, group_advantages_from_groups (zero-variance groups counted and
                    skipped), expand_to_tokens
    opd.py          opd_reward: the clipped per-token teacher − student reward of MOPD

Shape legend: none here (see each module).
"""

from k3post.algos.advantages import GroupAdvantages, expand_to_tokens, group_advantages, group_advantages_from_groups
from k3post.algos.opd import opd_reward
from k3post.algos.policy_loss import policy_loss

__all__ = [
    "GroupAdvantages",
    "expand_to_tokens",
    "group_advantages",
    "group_advantages_from_groups",
    "opd_reward",
    "policy_loss",
]
