"""Train a demo backbone on the synthetic shapes world (``care_core.synthetic``), evaluate it through the adapter's
own generate path, and write the weights to ship.

    python -m scripts.train_demo --backbone tiny-llava --out DIR              # train + evaluate (GPU: --device cuda)
    python -m scripts.train_demo --backbone tiny-llava-next --out DIR --skip-eval --steps 2000
    python -m scripts.train_demo --backbone tiny-llava-next --out DIR --resume       # continue from DIR's checkpoint
    python -m scripts.train_demo --backbone tiny-llava-next --evaluate-only DIR --questions 500
    python -m scripts.train_demo --backbone tiny-llava-next --install-from DIR    # copy DIR's weights into the package

Run from the repository root (as a module: it imports care_core and ``benchmarks.demo_world`` from there). A progress
bar shows every phase; Ctrl-C stops with one line saying what was saved, and exit code 130. Backbones: the demos whose
registry record names a weights file; the model starts from the record's trained skeleton
(``DemoBackbone.build_trained``, :data:`~care_core.backbones.tiny_parts.TRAINED_SIZES`).

Recipe (seeded, one command). 24,000 scenes of split seed 0 (held-out questions: split seed 1) at the world's mix of
image sizes (``--size mixed``; ``--size HxW`` for one size) are drawn by worker processes and kept as the processor's
uint8 output, one tensor per bucket of token geometry (``buckets.py``; ``--pool-device cpu`` keeps them in host
memory). Each step draws a bucket by its share of the scenes, runs the family's own tower with gradients
(``adapter.batch_features`` / ``batch_tokens``), projects, and feeds the language model the adapter's own prompt with
the visual rows where the adapter puts them (rope positions, newline rows and DeepStack rows included), then
`` answer`` and the end token; the loss is on the answer tokens. A dense auxiliary head (not shipped) asks each token's
features for the colour and shape under its centre and for its row and column. After the first 30% of the steps,
half the steps feed a random subset of the visual tokens (K log-uniform in 48..N, raster or shuffled, fed as
reduction feeds them), so that the language model reads whatever rows it is given. AdamW (lr 1.5e-3, cosine, 5%
warm-up), 5000 steps unless ``--steps``; ``--warm-size``/``--warm-share`` train at one size first;
``--position-share`` asks more position questions. A step whose gradient is not finite is skipped and logged; a
checkpoint (DIR/checkpoint.pt) is written every ``--checkpoint-every`` steps after checking the weights are finite,
and ``--resume`` continues from it bit for bit (CPU float32).

Log, every 250 steps: the answer loss, ``token acc`` and ``answer acc`` (every answer token right: what greedy
decoding answers right; read this one, since the byte tokenizer's later answer tokens do not depend on the image).

Replicas. ``--replicas N`` trains N runs of one command at once for the reproduction check: the pool is drawn once,
then one forked process per run trains in OUT/run-k on GPU k modulo the GPUs there (the parent never touches CUDA
and runs on one thread: a process forked after OpenMP ran on several threads hangs). ``--sequential`` runs them one
after another from the same drawing. Runs of one seed differ on a GPU and not on the CPU.

Memory and cost: the pool takes about 8 GB for ``tiny-llava``, 28-34 GB for NeXT, OneVision and the Qwen families and
about 82 GB for InternVL3 (which needs ``--pool-device cpu``) and about 58 GB for Gemma 3's 896 px views;
``python -m scripts.train_demo.bench_step`` measures
seconds per step. ``--vision-attention packed`` runs Qwen2.5-VL's windowed attention as one call per segment length.

The shipped runs, their commands, times and second runs, and why the recipe is what it is (the measured variants
that were not shipped included): docs/demo.md and docs/design/demos.md.

Writes DIR/<backbone>.safetensors (float16, the file that ships), DIR/model/ (a loadable model folder),
DIR/<backbone>.json (command, time, device, held-out accuracy per question type, with all tokens and with random
selection and care at K=64), DIR/checkpoint.pt while training and DIR/log.txt (written as the run goes).
"""
