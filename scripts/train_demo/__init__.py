"""Train a demo backbone on the synthetic shapes world (``care_core.synthetic``), evaluate it through the adapter's
own generate path, and write the weights to ship.

    python -m scripts.train_demo --backbone tiny-llava --out DIR              # train + evaluate (GPU: --device cuda)
    python -m scripts.train_demo --backbone tiny-llava-next --out DIR --skip-eval --steps 2000
    python -m scripts.train_demo --backbone tiny-llava-next --out DIR --resume       # continue from DIR's checkpoint
    python -m scripts.train_demo --backbone tiny-llava-next --evaluate-only DIR --questions 500
    python -m scripts.train_demo --backbone tiny-llava-next --install-from DIR    # copy DIR's weights into the package

Run from the repository root (as a module: it imports care_core and ``benchmarks.demo_world`` from there). A
progress bar shows every phase (building the model, drawing the scenes, the steps, saving, the held-out
evaluation); Ctrl-C stops with one line saying what was saved, and exit code 130. Backbones: the demos whose
registry record names a weights file (``tiny-llava``, ``tiny-llava-next``, ``tiny-qwen2.5-vl``, ``tiny-qwen3-vl``,
``tiny-llava-onevision``, ``tiny-internvl3``); the model starts from the record's trained skeleton
(``DemoBackbone.build_trained``, :data:`~care_core.backbones.demo.TRAINED_SIZES`).

Recipe (seeded, one command): 24,000 scenes of split seed 0 (held-out questions: split seed 1) at the world's mix of
image sizes are drawn by worker processes and kept as the backbone's (PIL) processor output in uint8, one tensor per
bucket of token geometry (see Image size; on the device, ``--pool-device cpu`` keeps them in host memory). Every step
draws its bucket (by the bucket's share of the scenes), normalises a batch of 128 of its images as the processor does,
runs the family's own tower pass with gradients (``adapter.batch_features``: CLIP layer -2 without CLS per crop,
LLaVA-NeXT's packing of base view and unpadded crops, Qwen2.5-VL's windowed tower with its 2x2 groups in raster order,
Qwen3-VL's tower with its deepstack rows (``adapter.batch_tokens``), LLaVA-OneVision's SigLIP crops packed as NeXT's,
InternVL3's tiles through InternViT and the pixel shuffle), projects them (the family's projector or merger) and feeds
the language model the prompt ``adapter.prompt(question)`` with the visual rows where the adapter puts them (its own
ids, InternVL3's ``<img>`` ... ``</img>`` included, and, for the Qwen families, its multimodal-rope positions, taken
from ``adapter._lm_inputs`` for the bucket's reference image; LLaVA-NeXT's and LLaVA-OneVision's newline rows through
``adapter.fed_rows``; Qwen3-VL's rows and each row's deepstack rows, those of its token, as the encoder outputs its
inference hands the model: ``adapter.fed_deepstack``, ``adapter.deepstack_outputs``), followed by `` answer`` and the
end token; the answer loss is on the answer tokens only. A dense auxiliary loss (a linear head that is not shipped)
asks each token's pre-projector features for the colour and shape of the object under the token's centre
(``ImageTokens.boxes`` of the adapter: every token, base view and crops alike) and for the token's row and column on a
24 x 24 grid of ``ImageTokens.positions``. After the first 30% of the steps, half the steps feed a random subset of
the visual tokens (K log-uniform in 48..N, in raster or shuffled order, fed as reduction feeds them, N the bucket's: K
rows in the given order, Qwen rows at their tokens' rope positions with, for Qwen3-VL, their tokens' deepstack rows),
so that the language model reads whatever rows it is given. AdamW (lr 1.5e-3, cosine, 5% warm-up), 5000 steps. A
step whose gradient is NaN or infinite is skipped (weights and AdamW moments untouched) and logged with its bucket:
the mixed-size Qwen2.5-VL runs of 2026-11-27 skipped 7 and 14 of 5000, every one a step with all the tokens of a
448x448, 672x672 or 336x672 image, where without the skip the first one had turned every weight NaN. A
checkpoint is written every ``--checkpoint-every`` steps (DIR/checkpoint.pt); ``--resume`` continues from it bit for
bit (CPU float32). Before each checkpoint the weights are checked: a run whose weights turned NaN or infinite stops
there (one line, exit code 1) and keeps the last finite checkpoint.

Log. Every 250 steps: the step's answer loss (mean over answer tokens), ``token acc`` (the share of answer tokens
that are the argmax, teacher-forced) and ``answer acc`` (the share of answers with every token right: what greedy
decoding answers right). Read ``answer acc``: the demo tokenizer spells answers in bytes (`` triangle</s>``: 10
targets, 5.7 per answer on average) and only the first letter or two depend on the image, so ``token acc`` stays
high without the image (a tiny-llava-next run of 1500 steps at batch 64 logged 0.92 and 0.15; on its training
scenes it scored 0.88 with zero visual rows, and 54% of answers right with its own; 2026-11-26).

Image size. ``--size mixed`` (the default for every family) trains on the world's mix of sizes
(``care_core.synthetic.IMAGE_SIZES``). A batch must share one token geometry, so the pool is grouped into buckets, one
per geometry (``buckets.py``: sizes whose blank images the adapter encodes alike share one), each with its reference
encoding (ids, rope positions, newline rows), normaliser and token centres, built once at start-up. Each step draws
one bucket with the step's generator, with probability proportional to its share of the pool's scenes, so training
sees the world's mix, and its batch from that bucket's questions. N over the world's sizes (the log's ``pool:`` line
lists the buckets): ``tiny-llava`` 576 at every size (one bucket: its processor crops all of them to one 336x336 view,
so its runs are what they were before buckets); LLaVA-NeXT 1152 (336x336: a base view and two crops) to 2880 (448x448,
672x672: a base view and four crops), plus one newline row per row of crop tokens; Qwen2.5-VL 144 (336x336: 12x12
merged tokens) to 576 (672x672: 24x24); Qwen3-VL 100 (336x336 resizes to 320x320: 10x10) to 441 (672x672: 21x21);
LLaVA-OneVision 1458 (336x336: a base view and one crop) to 3645 (448x448, 672x672: four crops), plus newline rows;
InternVL3 256 (336x336 and 448x448 share a bucket: one 448 px tile, no thumbnail) to 3328 (384x512, 480x360: 12 tiles
and the thumbnail); one bucket per size for all but ``tiny-llava`` and InternVL3's two. ``--size HxW`` trains every
scene at one size (one bucket: the runs before mixed sizes, e.g. 336x336, and 384x384 for ``tiny-qwen3-vl``, whose
24x24 grid of 16 px patches gives 144 merged tokens). Why mixed: trained at 336x336 only (H200, full recipe,
2026-11-26), ``tiny-qwen2.5-vl`` answered 88% of 100 held-out questions at 336x336 but 44.6% of 500 at the world's
sizes (other sizes give it other token counts and rope positions, which it had never seen), and ``tiny-llava-next``
83.2% at the world's sizes (position questions 52%). Mixed sizes measured (4 x H200, full recipe, 2026-11-27,
``benchmarks/results/2026-11-27-gpu-4xh200-train_demo-mixed.json`` and ``...-train_demo-sweep.json``):
``tiny-qwen3-vl`` trains well (two runs: 96.0% and 97.0% held-out, shipped), ``tiny-llava-next`` stalls near 0.6
logged answer accuracy from step 0 (held-out 59.2% and 58.4%) but not after 2000 warm-up steps at 336x336
(``--warm-size 336x336 --warm-share 0.4``: 86.8%, shipped, one run), and ``tiny-qwen2.5-vl`` finishes once steps
with a non-finite gradient are skipped (79.2% and 70.4%: not shipped). A checkpoint records the
choice: ``--resume`` refuses one written with another ``--size``. The held-out evaluation keeps the world's mix
(``--eval-size``). Memory: the pool of 24,000 scenes in uint8 takes about 8 GB for ``tiny-llava``, 28-34 GB for
NeXT, OneVision and the Qwen families, and about 82
GB for InternVL3 (5.7 tiles of 448 px per scene on average; at 336x336 only it was 14.5 GB). Each scene is written
into its bucket's tensor as it arrives (the sizes are known before the scenes are drawn), so the host holds the pool
once with ``--pool-device cpu`` and not at all on the device (gathering first and stacking after took 1.9 times the
pool: InternVL3's did not fit a 128 GB host). InternVL3 needs ``--pool-device cpu`` on an 80 GB card, and on a 141 GB
H200 too at batch 128: its steps in the 13-tile bucket feed 13 tiles per image through the tower, 62 GB of
activations at batch 128 (31 GB at 64) beside the 82 GB pool.

Replicas. ``--replicas N`` trains N runs of one command at once, for the reproduction check: the pool is drawn once
(in host memory), then one forked process per run trains in OUT/run-k on GPU k modulo the GPUs there (several share a
GPU where there are fewer), each with its own checkpoint, log, summary and console file (OUT/run-k/console.txt),
the pool moved to its device or read from the parent's host memory without a copy (``--pool-device cpu``). Runs of
one seed differ on a GPU (its kernels are not bit-reproducible) and not on the CPU. The parent never touches CUDA and
runs on one thread: a process forked after OpenMP ran on several threads hangs in its first parallel region.
``--sequential`` runs them one after another instead, from the same drawing, the next once the last ended with exit
code 0 (InternVL3's pair on one H200, whose memory holds one run's steps at batch 128).

Cost. On the CPU (float32, one thread, batch 8 and 16, 2026-11-26; steps at 336x336, 384x384 for Qwen3-VL: a
step at another size costs more or less with its N) a LLaVA-NeXT step costs about 3.0 ``tiny-llava``
steps (three crops per image, 1176 rows into the language model) and a Qwen2.5-VL step about 0.7. In the same
conditions (batch 8, median of three steps after one, 2026-11-26; NeXT measured 2.8 and Qwen2.5-VL 0.7 in the same
runs) a Qwen3-VL step costs about 0.85 ``tiny-llava`` steps, an InternVL3 step about 1.3 (a 448 px tile: 1024
patches through InternViT) and a LLaVA-OneVision step about 4.0 (two crops of 729 SigLIP patches, 1485 rows into the
language model). On a GPU the
Qwen2.5-VL tower without flash attention runs one attention call per window and image (9 windows per 336x336 image in
its two windowed blocks, one call per image in the two others: 2,560 calls per forward at batch 128), so its steps are
bound by launches. ``--vision-attention packed`` runs each block's calls as one batched sdpa call per segment length
(``care_core.backbones.packed_attention``: the windows and images of one size are one call, so a batch of 336x336
images is 4 calls per forward instead of 2,560, with the same maths). The adapter already does so on CUDA while the
tower's setting is sdpa (the default), so on a GPU the flag states what happens anyway; on the CPU, which is bound by
the arithmetic rather than by launches, it packs too but gains nothing measurable.
``--vision-attention flash_attention_2`` (where flash-attn is installed) uses flash-attn's variable-length kernel.

Shipped weights: ``--backbone tiny-llava --out DIR --workers 8`` on one H200 (two runs side by side: held-out 86.6%
and 85.8%); ``--backbone tiny-qwen3-vl`` (the recipe as it stands, mixed sizes; two runs: 96.0% and 97.0%);
``--backbone tiny-llava-next --warm-size 336x336 --warm-share 0.4 --position-share 0.4`` (85.6% and 84.2%, below;
without ``--position-share``: 86.8%, position questions 60%, leaning to "left" and "top" at every size, and a second
run of 2026-11-27 80.6%, position 56%: NeXT's training is noisy);
``--backbone tiny-llava-onevision --warm-size 336x336 --warm-share 0.3 --position-share 0.5 --steps 8400`` (two
replicas, sweep7, 1585 s and 1468 s: 93.2% shipped and 92.8%, 0.4 points apart;
``benchmarks/results/2026-11-28-gpu-h200-train_demo-sweep7-finished.json`` and
``2026-11-29-gpu-h200-train_demo-sweep7-second-replica.json``; with ``--position-share 0.4 --steps 8000``: 95.2% and
90.0%, position 91% and 66%, sweep6; with ``--warm-share 0.4 --steps 6000``: 90.4% and 84.4%, sweep5; without the
position share, 5000 steps: 82.6% and 81.8%, position 51% and 47%, sweep2). ``--position-targets
base-view`` (the dense loss asks only the base view's tokens for their row and column) did not help NeXT: 81.6% and
75.8% at 336x336, 81.8% mixed with the warm-up.

Position questions kept NeXT, OneVision and Qwen2.5-VL under 85%. A linear probe reads a token's half of the image
from the rows the language model gets (91-98% for NeXT, 90-99% for Qwen2.5-VL), so the tower and projector keep it;
with the recipe's mix of questions the language models do not learn to read it, except Qwen3-VL's (98-100%), whose
interleaved multimodal rope lets attention pick rows and columns (Qwen2.5-VL's sections give the width the six
slowest of 16 frequencies: under 0.005 rad across a row of 24 tokens). ``--position-share S`` makes each batch
question one about position with probability S instead of about one in five. As a 400-step fine-tune of the
Qwen2.5-VL run on a CPU (tower frozen, 336x336) it did not help: position 60% at S = 0.8, against 66.7% before and
63.3% with the text rope's theta lowered to 100 (the sweep2 results file). In full trainings
(``benchmarks/results/2026-11-27-gpu-4xh200-train_demo-sweep3.json``) S = 0.4 with NeXT's warm-up answered 85.6% and
84.2% (position 89% and 79%): the shipped ``tiny-llava-next``; Qwen2.5-VL learned position (93%) but not shapes (42%)
in 5000 steps. With NeXT's warm-up as well (``--backbone tiny-qwen2.5-vl --vision-attention packed --warm-size 336x336
--warm-share 0.4 --position-share 0.4``; two runs side by side on one H200, 822 s each,
``benchmarks/results/2026-11-27-gpu-h200-train_demo-qwen25-warm-position.json``) it answered 95.2% and 94.2% (position
99% and 86%): the shipped ``tiny-qwen2.5-vl``. The same warm-up (one 448 px tile) and share on InternVL3
(``--backbone tiny-internvl3 --warm-size 448x448 --warm-share 0.4 --pool-device cpu --position-share 0.4``; two runs,
one per H200 of a 4-GPU host, 1192 s each, ``benchmarks/results/2026-11-27-gpu-4xh200-train_demo-sweep4.json``)
answered 80.8% and 80.2% ("is there" 62% and 57% its weakest type), below 85%; a longer warm-up
(``--warm-share 0.55 --position-share 0.3 --steps 6000``, sweep6, 1115 s each) answered 90.2% ("is there" 88%) and
77.6%, 12.6 points apart; with ``--steps 7200`` (sweep7, 1674 s and 1669 s) 91.4% and 91.2%: the first is the shipped
``tiny-internvl3``. On OneVision at 5000 steps (``--warm-size
336x336 --warm-share 0.4 --pool-device cpu --position-share 0.4``) it answered 82.0% and 73.0%, position 64% and 49%;
with 8000 and 8400 steps, the runs above.

Measured variant, not shipped (``--subset-share 0 --flip``: all visual tokens in every step, as a real VLM is
trained, and mirrored images; two runs of seed 0 side by side on one H200, 2026-11-26,
``benchmarks/results/2026-11-26-gpu-h200-train_demo-variant.json``): held-out 85.6% and 91.0% with all tokens (the
two runs differ by 5 points: GPU training is not bit-reproducible, and this recipe is less stable), but at K = 64
random selection answers 19-22% and ``care`` 18-21%: a model never shown reduced token sets cannot read them, so
it tells methods apart no better than chance.

Measured variant, not shipped (``--merge-share 0.5`` / ``1.0`` with ``--steps 4000``: in that share of the subset
steps the dropped tokens are averaged into their nearest kept token, as merging methods hand a language model
mixtures; two runs side by side on one H200, 2026-11-26,
``benchmarks/results/2026-11-26-gpu-h200-train_demo-merge-variant.json``). Held-out accuracy with all tokens was
84.2% / 80.0%, random at K = 64 68.4% / 65.0%, and ``care`` at K = 64 54.8% / 52.8%. On 150 held-out questions
the 0.5 model gave ``tome`` 79.3%, ``simple-calib`` 78.0% and ``divprune`` 75.3%, but ``care`` and ``prca-only``
both 53.3%. The model reads merged rows well, so the gap is PRCA's anchors, which sit on background texture on
this demo. Calibrating into them adds nothing.

Writes DIR/<backbone>.safetensors (float16, the file that ships), DIR/model/ (a loadable model folder),
DIR/<backbone>.json (command, time, device, held-out accuracy per question type, with all tokens and with random
selection and care at K=64), DIR/checkpoint.pt while training and DIR/log.txt (written as the run goes).
"""
