"""The command line of ``scripts.train_demo`` (see the package docstring): build, train, save, evaluate, install."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from benchmarks.common import missing_cuda
from care_core.backbones.demo import MANIFEST, file_sha256, read_manifest, weights_dir
from care_core.backbones.families import demo_backbones
from care_core.backbones.loading import adapter_for_model
from care_core.backbones.packed_attention import use_packed_vision_attention
from care_core.synthetic import IMAGE_SIZES, POSITION

from .buckets import POSITION_BINS, POSITION_TARGETS, Geometry, token_geometries
from .heldout import evaluate
from .loop import CHECKPOINT, MIRROR, RESUMED_OPTIONS, Data, Diverged, Parts, fit
from .pool import Drawn, Pool, UsageError, make_pool

#: the one family whose training images --flip mirrors: its processor gives whole images of one raster grid, so
#: mirroring the pixels mirrors the token grid (the Qwen families' one grid comes as flattened patches, the others'
#: images as several crops or tiles); a fact of this script's mirroring, not of the family
FLIP_FAMILY = "llava-1.5"
MIXED = "mixed"  # --size: the world's mix of image sizes, one bucket per token geometry
PACKED = "packed"  # --vision-attention: care_core's packed sdpa (one call per segment length), any device


class Run:
    """One training run's output folder: the progress bar, the log (rewritten after every line), what is saved."""

    def __init__(self, out: Path, *, continued: bool = False) -> None:
        self.out = out
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TimeRemainingColumn())  # fmt: skip
        log = out / "log.txt"
        # a resumed run or a later evaluation goes on with the log the run has written so far
        self.lines: list[str] = log.read_text(encoding="utf-8").splitlines() if continued and log.is_file() else []
        self.saved: list[Path] = []

    def log(self, message: str) -> None:
        self.progress.console.print(message, markup=False, highlight=False)
        self.lines.append(message)
        (self.out / "log.txt").write_text("\n".join(self.lines) + "\n", encoding="utf-8")
        self.record(self.out / "log.txt")

    def record(self, path: Path) -> None:
        if path not in self.saved:
            self.saved.append(path)

    def phase(self, description: str, total: int | None = None) -> Callable[[int], None]:
        """A new bar; returns the function that advances it."""
        task = self.progress.add_task(description, total=total)

        def advance(steps: int = 1) -> None:
            self.progress.advance(task, steps)

        return advance

    def interrupted(self) -> str:
        """The one line Ctrl-C prints: what this run saved before it stopped."""
        if not self.saved:
            return "interrupted: nothing saved"
        return "interrupted; saved so far: " + ", ".join(str(p) for p in self.saved)


def build(args: argparse.Namespace, run: Run) -> tuple[Any, Any, list[Geometry], dict[tuple[int, int], np.ndarray]]:
    """The model to train (the demo's trained skeleton from the seed), the buckets of token geometry of the training
    sizes (``--size``: one, or the world's mix) with their feeds, and per size the token centres."""
    spec = demo_backbones()[args.backbone]
    advance = run.phase("building the model", total=1)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    model, processor = spec.build_trained(args.seed)
    if args.vision_attention:  # packed or flash_attention_2: Qwen2.5-VL's tower otherwise runs one sdpa call per window
        try:
            if args.vision_attention == PACKED:
                use_packed_vision_attention(model)
            else:
                model.set_attn_implementation({"vision_config": args.vision_attention})
        except (ImportError, ValueError) as exc:
            raise UsageError(f"--vision-attention {args.vision_attention}: {str(exc).splitlines()[0]}") from exc
    adapter = adapter_for_model(model, processor, name=spec.name)
    sizes = [args.size] if args.size else list(IMAGE_SIZES)
    geometries, centres = token_geometries(adapter, processor.image_processor, sizes, torch.device(args.device),
                                           args.position_targets)  # fmt: skip
    advance(1)
    return model, processor, geometries, centres


def _data(pool: Pool, geometries: list[Geometry], store: torch.device) -> Data:
    """The pool as the loop reads it: per question its bucket and its scene's row there, per bucket its questions
    and scenes, and the ids of every answer (mirrored position answers included)."""
    bucket_of = [pool.bucket[s] for s, _, _ in pool.qas]
    questions = [torch.tensor([q for q, b in enumerate(bucket_of) if b == i], dtype=torch.long)
                 for i in range(len(geometries))]  # fmt: skip
    feed = geometries[0].feed
    is_position = [torch.tensor([pool.types[i] == POSITION for i in q.tolist()], dtype=torch.bool) for q in questions]
    return Data(pool.pixels, pool.labels, pool.qas, bucket_of,
                torch.tensor([pool.row[s] for s, _, _ in pool.qas], dtype=torch.long, device=store), questions,
                [q[m] for q, m in zip(questions, is_position, strict=True)],
                [q[~m] for q, m in zip(questions, is_position, strict=True)],
                [pool.bucket.count(i) for i in range(len(geometries))],
                {a: feed.answer(a) for a in {a for _, _, a in pool.qas} | set(MIRROR)})  # fmt: skip


def draw(args: argparse.Namespace, run: Run, image_processor: Any, geometries: list[Geometry],
         centres: dict[tuple[int, int], np.ndarray], store: torch.device) -> Drawn:  # fmt: skip
    """The scene pool on ``store`` (``--workers`` processes) and the seconds it took."""
    t0 = time.perf_counter()
    advance = run.phase(f"drawing {args.scenes} scenes ({args.workers} workers)", total=args.scenes)
    bucket_of = {size: i for i, g in enumerate(geometries) for size in g.sizes}
    pool = make_pool(args.scenes, args.workers, image_processor, args.size, centres, bucket_of, store, advance)
    return Drawn(pool, time.perf_counter() - t0)


def prepare(args: argparse.Namespace, run: Run, drawn: Drawn | None = None) -> tuple[Parts, Data]:
    """The model to train and the scene pool (on ``--pool-device``, one tensor per bucket of token geometry): drawn
    here, or ``drawn`` beforehand (``--replicas``: one pool for every run)."""
    from care_core.synthetic import COLOURS, SHAPES

    model, processor, geometries, centres = build(args, run)
    device = torch.device(args.device)
    store = device if args.pool_device == "device" else torch.device("cpu")
    if drawn is None:
        drawn = draw(args, run, processor.image_processor, geometries, centres, store)
        how = ""
    else:  # on the CPU the tensors stay the parent's pages (a forked child reads them without a copy)
        drawn = Drawn(drawn.pool.to(store), drawn.seconds)
        how = f", drawn once for {args.replicas} runs" if args.replicas > 1 else ", drawn beforehand"
    data = _data(drawn.pool, geometries, store)
    run.log(
        f"pool: {args.scenes} scenes, {len(drawn.pool.qas)} questions in {drawn.seconds:.1f} s{how}; buckets "
        + "; ".join(f"{g.describe()} ({n} scenes)" for g, n in zip(geometries, data.scenes, strict=True))
    )
    model.to(device).train()
    model.requires_grad_(True)
    feed = geometries[0].feed
    width = int(feed.reference.features.shape[-1])
    aux = torch.nn.Linear(width, 1 + len(COLOURS) + 1 + len(SHAPES) + 2 * POSITION_BINS).to(device)
    tok = feed.adapter.tokenizer
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    return Parts(model, processor, geometries, aux, pad), data


def train(args: argparse.Namespace, run: Run, drawn: Drawn | None) -> dict[str, Any]:
    """Build, train and save the model: the float16 weights that ship and a loadable model folder."""
    spec = demo_backbones()[args.backbone]
    parts, data = prepare(args, run, drawn)
    advance = run.phase("training", total=args.steps)
    train_s = fit(args, run.log, advance, parts, data)
    questions = len(data.qas)
    del data
    # the file that ships: float16, saved by save_pretrained (same keys as a demo folder's model.safetensors)
    advance = run.phase("saving the weights", total=1)
    model = parts.model.eval().requires_grad_(False)
    folder = run.out / "model"
    model.to("cpu").half().save_pretrained(str(folder))
    parts.processor.save_pretrained(str(folder))
    run.record(folder)
    assert spec.weights is not None  # parse offers only demos with a weights file
    weights = run.out / spec.weights
    shutil.copyfile(folder / "model.safetensors", weights)
    run.record(weights)
    advance(1)
    return {"train_seconds": round(train_s, 1), "pool_questions": questions, "folder": folder, "weights": weights}


def install(backbone: str, source: Path) -> None:
    """Copy ``source/<weights>`` into the package and record its sha256, size and training summary."""
    spec = demo_backbones()[backbone]
    assert spec.weights is not None
    src = source / spec.weights
    if not src.is_file():
        raise UsageError(f"{src} does not exist (train with --out {source} first)")
    summary_path = source / f"{backbone}.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    folder = weights_dir()
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, folder / spec.weights)
    manifest = read_manifest()
    manifest[spec.weights] = {
        "sha256": file_sha256(folder / spec.weights),
        "bytes": (folder / spec.weights).stat().st_size,
        "backbone": backbone,
        "training": {k: v for k, v in summary.items() if k != "log"},
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _size(text: str) -> tuple[int, int] | str:
    if text == MIXED:
        return text
    height, _, width = text.partition("x")
    try:
        return int(height), int(width)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HxW or mixed, got {text!r}") from None


def _options(parser: argparse.ArgumentParser) -> None:
    """The recipe's options (defaults: the shipped recipe)."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--aux-weight", type=float, default=0.5, help="weight of the dense per-token loss")
    parser.add_argument("--scenes", type=int, default=24000)
    parser.add_argument("--size", type=_size, default=MIXED,
                        help="HxW of every training scene, or 'mixed' (the default: the world's sizes, each step's "
                             "batch drawn from one bucket of token geometry by its share of the pool; HxW "
                             "reproduces the runs trained on one size, e.g. 336x336, or 384x384 for "
                             "tiny-qwen3-vl)")  # fmt: skip
    parser.add_argument(
        "--subset-share",
        type=float,
        default=0.5,
        help="share of the steps after the first 30%% that feed a random subset of the visual tokens",
    )
    parser.add_argument("--merge-share", type=float, default=0.0,
                        help="share of the subset steps whose dropped tokens are averaged into their nearest kept "
                             "token (0: the shipped recipe)")  # fmt: skip
    parser.add_argument("--warm-size", type=_size, default=None, metavar="HxW",
                        help="with --size mixed: the first --warm-share of the steps draw their batches from this "
                             "size's bucket only (e.g. 336x336), the rest from the mix (default: none)")  # fmt: skip
    parser.add_argument("--warm-share", type=float, default=0.0, help="share of the steps that --warm-size covers")
    parser.add_argument("--position-targets", choices=POSITION_TARGETS, default="all",
                        help="tokens whose row and column the dense loss asks: all (the shipped recipe) or those "
                             "of the base view, which shows the whole image (LLaVA-NeXT, LLaVA-OneVision)")  # fmt: skip
    parser.add_argument("--position-share", type=float, default=None, metavar="S",
                        help="draw each batch question about position with probability S (default: as the pool "
                             "has them, about one in five); the shipped tiny-llava-next and tiny-qwen2.5-vl runs "
                             "used 0.4")  # fmt: skip
    parser.add_argument("--flip", action="store_true",
                        help="mirror half of the images (and position answers with them); tiny-llava only, not in "
                             "the shipped recipe")  # fmt: skip


def trainable() -> list[str]:
    """The demos this script trains: those whose registry record names a weights file (each trained on the world's
    mix of image sizes unless --size says one)."""
    return sorted(name for name, demo in demo_backbones().items() if demo.weights)


def parse(argv: list[str] | None) -> argparse.Namespace:
    from . import __doc__ as doc

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", default="tiny-llava", choices=trainable())
    parser.add_argument("--out", type=Path, help="output folder (train, then evaluate unless --skip-eval)")
    parser.add_argument("--resume", type=Path, metavar="DIR", help="continue the run in DIR from its checkpoint")
    parser.add_argument("--evaluate-only", type=Path, metavar="DIR", help="evaluate the model trained in DIR")
    parser.add_argument("--install-from", type=Path, help="copy this training output's weights into the package")
    _options(parser)
    parser.add_argument("--checkpoint-every", type=int, default=250, help="steps between checkpoints")
    parser.add_argument("--skip-eval", action="store_true", help="train and save only (evaluate with --evaluate-only)")
    parser.add_argument("--workers", type=int, default=max(1, (mp.cpu_count() or 2) - 1))
    parser.add_argument("--device", help="cuda, cpu or a torch device name (default: cuda where there is one)")
    parser.add_argument("--replicas", type=int, default=1, metavar="N",
                        help="train N runs of the recipe at once from one drawn pool: one process per run, run k "
                             "in OUT/run-k on GPU k modulo the GPUs there (two trainings from a clean state for "
                             "the reproduction check, with one pool's drawing and host memory)")  # fmt: skip
    parser.add_argument("--threads", type=int, metavar="N",
                        help="CPU threads of each run's torch ops (default: torch's own alone; with --replicas, the "
                             "cores shared among the runs). Float sums depend on it: give the same N to compare a "
                             "replica with a run alone bit for bit")  # fmt: skip
    parser.add_argument("--sequential", action="store_true",
                        help="with --replicas: the runs one after another instead of at once (a GPU with memory "
                             "for one run), still from the one drawn pool")  # fmt: skip
    parser.add_argument("--vision-attention", metavar="IMPL",
                        help=f"the vision tower's attention implementation while training: {PACKED} (Qwen2.5-VL: one "
                             "sdpa call per window length instead of one per window), flash_attention_2 where "
                             "flash-attn is installed, or another transformers name; default: the model's, sdpa, "
                             "which the adapter packs on CUDA")  # fmt: skip
    parser.add_argument("--pool-device", choices=("device", "cpu"), default="device",
                        help="where the scene pool lives (cpu: host memory, one batch copied per step)")  # fmt: skip
    parser.add_argument("--questions", "--eval", dest="eval", type=int, default=500, help="held-out questions")
    parser.add_argument(
        "--eval-size",
        type=_size,
        default=MIXED,
        help="HxW of every held-out scene, or 'mixed' (the world's sizes: the standard set)",
    )
    args = parser.parse_args(argv)
    _check(parser, args)
    args.replica = 0
    return args


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The options' combinations and ranges (``parser.error``: one line, exit 2); the size options resolved."""
    if args.resume is not None:
        args.out = args.out or args.resume
    if sum(x is not None for x in (args.out, args.evaluate_only, args.install_from)) != 1:
        parser.error("give one of --out DIR (or --resume DIR), --evaluate-only DIR, --install-from DIR")
    family = demo_backbones()[args.backbone].family
    args.size = None if args.size == MIXED else args.size
    args.eval_size = None if args.eval_size == MIXED else args.eval_size
    if args.warm_size == MIXED or (args.warm_size is None) != (args.warm_share == 0):
        parser.error("--warm-size HxW and --warm-share (above 0) go together")
    if args.warm_size is not None and (args.size is not None or args.warm_size not in IMAGE_SIZES):
        parser.error("--warm-size needs --size mixed and one of the world's sizes: "
                     + ", ".join(f"{h}x{w}" for h, w in dict.fromkeys(IMAGE_SIZES)))  # fmt: skip
    if not 0 <= args.warm_share < 1:
        parser.error(f"--warm-share must be in [0, 1), got {args.warm_share}")
    if args.position_share is not None and not 0 < args.position_share < 1:
        parser.error(f"--position-share must be in (0, 1), got {args.position_share}")
    if args.flip and family != FLIP_FAMILY:
        parser.error("--flip mirrors one raster grid of 336x336 crops: tiny-llava only")
    if args.checkpoint_every < 1 or args.steps < 1 or args.batch < 1 or args.replicas < 1:
        parser.error("--steps, --batch, --checkpoint-every and --replicas must be at least 1")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    if args.replicas > 1 and args.out is None:
        parser.error("--replicas trains: give --out DIR (or --resume DIR)")
    if args.sequential and args.replicas < 2:
        parser.error("--sequential orders the runs of --replicas N: give N of at least 2")


def heldout_key(size: tuple[int, int] | None) -> str:
    """Where a summary keeps a held-out evaluation: ``heldout`` (the world's mix of sizes) or ``heldout_<H>x<W>``."""
    return "heldout" if size is None else f"heldout_{size[0]}x{size[1]}"


def _summary(args: argparse.Namespace, argv: list[str] | None, extra: dict[str, Any]) -> dict[str, Any]:
    return {"backbone": args.backbone,
            "command": "python -m scripts.train_demo " + " ".join(sys.argv[1:] if argv is None else argv),
            **{name: getattr(args, name) for name in RESUMED_OPTIONS}, **extra}  # fmt: skip


def train_and_evaluate(args: argparse.Namespace, argv: list[str] | None, run: Run, drawn: Drawn | None) -> None:
    started = time.perf_counter()
    device_name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    run.log(f"{args.backbone}: torch {torch.__version__}, device {device_name}")
    trained = train(args, run, drawn)
    extra = {"pool_questions": trained["pool_questions"], "device": device_name,
             "train_seconds": trained["train_seconds"], "sha256": file_sha256(trained["weights"])}  # fmt: skip
    if args.replicas > 1:
        extra["replica"] = f"{args.replica + 1} of {args.replicas}"
    if not args.skip_eval:
        extra[heldout_key(args.eval_size)] = evaluate(trained["folder"], args.eval, args.workers, 64, run,
                                                      args.eval_size)  # fmt: skip
    extra["total_seconds"] = round(time.perf_counter() - started, 1)
    summary = _summary(args, argv, extra)
    (run.out / f"{args.backbone}.json").write_text(json.dumps(summary, indent=2) + "\n")
    run.record(run.out / f"{args.backbone}.json")
    run.log(json.dumps(summary))


def evaluate_only(args: argparse.Namespace, run: Run) -> None:
    """The held-out evaluation of DIR/model, written into DIR/<backbone>.json (kept beside the training summary)."""
    folder = run.out / "model"
    if not (folder / "config.json").is_file():
        raise UsageError(f"{folder} holds no trained model (train with --out {run.out} first)")
    path = run.out / f"{args.backbone}.json"
    summary = json.loads(path.read_text()) if path.is_file() else {"backbone": args.backbone}
    summary[heldout_key(args.eval_size)] = evaluate(folder, args.eval, args.workers, 64, run, args.eval_size)
    path.write_text(json.dumps(summary, indent=2) + "\n")
    run.record(path)


def default_device() -> str:
    """cuda where a GPU is seen, else cpu (asked only where it is needed: a process that asks CUDA before it forks
    leaves its children unable to use it)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def session(args: argparse.Namespace, argv: list[str] | None, drawn: Drawn | None = None) -> int:
    """One run (train and evaluate, or evaluate only) in its folder, with its progress display; the exit code."""
    out = args.out if args.evaluate_only is None else args.evaluate_only
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out, continued=args.resume is not None or args.evaluate_only is not None)
    try:
        with run.progress:
            if args.evaluate_only is not None:
                evaluate_only(args, run)
            else:
                train_and_evaluate(args, argv, run, drawn)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Diverged as exc:
        run.log(str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if (out / CHECKPOINT).is_file():  # the steps so far: --resume continues from them
            run.record(out / CHECKPOINT)
        print(run.interrupted(), file=sys.stderr)
        return 130
    return 0


def _replica(args: argparse.Namespace, argv: list[str] | None, k: int, drawn: Drawn) -> int:
    """Run k of ``--replicas`` in a forked child: OUT/run-k, GPU k modulo the GPUs (or the CPU), its output in
    OUT/run-k/console.txt (several live progress displays on one terminal would overwrite each other)."""
    child = argparse.Namespace(**vars(args))
    child.out = args.out / f"run-{k}"
    child.resume = child.out if args.resume is not None else None
    child.replica = k
    child.out.mkdir(parents=True, exist_ok=True)
    device = args.device or default_device()  # main has refused a --device that cannot run here
    if device == "cuda":
        torch.cuda.set_device(k % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    child.device = device
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) // args.replicas))
    with open(child.out / "console.txt", "a", encoding="utf-8") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
    return session(child, argv, drawn)


def replicas(args: argparse.Namespace, argv: list[str] | None) -> int:
    """``--replicas N``: the pool drawn once on the CPU, then one forked process per run (``_replica``), all from the
    same seed, at once or (``--sequential``) one after another; waits for all of them (Ctrl-C reaches them too: each
    stops as one run does) and says how each ended. This process never touches CUDA, so that its children can."""
    assert args.out is not None
    # one thread here: a child forked after this process ran OpenMP on several threads hangs in its first parallel
    # region (GNU OpenMP, measured); this process only builds the model and gathers the workers' scenes
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(args.out, continued=args.resume is not None)
    here = argparse.Namespace(**{**vars(args), "device": "cpu"})
    try:
        with run.progress:
            _, processor, geometries, centres = build(here, run)
            drawn = draw(here, run, processor.image_processor, geometries, centres, torch.device("cpu"))
    except KeyboardInterrupt:
        print("interrupted: nothing saved", file=sys.stderr)
        return 130
    pids, codes = [], []
    for k in range(args.replicas):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(args, argv, k, drawn)
        if args.sequential:  # the next run starts when this one has ended well (not after Ctrl-C or an error)
            codes.append(_wait(pid))
            if codes[-1]:
                break
        else:
            pids.append(pid)
    codes += [_wait(pid) for pid in pids]
    for k, code in enumerate(codes):
        print(f"{args.out / f'run-{k}'}: exit code {code}", file=sys.stderr if code else sys.stdout)
    return next((c for c in codes if c), 0)


def _child(args: argparse.Namespace, argv: list[str] | None, k: int, drawn: Drawn) -> NoReturn:
    """A forked child's whole life: run k, then leave without returning into the parent's frames (which would fork
    the next runs again), an unexpected error's traceback in its console file and exit code 1."""
    code = 1
    try:
        code = _replica(args, argv, k, drawn)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int) -> int:
    """A child's exit code (a signal's: 128 + its number), waiting through Ctrl-C (the children stop on it)."""
    while True:
        try:
            _, status = os.waitpid(pid, 0)
        except KeyboardInterrupt:
            continue
        code = os.waitstatus_to_exitcode(status)
        return code if code >= 0 else 128 - code


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.install_from is not None:
        try:
            install(args.backbone, args.install_from)
        except UsageError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # transformers' notes and bars would break the progress display
    hf_logging.disable_progress_bar()
    if args.replicas > 1:  # CUDA asked through NVML, which leaves no CUDA state for the replicas to inherit
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    if args.device is not None and (problem := missing_cuda(args.device)):  # one check, before any work
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.replicas > 1:
        return replicas(args, argv)
    args.device = args.device or default_device()
    if args.threads:
        torch.set_num_threads(args.threads)
    return session(args, argv)
