"""The training loop: a step's batch (bucket, questions, token subset), its forward pass through the bucket's feed,
the answer and dense auxiliary losses, AdamW with a cosine schedule, and checkpoints every few steps (``--resume``)."""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from care_core.synthetic import COLOURS, SHAPES

from .buckets import POSITION_BINS, Geometry, pick_bucket, warm_scenes
from .feed import Feed
from .pool import UsageError


class Diverged(Exception):
    """The weights stopped being finite: the run stops before a checkpoint would keep them (``main``: one line, exit
    code 1), so the last checkpoint is the last finite state."""


MIRROR = {"left": "right", "right": "left", "top": "bottom", "bottom": "top"}
CHECKPOINT = "checkpoint.pt"
#: the training options a checkpoint must agree with to be resumed
RESUMED_OPTIONS = ("backbone", "seed", "steps", "batch", "lr", "aux_weight", "scenes", "subset_share", "merge_share",
                   "flip", "size", "warm_size", "warm_share", "position_targets", "position_share")  # fmt: skip


def mirrored(answer: str, horizontal: bool, vertical: bool) -> str:
    """The answer about the mirrored crop: only position answers change (the crop is centred, so an object left
    of the image centre is right of it once mirrored; objects lie inside the crop)."""
    if horizontal and answer in ("left", "right"):
        return MIRROR[answer]
    if vertical and answer in ("top", "bottom"):
        return MIRROR[answer]
    return answer


def merge_into_kept(hidden: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """(B, k, d): each kept token (``order``, (B, k)) averaged with the dropped tokens nearest to it in cosine
    similarity (size-weighted, as ToMe-style merging and calibration hand a language model mixtures of tokens)."""
    batch, n, d = hidden.shape
    k = order.shape[1]
    kept = torch.gather(hidden, 1, order.unsqueeze(-1).expand(-1, -1, d))
    with torch.no_grad():
        sim = F.normalize(hidden.float(), dim=-1) @ F.normalize(kept.float(), dim=-1).transpose(1, 2)  # (B, N, k)
        target = sim.argmax(-1)
        slot = torch.full((batch, n), -1, dtype=torch.long, device=hidden.device)
        slot.scatter_(1, order, torch.arange(k, device=hidden.device).expand(batch, k))
        target = torch.where(slot >= 0, slot, target)  # a kept token stays its own row
    sums = torch.zeros(batch, k, d, dtype=hidden.dtype, device=hidden.device)
    sums = sums.scatter_add(1, target.unsqueeze(-1).expand(-1, -1, d), hidden)
    counts = torch.zeros(batch, k, dtype=hidden.dtype, device=hidden.device).scatter_add(
        1, target, torch.ones_like(target, dtype=hidden.dtype)
    )
    return sums / counts.unsqueeze(-1)


@dataclass
class Data:
    """The scene pool, one tensor per bucket (on ``row_of``'s device), and the token ids of every answer."""

    pixels: list[torch.Tensor]  # per bucket (S_b, ...) uint8 processor outputs
    labels: list[torch.Tensor]  # per bucket (S_b, 2, N_b) colour and shape ids under each token
    qas: list[tuple[int, str, str]]  # (scene, question, answer)
    bucket_of: list[int]  # (Q,) bucket of each question's scene
    row_of: torch.Tensor  # (Q,) row of each question's scene in its bucket's tensors
    questions: list[torch.Tensor]  # per bucket: (Q_b,) its questions (indices into qas)
    position_questions: list[torch.Tensor]  # per bucket: those of its questions that are about position
    other_questions: list[torch.Tensor]  # per bucket: the rest of its questions
    scenes: list[int]  # per bucket: its number of scenes (a step draws a bucket by its share)
    answers: dict[str, list[int]]


@dataclass
class Parts:
    """The modules one step runs, and the constants it needs."""

    model: Any
    processor: Any  # saved beside the weights
    buckets: list[Geometry]  # per bucket: its feed, normaliser and position classes
    aux: torch.nn.Linear  # dense auxiliary head (not shipped)
    pad: int

    @property
    def adapter(self) -> Any:
        return self.buckets[0].feed.adapter


@dataclass
class Batch:
    index: torch.Tensor  # (B,) questions (on the pool's device)
    hflip: torch.Tensor
    vflip: torch.Tensor
    k: int
    order: torch.Tensor | None  # (B, k) kept visual tokens; None: all N in order
    merged: bool
    questions: list[str]
    text: torch.Tensor  # (B, width) tail + answer ids
    target: torch.Tensor  # (B, width) answer positions
    lengths: torch.Tensor
    bucket: int  # every image of the batch has this bucket's token geometry


def _subset(args: argparse.Namespace, step: int, gen: torch.Generator, n: int) -> tuple[int, torch.Tensor | None, bool]:
    """The step's token subset: K log-uniform in 48..N (fewer than N), raster or shuffled; all tokens in the first
    30% of the steps and in 1 - ``subset_share`` of the rest."""
    full = step < 0.3 * args.steps or bool(torch.rand((), generator=gen) < 1 - args.subset_share)
    log_k = float(torch.empty(()).uniform_(math.log(min(48, n - 1)), math.log(n), generator=gen))
    k = n if full else min(int(math.exp(log_k)), n - 1)
    shuffled = bool(torch.rand((), generator=gen) < 0.5)
    merged = not full and bool(torch.rand((), generator=gen) < args.merge_share)
    if full:
        return k, None, merged
    order = torch.rand((args.batch, n), generator=gen).argsort(dim=1)[:, :k]
    return k, order if shuffled else order.sort(dim=1).values, merged


def _questions(args: argparse.Namespace, gen: torch.Generator, data: Data, bucket: int) -> torch.Tensor:
    """(B,) the step's questions from ``bucket``: uniformly from its questions (the recipe), or with
    ``--position-share`` s each one a position question with probability s (uniform among those) and another
    question otherwise (uniformly, as the recipe, in a bucket that lacks one kind: only in pools of a few scenes)."""
    own, about_position, others = data.questions[bucket], data.position_questions[bucket], data.other_questions[bucket]
    if args.position_share is None or len(about_position) == 0 or len(others) == 0:
        return own[torch.randint(0, len(own), (args.batch,), generator=gen)]
    picked = torch.rand(args.batch, generator=gen) < args.position_share
    return torch.where(picked, about_position[torch.randint(0, len(about_position), (args.batch,), generator=gen)],
                       others[torch.randint(0, len(others), (args.batch,), generator=gen)])  # fmt: skip


def draw_batch(args: argparse.Namespace, step: int, gen: torch.Generator, data: Data, parts: Parts) -> Batch:
    """The step's bucket (drawn only when there are several), questions, mirrors and visual-token subset (the recipe
    of the package docstring); the questions' indices on the pool's device, the rest on the model's."""
    device = parts.aux.weight.device
    warm = args.warm_size if step < args.warm_share * args.steps else None  # the warm-up's steps: its size only
    bucket = pick_bucket(gen, warm_scenes(data.scenes, parts.buckets, warm)) if len(data.scenes) > 1 else 0
    feed = parts.buckets[bucket].feed
    batch = _questions(args, gen, data, bucket)
    # mirror images (and the answers of position questions with them): left/right and top/bottom balanced
    hflip = torch.rand(args.batch, generator=gen) < 0.5 if args.flip else torch.zeros(args.batch, dtype=torch.bool)
    vflip = torch.rand(args.batch, generator=gen) < 0.5 if args.flip else torch.zeros(args.batch, dtype=torch.bool)
    k, order, merged = _subset(args, step, gen, feed.n)
    picked = [data.qas[i] for i in batch.tolist()]
    said = [mirrored(a, bool(h), bool(v)) for (_, _, a), h, v in zip(picked, hflip, vflip, strict=True)]
    seqs = [feed.layout(q).tail + data.answers[a] for (_, q, _), a in zip(picked, said, strict=True)]
    width = max(len(s) for s in seqs)
    text = torch.full((args.batch, width), parts.pad, dtype=torch.long)
    target = torch.zeros((args.batch, width), dtype=torch.bool)
    for row, (s, a) in enumerate(zip(seqs, said, strict=True)):
        text[row, : len(s)] = torch.tensor(s)
        target[row, len(s) - len(data.answers[a]) : len(s)] = True
    lengths = torch.tensor([len(s) for s in seqs], device=device)
    kept = None if order is None else order.to(device)
    return Batch(batch.to(data.row_of.device), hflip.to(device), vflip.to(device), k, kept, merged,
                 [q for _, q, _ in picked], text.to(device), target.to(device), lengths, bucket)  # fmt: skip


def _mirror(x: torch.Tensor, b: Batch) -> torch.Tensor:
    """Mirror (B, ..., H, W) images (or label grids) where the batch says so."""
    shape = (-1,) + (1,) * (x.dim() - 1)
    x = torch.where(b.hflip.view(shape), x.flip(-1), x)
    return torch.where(b.vflip.view(shape), x.flip(-2), x)


def _visual_rows(feed: Feed, features: torch.Tensor, b: Batch) -> torch.Tensor:
    """(B, R, d_t) the rows the language model receives: all tokens, a subset, or a subset with the dropped tokens
    merged into the kept ones (before the projector)."""
    projector = feed.adapter.projector
    if b.order is None:
        return feed.rows(projector(features), None)
    if b.merged:
        return feed.rows(projector(merge_into_kept(features, b.order)), b.order)
    kept = torch.gather(features, 1, b.order.unsqueeze(-1).expand(-1, -1, features.shape[-1]))
    return feed.rows(projector(kept), b.order)


def model_inputs(parts: Parts, data: Data, b: Batch) -> tuple[dict[str, Any], int, torch.Tensor]:
    """The model's keyword arguments for a batch (input embeddings, mask, multimodal-rope positions where the family
    takes them), the length of the prefix before the question tail, and the dense auxiliary logits."""
    device, batch = b.text.device, b.text.shape[0]
    geometry = parts.buckets[b.bucket]
    feed = geometry.feed
    pixels = geometry.normalise(data.pixels[b.bucket][data.row_of[b.index]].to(device))
    if b.hflip.any() or b.vflip.any():
        pixels = _mirror(pixels, b)
    embed = parts.model.get_input_embeddings()
    features, deepstack = feed.features(pixels)  # (B, N, d_v); Qwen3-VL: (levels, B, N, d_t) too
    dense = parts.aux(features)  # (B, N, 7 + 5 + 24 + 24)
    rows = _visual_rows(feed, features, b)
    head = torch.tensor(feed.layout(b.questions[0]).head, device=device).expand(batch, -1)
    prefix = head.shape[1] + rows.shape[1]
    length = prefix + b.text.shape[1]
    attn = (torch.arange(length, device=device)[None, :] < (prefix + b.lengths)[:, None]).long()
    inputs: dict[str, Any] = {"attention_mask": attn}
    if feed.marks_image:  # Gemma 3: the rows are one bidirectional block, as the adapter marks them at inference
        inputs["token_type_ids"] = feed.token_types(batch, head.shape[1], rows.shape[1], length, device)
    if deepstack is None:  # the rows as input embeddings between the head's and the text's
        inputs["inputs_embeds"] = torch.cat([embed(head), rows.to(embed.weight.dtype), embed(b.text)], dim=1)
    else:  # placeholders and encoder outputs, as inference feeds them: the model adds the deepstack rows
        inputs.update(feed.visual_inputs(head, rows, b.text, deepstack, b.order))
    if feed.rope:  # a 1-D text row, then (t, h, w): the adapter's four rows
        mrope = feed.positions(b.questions, b.order, b.text.shape[1])
        text_row = torch.arange(length).view(1, 1, -1).expand(1, batch, -1)
        inputs["position_ids"] = torch.cat([text_row, mrope], dim=0).to(device)
    return inputs, prefix, dense


def forward(parts: Parts, data: Data, b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits at the answer positions' predecessors, dense auxiliary logits) of one batch."""
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=b.text.device.type == "cuda"):
        inputs, prefix, dense = model_inputs(parts, data, b)
        logits = parts.model(**inputs, use_cache=False).logits
    # position t predicts token t + 1: the answer tokens at text positions p come from prefix + p - 1
    return logits[:, prefix - 1 : prefix - 1 + b.text.shape[1]], dense


def losses(parts: Parts, data: Data, b: Batch, dense: torch.Tensor) -> torch.Tensor:
    """The dense auxiliary loss: colour and shape of the object under each token, and the token's row and column."""
    batch = b.text.shape[0]
    geometry = parts.buckets[b.bucket]
    lab = data.labels[b.bucket][data.row_of[b.index]].to(dense.device).long()  # (B, 2, N)
    if b.hflip.any() or b.vflip.any():  # mirroring needs one raster grid (tiny-llava): labels mirrored with it
        rows, cols = geometry.feed.reference.grid
        lab = _mirror(lab.view(batch, 2, rows, cols), b).flatten(2)
    dense = dense.float().flatten(0, 1)
    n_col, n_shape = 1 + len(COLOURS), 1 + len(SHAPES)
    cut = [0, n_col, n_col + n_shape, n_col + n_shape + POSITION_BINS, n_col + n_shape + 2 * POSITION_BINS]
    bins = geometry.bins.to(dense.device)
    return (
        F.cross_entropy(dense[:, cut[0] : cut[1]], lab[:, 0].flatten())
        + F.cross_entropy(dense[:, cut[1] : cut[2]], lab[:, 1].flatten())
        + 0.25 * F.cross_entropy(dense[:, cut[2] : cut[3]], bins[0].repeat(batch))
        + 0.25 * F.cross_entropy(dense[:, cut[3] : cut[4]], bins[1].repeat(batch))
    )


def answer_accuracy(logits: torch.Tensor, text: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Share of the batch's answers whose every answer token is the logits' argmax: the answers greedy decoding gets
    right. (The share of answer tokens alone misleads: the demo tokenizer spells an answer in bytes, `` triangle</s>``
    is 10 targets, and only its first letter or two depend on the image.)"""
    wrong = (logits.argmax(-1) != text) & target
    return (~wrong.any(dim=1)).float().mean()


def optimiser(args: argparse.Namespace, parts: Parts) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    params = [p for p in [*parts.model.parameters(), *parts.aux.parameters()] if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.05},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98)), params


def lr_at(args: argparse.Namespace, step: int) -> float:
    """AdamW's learning rate: linear warm-up over 5% of the steps, then cosine to zero."""
    warmup = max(1, args.steps // 20)
    if step < warmup:
        return float(args.lr * (step + 1) / warmup)
    return float(args.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup))))


def save_checkpoint(
    path: Path, args: argparse.Namespace, step: int, seconds: float, parts: Parts, opt: Any, gen: Any
) -> None:
    """Everything the next step needs, and the training seconds so far (written to a temporary file, then renamed:
    a kill leaves the last one)."""
    state = {"step": step, "seconds": seconds, "options": {name: getattr(args, name) for name in RESUMED_OPTIONS},
             "model": parts.model.state_dict(), "aux": parts.aux.state_dict(), "optimiser": opt.state_dict(),
             "generator": gen.get_state()}  # fmt: skip
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _shown(option: str, value: Any) -> str:
    """An option's value as the command line gives it (``--size``: ``mixed`` or ``HxW``)."""
    if option == "size":
        return "mixed" if value is None else f"{value[0]}x{value[1]}"
    return repr(value)


def load_checkpoint(path: Path, args: argparse.Namespace, parts: Parts, opt: Any, gen: Any) -> tuple[int, float]:
    """Restore a checkpoint into the run; the step to continue from and the seconds trained so far. Exits when its
    options differ from ``args``."""
    # on the CPU: the generator state must stay a CPU ByteTensor; the modules and the optimiser move theirs
    state = torch.load(path, map_location="cpu", weights_only=False)
    differ = [f"{k}={_shown(k, v)} (now {_shown(k, getattr(args, k))})" for k, v in state["options"].items()
              if getattr(args, k) != v]  # fmt: skip
    if differ:
        raise UsageError(f"{path} was written with other options: {', '.join(differ)}")
    parts.model.load_state_dict(state["model"])
    parts.aux.load_state_dict(state["aux"])
    opt.load_state_dict(state["optimiser"])
    gen.set_state(state["generator"])
    return int(state["step"]), float(state.get("seconds", 0.0))


def check_finite(params: list[torch.nn.Parameter], step: int, last_saved: int) -> None:
    """Raise :class:`Diverged` when a weight is NaN or infinite after ``step`` steps (one host sync per checkpoint).

    Gradient clipping does not protect the weights from a non-finite gradient (its norm is then NaN, and so is every
    clipped gradient), and a run that goes on trains nothing: two mixed-size Qwen2.5-VL runs turned NaN before step
    500 and ran to step 2500 (2026-11-27)."""
    if bool(torch.stack([torch.isfinite(p).all() for p in params]).all()):
        return
    kept = f"the checkpoint of step {last_saved} is kept" if last_saved else "no checkpoint was written"
    raise Diverged(f"training diverged: some weights are NaN or infinite after step {step}; {kept}")


def update(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], loss: torch.Tensor) -> bool:
    """One optimiser step on ``loss`` with gradients clipped at norm 1; False (and no step: the weights, moments and
    step count stay as they were) when the gradient is NaN or infinite, as a loss scaler skips an overflowing step.

    Clipping alone would pass a non-finite gradient on to AdamW and every weight would turn NaN: one bad batch (a
    bf16 overflow in one bucket, say) would end the run. The check costs one host sync per step."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    if not bool(torch.isfinite(norm)):
        opt.zero_grad(set_to_none=True)
        return False
    opt.step()
    return True


def train_step(
    args: argparse.Namespace,
    step: int,
    gen: torch.Generator,
    data: Data,
    parts: Parts,
    opt: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
) -> tuple[Batch, torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """One step of the recipe (what ``fit`` runs and ``scripts.train_demo.bench_step`` times): the step's batch, its
    logits, answer and auxiliary losses, and whether the optimiser stepped (not on a non-finite gradient)."""
    b = draw_batch(args, step, gen, data, parts)
    logits, dense = forward(parts, data, b)
    aux_loss = losses(parts, data, b, dense)
    answer_loss = F.cross_entropy(logits.float()[b.target], b.text[b.target])
    updated = update(opt, params, answer_loss + args.aux_weight * aux_loss)
    return b, logits, answer_loss, aux_loss, updated


def fit(args: argparse.Namespace, log: Callable[[str], None], advance: Callable[[int], None], parts: Parts,
        data: Data) -> float:  # fmt: skip
    """The training loop from the checkpoint in ``args.out`` (``--resume``) or step 0; returns the seconds trained
    (over every call of a resumed run)."""
    opt, params = optimiser(args, parts)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    checkpoint = Path(args.out) / CHECKPOINT
    resumed = args.resume is not None and checkpoint.is_file()
    start, before = load_checkpoint(checkpoint, args, parts, opt, gen) if resumed else (0, 0.0)
    if start:
        log(f"resumed at step {start} from {checkpoint} ({before:.0f} s trained before)")
        advance(start)
    started = time.perf_counter() - before
    last_saved = start
    skipped: dict[int, int] = {}  # bucket -> steps skipped for a non-finite gradient (this call's)
    for step in range(start, args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(args, step)
        b, logits, answer_loss, aux_loss, updated = train_step(args, step, gen, data, parts, opt, params)
        if not updated:
            skipped[b.bucket] = skipped.get(b.bucket, 0) + 1
            log(f"step {step:5d}  skipped: non-finite gradient (bucket {parts.buckets[b.bucket].name}; k {b.k})")
        advance(1)
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
            check_finite(params, step + 1, last_saved)
            save_checkpoint(checkpoint, args, step + 1, time.perf_counter() - started, parts, opt, gen)
            last_saved = step + 1
        if step % 250 == 0 or step == args.steps - 1:
            with torch.no_grad():
                acc = (logits.argmax(-1)[b.target] == b.text[b.target]).float().mean()
                answers = answer_accuracy(logits, b.text, b.target)
            log(f"step {step:5d}  k {b.k:4d}{'m' if b.merged else ' '} answer loss {answer_loss.item():.4f}  "
                f"aux {aux_loss.item():.3f}  token acc {acc.item():.3f}  answer acc {answers.item():.3f}  "
                f"lr {lr_at(args, step):.2e}  {time.perf_counter() - started:.0f} s")  # fmt: skip
    if skipped:
        log("steps skipped for a non-finite gradient: "
            + "; ".join(f"{parts.buckets[k].name}: {n}" for k, n in sorted(skipped.items())))  # fmt: skip
    if data.row_of.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started
