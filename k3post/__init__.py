"""k3post: the Kimi K3 post-training pipeline, runnable.

Layout (a reader finds each part by its file name):
    xtml/          XTML chat template: render / parse / stream / validate
    tokenizer.py   byte-level BPE with the XTML special tokens
    models.py      load HF causal LMs; build the tiny Qwen3-MoE
    config/        typed configs (one small module per component), YAML + dotted overrides
    stages/        the training stages: pretrain, sft_data, sft, rl, mopd
    quant/mx.py    MXFP4 / MXFP8 quantizer (pure tensor functions)
    envs/          environments, harness, sandbox, task families
    recipes/       demo (`k3post demo`: the whole pipeline on a tiny MoE), experts, evaluate, report, commands
"""

__version__ = "0.1.0"
