"""Deployment-aware post-training, part 2 (SPEC §6.2): speculative decoding with an EAGLE-3 draft.

- `k3post.spec.losses`: the draft's training losses at temperature 1 (LK_α, the adaptive LK_λ hybrid, forward
  KL), with a reduced draft vocabulary.
- `k3post.spec.block`: the one decoder block (EAGLE-3's `midlayer`) the MTP head and the draft share.
- `k3post.spec.mtp`: the MTP head SFT can train as an auxiliary next-next-token loss.
- `k3post.spec.eagle3`: the EAGLE-3 draft (fusion of three target layers, one block, a head), its training-time
  unrolled forward, the layer-id conventions of k3post, vLLM and SGLang.
- `k3post.spec.drafter`: `Eagle3Drafter`, the draft as the embedded engine's speculative-decoding drafter.
- `k3post.spec.export`: the draft folder vLLM and SGLang load, and its reader.
- `k3post.rollout.speculative`: chain drafting and rejection sampling in the embedded engine.
"""
