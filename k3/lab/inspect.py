"""`k3 lab inspect`: pictures of what a trained K3 learned.

From a checkpoint (`k3 lab inspect --checkpoint DIR`, a directory written by `k3 train --out DIR`), or,
without one, from kimi-k3-tiny trained here for a fixed number of steps on the default corpus (seed 0,
kept in runs/lab-inspect and reused while its settings match):

- AttnRes depth weights: for every AttnRes mix (before each layer's attention and FFN, and the final
  one), the softmax weights over its sources [embedding, block sums, the current block's partial sum],
  averaged over the tokens of validation text; and how far from uniform they are per token.
- Expert load per MoE layer: the share of routed assignments each expert gets on validation text, with
  the aux-loss-free correction bias (as the model routes) and without it (top-k on the bare scores), the
  max/mean imbalance of each, and the bias itself.
- KDA decay per channel and head: the log decay g of the forget gate, as a half-life ln 2 / -g in tokens,
  per (head, key channel) averaged in log space over validation tokens, and its distribution.
- MLA attention over a sample prompt (a word sequence said twice): the softmax probabilities of every
  MLA head, and how much of it goes back to the earlier copy (retrieval from the context).

Everything is read with forward hooks on the unmodified model, each calling the layer's own analysis
method on the inputs it was given (`BlockAttnRes.weights`, `Router.scores` / `Router.choose`,
`KimiDeltaAttention.forget_gate`, `MultiHeadLatentAttention.attention_probs`): the same code the layers'
forward passes run, so the pictures show what the model computes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
from pathlib import Path

import torch

from ..layers import BlockAttnRes, KimiDeltaAttention, MoE, MultiHeadLatentAttention
from ..models import CausalLM
from . import plots, report
from .parts import torch_threads
from .report import Claim, Figure, Result, Table

# training runs by mode (kimi-k3-tiny on the default Shakespeare corpus, seed 0); smoke trains on a
# generated corpus in a temporary folder instead
TRAINING = {
    "quick": dict(max_steps=200, batch_size=8, seq_len=256, warmup_steps=20, eval_every=200, eval_tokens=8192,
                  final_eval_tokens=32768, out="runs/lab-inspect"),
    "full": dict(max_steps=1000, batch_size=16, seq_len=256, warmup_steps=50, eval_every=250, eval_tokens=16384,
                 final_eval_tokens=262144, out="runs/lab-inspect-full"),
}
SAMPLE_TOKENS = {"smoke": 256, "quick": 4096, "full": 16384}  # validation tokens the statistics average over
HALF_LIFE_CAP = 1e6  # tokens; a log decay that rounds to 0 in float32 forgets nothing: shown at the cap
# words in an order no text has, said twice: attention from the second copy back to the first is retrieval
PROMPT_WORDS = " sweet night the crown hath pale fire and my gentle lord upon a rose"
# verdict thresholds, stated in the notes
ATTN_RES_SELECTIVE = 0.8  # mean per-token entropy / log N at or below this: a mix is selective
BALANCED = 1.5  # expert load max/mean at or below this: balanced
CHANNEL_SPREAD = (2.0, 1.25)  # within-head p90/p10 of channel half-lives: holds / partly
RETRIEVAL = 0.3  # best head's mean attention on the earlier copy: holds; partly at 3x uniform


# -- the checkpoint ----------------------------------------------------------------------------------
def training_config(mode: str, root: Path | None = None):
    """The TrainConfig this experiment trains with in `mode` ("smoke": a generated corpus under `root`)."""
    from ..training.loop import TrainConfig

    if mode == "smoke":
        if root is None:
            raise ValueError("training_config: smoke mode needs a `root` folder for its corpus and checkpoint")
        return TrainConfig(preset="kimi-k3-tiny", model_overrides={"hidden_size": 32}, data=str(write_corpus(root)),
                           tokenizer="byte", seq_len=32, batch_size=2, max_steps=4, warmup_steps=2, eval_every=4,
                           eval_tokens=256, final_eval_tokens=512, out=str(root / "checkpoint"), val_fraction=0.2,
                           seed=0)
    return TrainConfig(preset="kimi-k3-tiny", seed=0, **TRAINING[mode])


def write_corpus(root: Path, docs: int = 4, words: int = 600) -> Path:
    """A small corpus of seeded word sequences (no download): `docs` files under root/corpus."""
    vocab = ("to be or not that is the question whether tis nobler in the mind to suffer the slings and "
             "arrows of outrageous fortune").split()
    folder = Path(root) / "corpus"
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    for d in range(docs):
        ids = torch.randint(0, len(vocab), (words,), generator=gen).tolist()
        (folder / f"doc{d}.txt").write_text(" ".join(vocab[i] for i in ids) + "\n")
    return folder


def finished(out: Path, cfg) -> bool:
    """Whether `out` holds the final checkpoint of a run with exactly the settings `cfg`."""
    try:
        saved = json.loads((Path(out) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    same = saved.get("train") == json.loads(json.dumps(dataclasses.asdict(cfg)))
    return same and saved.get("step") == cfg.max_steps and (Path(out) / "model.safetensors").exists()


def trained_checkpoint(mode: str, root: Path | None = None) -> tuple[Path, bool]:
    """(checkpoint folder, whether it was trained now): the mode's run, trained unless already finished."""
    from ..training.loop import train

    cfg = training_config(mode, root)
    out = Path(cfg.out)
    if finished(out, cfg):
        return out, False
    train(cfg, progress=False)
    return out, True


def load(checkpoint: Path):
    """(model in eval mode, tokenizer, train config or None) from a k3 checkpoint folder."""
    from ..training.loop import TrainConfig
    from ..tokenizer import Tokenizer

    checkpoint = Path(checkpoint)
    if not (checkpoint / "config.json").exists():
        raise FileNotFoundError(f"--checkpoint {checkpoint}: no config.json there (a folder from `k3 train --out`)")
    if not (checkpoint / "tokenizer.json").exists():
        raise FileNotFoundError(f"--checkpoint {checkpoint}: no tokenizer.json there; k3 lab inspect needs a "
                                f"checkpoint written by `k3 train`")
    model = CausalLM.from_pretrained(checkpoint).eval()
    tokenizer = Tokenizer.load(checkpoint)
    saved = json.loads((checkpoint / "config.json").read_text())
    cfg = TrainConfig(**saved["train"]) if isinstance(saved.get("train"), dict) else None
    return model, tokenizer, cfg


def validation_windows(tokenizer, cfg, tokens: int, notes: list[str]) -> torch.Tensor:
    """[n, seq_len + 1] windows of the run's validation documents (its corpus, split and seed), evenly
    spread, about `tokens` tokens in all; a fixed text when the run's corpus cannot be read."""
    from ..training.data import CorpusError, load_corpus, split_documents
    from ..training.loop import TokenData

    seq_len = cfg.seq_len if cfg is not None else 256
    texts = None
    if cfg is not None:
        try:
            _, val = split_documents(load_corpus(cfg.data), cfg.val_fraction, cfg.seed)
            texts = [d.text for d in val]
        except (CorpusError, OSError) as e:
            notes.append(f"the run's corpus could not be read ({e}); statistics are over a fixed sample text")
    if texts is None:
        texts = [(PROMPT_WORDS.strip() + ". ") * 200]
    data = TokenData(tokenizer, [], texts)
    seq_len = min(seq_len, data.val.numel() - 1)
    return data.val_windows(seq_len, tokens)


def prompt_ids(tokenizer) -> tuple[list[int], int]:
    """The sample prompt: PROMPT_WORDS tokenized once and said twice; returns (ids, period)."""
    ids = tokenizer.encode(PROMPT_WORDS)
    return ids + ids, len(ids)


# -- hooks: what each part computes ------------------------------------------------------------------
def router_loads(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Assignments per expert (with the correction bias, as the model routes; without it) for x [..., d]."""
    router = moe.router
    scores = router.scores(x.reshape(-1, x.shape[-1]))
    E = scores.shape[-1]
    return (torch.bincount(router.choose(scores).flatten(), minlength=E),
            torch.bincount(router.choose(scores, balanced=False).flatten(), minlength=E))


def half_life(g: torch.Tensor) -> torch.Tensor:
    """Tokens until a decay of exp(g) per token halves the state: ln 2 / -g, capped at HALF_LIFE_CAP."""
    return (math.log(2) / (-g.double()).clamp_min(math.log(2) / HALF_LIFE_CAP)).clamp(max=HALF_LIFE_CAP)


class Recorder:
    """Forward hooks on every AttnRes mix, MoE, KDA and MLA layer of a model, accumulating statistics."""

    def __init__(self, model: CausalLM, keep_attention: bool = False):
        self.model, self.keep_attention = model, keep_attention
        self.names = {m: n for n, m in model.named_modules()}
        self.attn_res: dict[str, dict] = {}  # mix -> {"weights": sum over tokens [N], "entropy": sum, "tokens"}
        self.moe: dict[str, dict] = {}  # layer -> {"with": load [E], "without": load [E]}
        self.kda: dict[str, dict] = {}  # layer -> {"g_sum": [H, K], "tokens": n, "g": [list of samples]}
        self.mla: dict[str, torch.Tensor] = {}  # layer -> probs [H, T, T] of the last batch's first sequence
        self._handles = []

    def __enter__(self):
        for module in self.model.modules():
            if isinstance(module, BlockAttnRes):
                self._handles.append(module.register_forward_hook(self._on_attn_res))
            elif isinstance(module, MoE):
                self._handles.append(module.register_forward_hook(self._on_moe))
            elif isinstance(module, KimiDeltaAttention):
                self._handles.append(module.register_forward_pre_hook(self._on_kda))
            elif isinstance(module, MultiHeadLatentAttention) and self.keep_attention:
                self._handles.append(module.register_forward_hook(self._on_mla))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False

    def _on_attn_res(self, module, inputs, output):
        sources = inputs[0]
        alpha = module.weights(sources)  # [N, B, T]
        n = len(sources)
        entropy = -(alpha * alpha.clamp_min(1e-30).log()).sum(0) / math.log(n) if n > 1 else torch.zeros_like(alpha[0])
        rec = self.attn_res.setdefault(self._mix_name(module), {"weights": 0.0, "entropy": 0.0, "tokens": 0})
        rec["weights"] = rec["weights"] + alpha.flatten(1).sum(1)
        rec["entropy"] += entropy.sum().item()
        rec["tokens"] += alpha[0].numel()

    def _mix_name(self, module) -> str:
        name = self.names[module]  # model.layers.3.attn_res, model.layers.3.mlp_res, model.final_res
        if name.endswith("final_res"):
            return "final"
        layer = name.split(".")[2]
        return f"L{layer} {'attn' if name.endswith('attn_res') else 'ffn'}"

    def _on_moe(self, module, inputs, output):
        with_bias, without = router_loads(module, inputs[0])
        rec = self.moe.setdefault(self._layer_name(module), {"with": 0, "without": 0})
        rec["with"] = rec["with"] + with_bias
        rec["without"] = rec["without"] + without

    def _layer_name(self, module) -> str:
        return "L" + self.names[module].split(".")[2]

    def _on_kda(self, module, inputs):
        g = module.forget_gate(inputs[0])  # [B, T, H, K], log decay per token and key channel
        rec = self.kda.setdefault(self._layer_name(module), {"g_sum": 0.0, "tokens": 0, "samples": []})
        rec["g_sum"] = rec["g_sum"] + g.double().sum((0, 1))
        rec["tokens"] += g.shape[0] * g.shape[1]
        rec["samples"].append(g.flatten()[:: max(1, g.numel() // 20000)])

    def _on_mla(self, module, inputs, output):
        self.mla[self._layer_name(module)] = module.attention_probs(inputs[0])[0].float()


@torch.no_grad()
def record(model: CausalLM, windows: torch.Tensor, batch_size: int = 8) -> Recorder:
    """Statistics of AttnRes, MoE and KDA over validation windows [n, T + 1] (inputs: the first T)."""
    with Recorder(model) as rec:
        for i in range(0, windows.shape[0], batch_size):
            model(windows[i:i + batch_size, :-1])
    return rec


@torch.no_grad()
def record_attention(model: CausalLM, ids: list[int]) -> Recorder:
    with Recorder(model, keep_attention=True) as rec:
        model(torch.tensor([ids]))
    return rec


# -- summaries -----------------------------------------------------------------------------------------
def imbalance(load: torch.Tensor) -> float:
    """max / mean of the assignments per expert (1 = perfectly even)."""
    load = load.double()
    return (load.max() / load.mean()).item() if load.sum() > 0 else float("nan")


def channel_half_lives(rec: dict) -> torch.Tensor:
    """Half-life [H, K] of each (head, key channel), from its log decay averaged over tokens."""
    return half_life(rec["g_sum"] / rec["tokens"])


def within_head_spread(hl: torch.Tensor) -> torch.Tensor:
    """Per head: 90th / 10th percentile of its channels' half-lives (1 = every channel forgets alike)."""
    q = torch.quantile(hl.double().log(), torch.tensor([0.1, 0.9], dtype=torch.float64), dim=-1)
    return (q[1] - q[0]).exp()


def retrieval_scores(probs: torch.Tensor, period: int) -> dict[str, torch.Tensor]:
    """Per head [H], averaged over the queries of the second copy (positions i >= period + 1) of a
    prompt said twice: "copy" = attention on the same token in the first copy (i - period), "induction"
    = on the token after it (i - period + 1), "previous" = on i - 1, and "uniform" = what a uniform
    causal attention would give one position (the mean of 1 / (i + 1))."""
    T = probs.shape[-1]
    rows = torch.arange(period + 1, T)
    if len(rows) == 0:
        raise ValueError(f"retrieval_scores: a prompt of {T} tokens has no second copy for period {period}")
    return {"copy": probs[:, rows, rows - period].mean(-1), "induction": probs[:, rows, rows - period + 1].mean(-1),
            "previous": probs[:, rows, rows - 1].mean(-1),
            "uniform": torch.full((probs.shape[0],), (1.0 / (rows + 1).double()).mean().item())}


def attn_res_verdict(entropies: list[float]) -> str:
    """Selective depth retrieval: holds when the median mix's normalised entropy is <= ATTN_RES_SELECTIVE,
    partly when at least one mix's is; does not hold when every mix stays near uniform."""
    if not entropies:
        return "not measurable here"
    median = sorted(entropies)[len(entropies) // 2]
    return "holds" if median <= ATTN_RES_SELECTIVE else "partly" if min(entropies) <= ATTN_RES_SELECTIVE \
        else "does not hold"


def balance_verdict(with_bias: list[float], without: list[float]) -> str:
    """Mean max/mean load over the MoE layers: holds when it is <= BALANCED with the bias and no higher
    than without it; partly when only one of the two is true."""
    if not with_bias:
        return "not measurable here"
    w, wo = sum(with_bias) / len(with_bias), sum(without) / len(without)
    ok = (w <= BALANCED) + (w <= wo)
    return {2: "holds", 1: "partly", 0: "does not hold"}[ok]


def channel_verdict(spreads: list[float]) -> str:
    """Per-channel forgetting, from the within-head spreads of the heads that forget (none: does not hold)."""
    if not spreads:
        return "does not hold"
    median = sorted(spreads)[len(spreads) // 2]
    return "holds" if median >= CHANNEL_SPREAD[0] else "partly" if median >= CHANNEL_SPREAD[1] else "does not hold"


def retrieval_verdict(best: float, uniform: float) -> str:
    return "holds" if best >= RETRIEVAL else "partly" if best >= 3 * uniform else "does not hold"


# -- the experiment ----------------------------------------------------------------------------------
def run(mode: str, docs: Path, checkpoint: str | None = None, **options) -> Result:
    if options:
        raise ValueError(f"k3 lab inspect takes only `checkpoint`, got {sorted(options)}")
    if mode not in SAMPLE_TOKENS:
        raise ValueError(f"k3 lab inspect: `mode` must be one of {tuple(SAMPLE_TOKENS)}, got {mode!r}")
    docs = Path(docs)
    if checkpoint is not None:
        return _inspect(mode, docs, Path(checkpoint), trained_now=False, given=True)
    if mode == "smoke":  # a few steps of a random tiny model on a generated corpus, in a temporary folder,
        # on one thread (a test on a busy machine: a two-thread pool waits for cores it is not given)
        with tempfile.TemporaryDirectory(prefix="k3-lab-inspect-") as tmp, torch_threads(1):
            path, _ = trained_checkpoint(mode, Path(tmp))
            return _inspect(mode, docs, path, trained_now=True, given=False)
    path, now = trained_checkpoint(mode)
    return _inspect(mode, docs, path, trained_now=now, given=False)


def _inspect(mode: str, docs: Path, checkpoint: Path, trained_now: bool, given: bool) -> Result:
    notes: list[str] = []
    model, tokenizer, cfg = load(checkpoint)
    config = model.config
    windows = validation_windows(tokenizer, cfg, SAMPLE_TOKENS[mode], notes)
    trained = record(model, windows)
    torch.manual_seed(cfg.seed if cfg is not None else 0)
    initial = record(CausalLM(config).eval(), windows)  # the same architecture at initialisation
    ids, period = prompt_ids(tokenizer)
    attention = record_attention(model, ids)

    claims, tables, figures = [], [], []
    for part in (_attn_res_part, _moe_part, _kda_part):
        c, t, f, n = part(docs, trained, initial)
        claims += c
        tables += t
        figures += f
        notes += n
    c, t, f, n = _mla_part(docs, attention, tokenizer, ids, period)
    claims, tables, figures, notes = claims + c, tables + t, figures + f, notes + n

    history = _history(checkpoint)
    origin = (f"checkpoint {checkpoint}" if given else
              f"trained {'now' if trained_now else 'earlier (reused: same settings)'} in {checkpoint}"
              if mode != "smoke" else "a random tiny model trained for a few steps on a generated corpus")
    notes.insert(0, f"Model: {origin}; {config.name}, {config.num_layers} layers ({_layers(config)}), d "
                    f"{config.hidden_size}" + (f"; {history['steps']} steps, validation "
                                               f"{history['val_bpb']:.3f} bits per byte" if history else ""))
    notes.append(f"Statistics over {windows.shape[0]} validation windows of {windows.shape[1] - 1} tokens; the "
                 f"'init' figures come from the same architecture initialised with the run's seed "
                 f"({cfg.seed if cfg is not None else 0}; for a k3 training run, the very weights it started "
                 "from), on the same text")
    setup = dict(checkpoint=str(checkpoint), given=given, seed=cfg.seed if cfg is not None else None,
                 train=None if cfg is None else {k: getattr(cfg, k) for k in (
                     "preset", "model_overrides", "data", "tokenizer", "seq_len", "batch_size", "max_steps", "lr")},
                 sample_windows=list(windows.shape), prompt=PROMPT_WORDS, thresholds=dict(
                     attn_res_entropy=ATTN_RES_SELECTIVE, balanced_max_over_mean=BALANCED,
                     channel_spread=CHANNEL_SPREAD, retrieval=RETRIEVAL), **(history or {}))
    return Result(name="inspect", title="What a trained K3 learned", mode=mode,
                  command=report.command("inspect", mode) + (f" --checkpoint {checkpoint}" if given else ""),
                  claims=claims, tables=tables, figures=figures,
                  notes=notes, setup=setup)


def _history(checkpoint: Path) -> dict | None:
    try:
        state = torch.load(checkpoint / "trainer_state.pt", weights_only=True)
    except (OSError, RuntimeError):
        return None
    h = state.get("history", {})
    if "final_val_bpb" not in h:
        return None
    return {"steps": state["step"], "val_bpb": h["final_val_bpb"], "train_seconds": round(h.get("seconds", 0.0), 1)}


def _layers(config) -> str:
    counts: dict[str, int] = {}
    for kind in config.layer_types:
        counts[kind] = counts.get(kind, 0) + 1
    return " + ".join(f"{n} {k}" for k, n in counts.items())


def _attn_res_part(docs: Path, trained: Recorder, initial: Recorder):
    claim = ("AttnRes: each layer gives \"more importance to whichever layers are most useful in context\" "
             "instead of weighting all earlier outputs equally")
    if not trained.attn_res:
        return [Claim(claim, "the model has no AttnRes", "not measurable here")], [], [], []
    mixes = list(trained.attn_res)
    weights = {m: (r["weights"] / r["tokens"]).tolist() for m, r in trained.attn_res.items()}
    entropy = {m: r["entropy"] / r["tokens"] for m, r in trained.attn_res.items()}
    width = max(len(w) for w in weights.values())
    rows = []
    grid = torch.full((len(mixes), width), float("nan"))
    for i, m in enumerate(mixes):
        w = weights[m]
        cols = [0] if len(w) == 1 else list(range(len(w) - 1)) + [width - 1]  # the partial sum goes last
        for col, value in zip(cols, w):
            grid[i, col] = value
        rows.append([m, len(w), f"{w[0]:.2f}", f"{w[-1]:.2f}" if len(w) > 1 else "-",
                     f"{entropy[m]:.2f}" if len(w) > 1 else "-"])
    multi = [entropy[m] for m in mixes if len(weights[m]) > 1]
    labels = ["embedding"] + [f"block {b}" for b in range(1, width - 1)] + ["partial sum"]
    path = docs / "figures" / "inspect_attnres.png"
    with plots.figure(path, size=(1.2 * width + 3.5, 0.32 * len(mixes) + 1.8)) as (fig, ax):
        im = ax.imshow(grid.numpy(), cmap="viridis", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(width), labels, rotation=30, ha="right")
        ax.set_yticks(range(len(mixes)), mixes)
        for i in range(len(mixes)):
            for j in range(width):
                if not math.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7,
                            color="white" if grid[i, j] < 0.5 else "black")
        ax.set_title("AttnRes weight per source, mean over tokens")
        fig.colorbar(im, ax=ax)
    init_multi = [r["entropy"] / r["tokens"] for r in initial.attn_res.values() if len(r["weights"]) > 1]
    median = sorted(multi)[len(multi) // 2] if multi else float("nan")
    measured = (f"per-token weight entropy / log N: median {median:.2f} over {len(multi)} mixes (lowest "
                f"{min(multi):.2f}, highest {max(multi):.2f}); at initialisation "
                f"{sum(init_multi) / max(1, len(init_multi)):.2f} (uniform)") if multi else "no mix has two sources"
    table = Table("AttnRes mixes: sources, mean weight of the embedding and of the current block's partial sum, "
                  "per-token entropy / log N (1 = uniform)", ["mix", "sources", "embedding", "partial sum",
                                                              "entropy / log N"], rows)
    note = (f"AttnRes verdict: holds when the median mix's per-token weight entropy / log N is <= "
            f"{ATTN_RES_SELECTIVE} (each token leans on some sources), partly when at least one mix's is; "
            "at initialisation the queries are zero and every mix is exactly uniform (1.00)")
    return ([Claim(claim, measured, attn_res_verdict(multi))], [table],
            [Figure("figures/inspect_attnres.png", "AttnRes depth weights: one row per mix (before attention, "
                                                    "before the FFN, final), one column per source")], [note])


def _moe_part(docs: Path, trained: Recorder, initial: Recorder):
    claim = ("aux-loss-free balancing: the per-expert correction bias steers top-k selection so that experts "
             "get even load, without entering the weights")
    if not trained.moe:
        return [Claim(claim, "the model has no MoE layers", "not measurable here")], [], [], []
    layers = list(trained.moe)
    rows, with_bias, without = [], [], []
    biases = {}
    for name in layers:
        rec = trained.moe[name]
        moe = _module(trained.model, name, "block_sparse_moe")
        biases[name] = moe.router.e_score_correction_bias.detach().clone()
        w, wo, init = imbalance(rec["with"]), imbalance(rec["without"]), imbalance(initial.moe[name]["with"])
        with_bias.append(w)
        without.append(wo)
        b = biases[name]
        rows.append([name, f"{init:.2f}", f"{wo:.2f}", f"{w:.2f}", f"{b.min().item():+.3f}..{b.max().item():+.3f}",
                     f"{int((rec['with'] == 0).sum())} / {len(rec['with'])}"])
    path = docs / "figures" / "inspect_moe.png"
    with plots.figure(path, ncols=2, nrows=len(layers), size=(10.0, 2.4 * len(layers) + 0.6)) as (fig, axes):
        for i, name in enumerate(layers):
            rec, E = trained.moe[name], len(trained.moe[name]["with"])
            ax = axes[2 * i]
            share = lambda load: (load.double() / load.sum()).numpy()  # noqa: E731
            ax.bar(range(E), share(rec["with"]), color="tab:blue", label="with the bias (as routed)")
            ax.plot(range(E), share(rec["without"]), "o", color="tab:red", ms=4, label="without the bias")
            ax.axhline(1 / E, ls="--", color="gray", lw=0.8)
            ax.set_ylabel(f"{name} load share")
            ax.set_title(f"{name}: max/mean {imbalance(rec['with']):.2f} with, {imbalance(rec['without']):.2f} "
                         f"without the bias", fontsize=9)
            if i == 0:
                ax.legend(fontsize=7)
            ax = axes[2 * i + 1]
            ax.bar(range(E), biases[name].numpy(), color="tab:green")
            ax.axhline(0, color="black", lw=0.8)
            ax.set_ylabel("correction bias")
            if i == len(layers) - 1:
                axes[2 * i].set_xlabel("expert")
                ax.set_xlabel("expert")
    mean_w, mean_wo = sum(with_bias) / len(with_bias), sum(without) / len(without)
    measured = (f"expert load max/mean, mean over {len(layers)} MoE layers: {mean_w:.2f} with the bias, "
                f"{mean_wo:.2f} without it (same router), "
                f"{sum(imbalance(initial.moe[n]['with']) for n in layers) / len(layers):.2f} at initialisation")
    table = Table("Expert load per MoE layer on validation text: max/mean assignments (1 = even), the bias range, "
                  "idle experts", ["layer", "init", "trained, without bias", "trained, with bias", "bias range",
                                   "experts with no tokens"], rows)
    note = (f"Balance verdict: holds when the layers' mean max/mean load with the bias is <= {BALANCED} and no "
            "higher than without it, partly when only one of the two is true. 'Without the bias' re-routes the "
            "same tokens by the bare scores of the trained router, a router that learned with the bias in place")
    return ([Claim(claim, measured, balance_verdict(with_bias, without))], [table],
            [Figure("figures/inspect_moe.png", "Expert load per MoE layer with and without the aux-loss-free "
                                                "bias (left; dashed: even load) and the bias per expert (right)")],
            [note])


def _module(model: CausalLM, layer: str, attr: str):
    return getattr(model.model.layers[int(layer[1:])], attr)


def _kda_part(docs: Path, trained: Recorder, initial: Recorder):
    claim = "KDA forgets per channel: each key channel of each head has its own decay rate (fine-grained forgetting)"
    if not trained.kda:
        return [Claim(claim, "the model has no KDA layers", "not measurable here")], [], [], []
    layers = list(trained.kda)
    H, K = trained.kda[layers[0]]["g_sum"].shape
    rows, spreads, init_spreads, forgetting, init_forgetting, finite = [], [], [], 0, 0, []
    for name in layers:
        hl, init_hl = channel_half_lives(trained.kda[name]), channel_half_lives(initial.kda[name])
        heads, init_heads = forgets(hl), forgets(init_hl)
        spread, init_spread = within_head_spread(hl)[heads], within_head_spread(init_hl)[init_heads]
        spreads += spread.tolist()
        init_spreads += init_spread.tolist()
        forgetting += int(heads.sum())
        init_forgetting += int(init_heads.sum())
        finite += hl[hl < HALF_LIFE_CAP].tolist()
        tokens = half_life(torch.cat(trained.kda[name]["samples"]))
        p = torch.quantile(tokens, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
        below = hl[hl < HALF_LIFE_CAP]
        rows.append([name, f"{int(heads.sum())} / {H} ({int(init_heads.sum())})",
                     f"{int((hl < HALF_LIFE_CAP).sum())} / {H * K}",
                     f"{_tokens(below.min().item())} .. {_tokens(below.max().item())}" if len(below) else "-",
                     f"{_tokens(p[0].item())} / {_tokens(p[1].item())} / {_tokens(p[2].item())}",
                     _median_text(spread), _median_text(init_spread)])
    path = docs / "figures" / "inspect_kda.png"
    size = (max(6.0, 0.18 * K + 3.0), 2.4 * (len(layers) + 1))
    with plots.figure(path, ncols=1, nrows=len(layers) + 1, size=size) as (fig, axes):
        for i, name in enumerate(layers):
            ax = axes[i]
            im = ax.imshow(channel_half_lives(trained.kda[name]).log10().numpy(), aspect="auto", cmap="magma",
                           vmin=0, vmax=math.log10(HALF_LIFE_CAP))
            ax.set_yticks(range(H), [f"head {h}" for h in range(H)])
            ax.set_title(f"{name}: log10 half-life (tokens) per head and key channel", fontsize=9)
            fig.colorbar(im, ax=ax)
        axes[-2].set_xlabel("key channel")
        ax = axes[-1]
        bins = torch.linspace(-1, math.log10(HALF_LIFE_CAP), 50)
        for name in layers:
            values = half_life(torch.cat(trained.kda[name]["samples"])).log10()
            ax.hist(values.numpy(), bins=bins.numpy(), histtype="step", label=f"{name} trained", density=True)
        init = half_life(torch.cat([torch.cat(initial.kda[n]["samples"]) for n in layers])).log10()
        ax.hist(init.numpy(), bins=bins.numpy(), histtype="stepfilled", alpha=0.25, color="gray",
                label="all layers at init", density=True)
        ax.set_xlabel("log10 half-life (tokens) per token and channel")
        ax.set_ylabel("density")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    cap = f"{HALF_LIFE_CAP:.0e}".replace("+0", "")  # 1e6
    if spreads:
        measured = (f"{forgetting} of {H * len(layers)} heads forget within {cap} tokens ({init_forgetting} at "
                    f"initialisation); their channels' half-lives span {_tokens(min(finite))} to "
                    f"{_tokens(max(finite))} tokens, and within one such head the 90th/10th percentile ratio is "
                    f"{_median(spreads):.1f}x (median over those heads; {_median_text(init_spreads)} at "
                    "initialisation)")
    else:
        measured = f"no head forgets within {cap} tokens"
    table = Table("KDA decay per layer: half-life ln 2 / -g in tokens per (head, key channel) from its mean log "
                  f"decay (>= {cap} = no forgetting: g rounds to 0 in float32). Heads that forget (at least one "
                  "channel under the cap; at initialisation in brackets), channels that forget, their half-life "
                  "range, per token and channel percentiles, and the within-head spread (p90/p10 over a head's "
                  "channels, median over the heads that forget)",
                  ["layer", "heads forgetting", "channels forgetting", "half-lives", "per token p10 / p50 / p90",
                   "spread", "spread at init"], rows)
    note = (f"KDA verdict: over the heads that forget at all, holds when the median within-head spread of "
            f"channel half-lives is >= {CHANNEL_SPREAD[0]:g}x (the channels of one head forget at clearly "
            f"different rates, which a per-head gate cannot express), partly >= {CHANNEL_SPREAD[1]:g}x. K3's safe "
            "gate g = -5 sigmoid(exp(A_log) (f + dt_bias)) with A_log = log U(1, 16) and dt_bias about log dt, "
            "dt in [1e-3, 0.1], starts every head whose exp(A_log) is large with a sigmoid of -20 or less: those "
            "heads do not forget at all (whether training changes that: the 'heads forgetting' column). The "
            "per-channel spread is partly inherited from dt_bias' per-channel initialisation (the 'init' column)")
    return ([Claim(claim, measured, channel_verdict(spreads))], [table],
            [Figure("figures/inspect_kda.png", "KDA forget-gate half-lives per head and key channel (top, one "
                                                "panel per KDA layer) and their distribution over tokens (bottom)")],
            [note])


def forgets(hl: torch.Tensor) -> torch.Tensor:
    """Per head [H]: whether any of its channels' half-lives [H, K] is under HALF_LIFE_CAP."""
    return (hl < HALF_LIFE_CAP).any(-1)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _median_text(values) -> str:
    values = values.tolist() if isinstance(values, torch.Tensor) else values
    return f"{_median(values):.1f}x" if values else "-"


def _tokens(n: float) -> str:
    if n >= HALF_LIFE_CAP:
        return f">={HALF_LIFE_CAP:.0e}"
    return f"{n:.3g}" if n < 1e4 else f"{n:.1e}"


def _mla_part(docs: Path, attention: Recorder, tokenizer, ids: list[int], period: int):
    claim = ("MLA layers retrieve from the token context exactly (what KDA's fixed-size state must discard): "
             "on a word sequence said twice, heads attend back to the first copy")
    if not attention.mla:
        return [Claim(claim, "the model has no MLA layers", "not measurable here")], [], [], []
    layers = list(attention.mla)
    H = attention.mla[layers[0]].shape[0]
    rows, best, uniform = [], (0.0, "", 0), 0.0
    for name in layers:
        scores = retrieval_scores(attention.mla[name], period)
        uniform = scores["uniform"][0].item()
        for h in range(H):
            back = max(scores["copy"][h].item(), scores["induction"][h].item())
            if back > best[0]:
                best = (back, name, h)
            rows.append([name, h, f"{scores['copy'][h].item():.3f}", f"{scores['induction'][h].item():.3f}",
                         f"{scores['previous'][h].item():.3f}", f"{uniform:.3f}"])
    labels = [tokenizer.decode([i]).replace("\n", "\\n") or "?" for i in ids]
    T = len(ids)
    path = docs / "figures" / "inspect_mla.png"
    with plots.figure(path, ncols=H, nrows=len(layers), size=(3.6 * H, 3.6 * len(layers))) as (fig, axes):
        from matplotlib.colors import PowerNorm

        for i, name in enumerate(layers):
            for h in range(H):
                ax = axes[i * H + h]
                ax.imshow(attention.mla[name][h].numpy(), cmap="Blues", norm=PowerNorm(0.5, vmin=0, vmax=1))
                ax.set_title(f"{name} head {h}", fontsize=9)
                if T <= 48:
                    ax.set_xticks(range(T), labels, rotation=90, fontsize=5)
                    ax.set_yticks(range(T), labels, fontsize=5)
                ax.axvline(period - 0.5, color="tab:red", lw=0.6)
                ax.axhline(period - 0.5, color="tab:red", lw=0.6)
    measured = (f"best head ({best[1]} head {best[2]}) puts {best[0]:.2f} of its attention, on average over the "
                f"second copy, on the matching token of the first copy or the one after it (uniform attention: "
                f"{uniform:.3f}); prompt of {T} tokens")
    table = Table(f"MLA attention on a {T}-token prompt said twice (period {period}): mean attention of the "
                  "second copy's tokens on the same token in the first copy, on the token after it (induction), "
                  "on the previous token, and what uniform attention would give", ["layer", "head", "copy",
                                                                                     "induction", "previous",
                                                                                     "uniform"], rows)
    note = (f"MLA verdict: holds when the best head puts >= {RETRIEVAL} of its attention on the earlier copy "
            "(same token or the one after), partly when >= 3x what uniform attention gives. Whether a model "
            "trained for minutes has learned such retrieval heads is the question this picture answers")
    return ([Claim(claim, measured, retrieval_verdict(best[0], uniform))], [table],
            [Figure("figures/inspect_mla.png", "MLA attention probabilities per layer and head on the sample "
                                                "prompt (rows: queries, columns: keys; square-root colour scale; "
                                                "red: where the second copy starts)")], [note])
