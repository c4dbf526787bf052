"""k3post: the Kimi K3 post-training pipeline, runnable.

Layout (a reader finds each part by its file name):
    xtml.py        XTML chat template: render / parse / stream / validate
    tokenizer.py   byte-level BPE with the XTML special tokens
    models.py      load HF causal LMs; build the tiny Qwen3-MoE
    config/        typed configs (one small module per component), YAML + dotted overrides
    sft.py         Stage 1 SFT trainer
    quant/mx.py    MXFP4 / MXFP8 quantizer (pure tensor functions)
    envs/          environments, harness, sandbox, task families
    demo.py        `k3post demo`: the whole pipeline on a tiny MoE
"""

__version__ = "0.1.0"
