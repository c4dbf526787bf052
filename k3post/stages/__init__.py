"""The training stages, one module each: pretrain (stage 0, the base and its content-hash cache), sft_data (the run's
tokenizer and synthesized SFT data) and sft (stage 1), rl (stage 2's signal and `train_rl`), mopd (stage 3). The draft
stage is `k3post.spec.train`. Recipes that string stages together live in `k3post.recipes`.

Import the modules themselves (``from k3post.stages import rl``); this package re-exports nothing, so importing it
pulls in no torch."""
