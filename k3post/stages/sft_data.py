"""The SFT data stage: the run's tokenizer (a byte-level BPE on the families' reference trajectories) and its
training data (the synthesis pipeline over every built-in family and effort, plus the scripted GRM judge
episodes), shared by `k3post demo`, `k3post sft`, the full recipe and stage 0 (whose tokenizer adds its corpus).

Shape legend: none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from k3post.config import K3Config
from k3post.envs.episode import run_episode_sync
from k3post.envs.families import EFFORTS, default_families, get_family, lexicon as family_lexicon
from k3post.data import load_sft_jsonl
from k3post.errors import UserError
from k3post.io import read_jsonl, write_jsonl
from k3post.rewards.judging import recipe_judge_records
from k3post.synth import VerifyConfig, build_sft_dataset, mix
from k3post.synth.corpus import induction_samples
from k3post.tokenizer import lexicon_corpus, load_tokenizer, train_tokenizer
from k3post.xtml import XTML, text_segments

__all__ = ["default_corpus", "run_tokenizer", "sft_samples", "synthesize_sft_data", "tokenizer_texts"]


def default_corpus(n_per_family: int = 6, seed: int = 123, *, n_main: int = 60, main: str = "general.arithmetic") -> list[str]:
    """Tokenizer training text: the XTML text segments (`text_segments`, each encoded on its own) of
    reference trajectories of every built-in family at every effort (`n_main` tasks of `main`,
    `n_per_family` of the others), tools and effort messages included."""
    corpus = []
    for fam in default_families():
        for task in fam.generate(n_main if fam.name == main else n_per_family, seed=seed):
            for effort in EFFORTS:
                ep = run_episode_sync(fam.reference_policy(task, effort), fam.make_env(task), task)
                corpus.extend(text_segments(ep.messages, tools=ep.tools or None, effort=effort))
    return corpus


def run_tokenizer(cfg: K3Config, run: Path) -> Any:
    """The run's tokenizer: `tokenizer.path`, or one already in the run folder, or a byte-level BPE trained on
    XTML renderings of every built-in family's reference trajectories (saved to `run/tokenizer`)."""
    tok_dir = Path(cfg.tokenizer.path) if cfg.tokenizer.path else run / "tokenizer"
    if (tok_dir / "tokenizer.json").exists():
        return load_tokenizer(tok_dir)
    if cfg.tokenizer.path:
        raise UserError(f"tokenizer.path: {tok_dir} holds no tokenizer.json")
    return train_tokenizer(tokenizer_texts(cfg), vocab_size=cfg.tokenizer.vocab_size, out_dir=tok_dir,
                           word_boundaries=cfg.tokenizer.word_boundaries)


def tokenizer_texts(cfg: K3Config) -> list[str]:
    """The BPE's corpus: XTML renderings of every family's reference trajectories (``data.corpus_per_family``
    each), plus the families' lexicon ``tokenizer.lexicon_repeats`` times (stage 0 adds its documents)."""
    corpus = default_corpus(cfg.data.corpus_per_family, seed=cfg.run.seed + 7, main=cfg.data.eval_family)
    if cfg.tokenizer.lexicon_repeats:
        corpus += lexicon_corpus(family_lexicon(), cfg.tokenizer.lexicon_repeats)
    return corpus


def synthesize_sft_data(cfg: K3Config, run: Path, tokenizer: Any, record: Any = None) -> Path:
    """SFT data from the synthesis pipeline: the reference teachers of every default family at every effort
    (`data.n_train` tasks of `data.eval_family`, `data.family_tasks` or `data.n_per_family` of each other family, at
    `data.family_efforts` or `data.efforts`; an opt-in or plugin family when `data.family_tasks` names it), verified stage by
    stage (structure, outcome, quality, judge), plus `data.judge_tasks` reference pairs as scripted GRM judge episodes
    in both orders (`k3post.rewards.judging`); writes `run/data/sft_train.jsonl` and returns its path.
    `record(synth=...)` receives the funnel and per-family counts (and the judge records' counts) for the report.
    """
    d = cfg.data
    main = get_family(d.eval_family)
    verify = VerifyConfig(max_total_tokens=cfg.sft.max_len)  # too-long samples are rejected (and counted) here
    main_path, funnel = build_sft_dataset(
        [main], d.efforts, d.n_train, cfg.run.seed, run / "data" / "main.jsonl", tokenizer, difficulty=d.difficulty, config=verify
    )
    groups: dict[tuple[int, tuple[str, ...], bool], list[Any]] = {}  # the other families, by tasks, efforts and dealing
    defaults = default_families()
    default_names = {f.name for f in defaults}
    named = [get_family(n) for n in d.family_tasks if n not in default_names]  # opt-in and plugin
    for f in defaults + named:  # families are used where data.family_tasks names them
        if f.name != main.name and d.tasks_of(f.name) > 0 and d.efforts_of(f.name):
            groups.setdefault((d.tasks_of(f.name), tuple(d.efforts_of(f.name)), f.name in d.deal_efforts), []).append(f)
    rest_paths = []
    for (n, efforts, deal), fams in sorted(groups.items()):
        name = ("families" + ("" if n == d.n_per_family else f".n{n}") + ("" if list(efforts) == list(d.efforts) else "." + "-".join(efforts))
                + (".dealt" if deal else ""))
        path, rest_funnel = build_sft_dataset(fams, list(efforts), n, cfg.run.seed, run / "data" / f"{name}.jsonl", tokenizer,
                                              difficulty=d.difficulty, config=verify, deal=deal)
        funnel.merge(rest_funnel)
        rest_paths.append(path)
    main_records = read_jsonl(main_path)
    if d.effort_mix:  # same number of samples, reweighted by effort (a scarce effort is repeated)
        main_records = mix(main_records, d.effort_mix, len(main_records), seed=cfg.run.seed)
    records = main_records + [r for p in rest_paths for r in read_jsonl(p)]
    judge: dict[str, Any] = {}
    if d.judge_tasks:  # scripted GRM judge episodes on reference pairs (family "grm"), both orders (issue 31)
        judge_records, judge = recipe_judge_records(cfg, XTML(tokenizer))
        write_jsonl(run / "data" / "judge.jsonl", judge_records)
        records += judge_records
    train_file = write_jsonl(run / "data" / "sft_train.jsonl", records)
    by_family: dict[str, int] = {}
    for r in records:
        by_family[r["family"]] = by_family.get(r["family"], 0) + 1
    if record is not None:
        record(synth={"funnel": funnel.to_dict(), "samples_by_family": by_family, **({"judge": judge} if judge else {})})
    print(funnel.table())
    return train_file


REPLAY_SEED_OFFSET = 4100
"""The replayed induction rows are drawn with ``run.seed`` + this (stage 0 drew its own with ``run.seed``)."""


def sft_samples(cfg: Any, train_file: str | Path, tokenizer: Any) -> tuple[list[Any], Any]:
    """The SFT samples of ``train_file`` (`k3post.data.load_sft_jsonl` under ``cfg.sft``) and its load stats, plus
    ``cfg.sft.replay_induction`` induction rows of ``cfg.pretrain.seq_len`` tokens (`k3post.synth.corpus.induction_samples`,
    seed ``run.seed`` + `REPLAY_SEED_OFFSET`, every token a target): SFT at the recipe's rate erases most of the base's
    copying (docs/decisions.md, issue 31 §sftcopy); rehearsing the rows that taught it is the lever this offers."""
    s = cfg.sft
    samples, stats = load_sft_jsonl(train_file, XTML(tokenizer), max_len=s.max_len, on_bad_sample=s.on_bad_sample, mode=s.mode)
    if s.replay_induction:
        samples = samples + induction_samples(tokenizer, s.replay_induction, cfg.pretrain.seq_len, cfg.run.seed + REPLAY_SEED_OFFSET)
    return samples, stats
