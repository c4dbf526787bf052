"""The trainer: model, optimizer, device and dtype behind one seam that knows no algorithm.

    local.py   `Trainer` (one process), `build_trainer` (what a stage calls), `Grads` (what a stage's gradient
               function is), `build_optimizer`, `resolve_device`
    fsdp.py    `FSDPTrainer`: the same interface over N ranks with PyTorch FSDP2
    ranks.py   a stage command on N trainer ranks, rank 0 driving the others (`on_ranks`)

Shape legend: none.
"""

from k3post.trainer.local import OPTIMIZERS, Grads, OptimConfig, Trainer, build_optimizer, build_trainer, resolve_device

__all__ = ["OPTIMIZERS", "Grads", "OptimConfig", "Trainer", "build_optimizer", "build_trainer", "resolve_device"]
