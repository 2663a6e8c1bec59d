"""Optional fused GPU kernels (Triton) for the hot spots of CaRe; every one has a pure-PyTorch twin.

Nothing here imports Triton until a fused kernel runs: ``import care_core`` never does, and on the CPU
(or on ROCm, or without Triton, or with ``CARE_DISABLE_TRITON=1``) the core runs its PyTorch code.

- :mod:`care_core.kernels.jvp`: the jvp engine's MLP path, ``||W2 diag(act'(W1 v_i + b1)) W1 u_x||``
  for every token i and direction x, with the elementwise product fused into the matmul's operand load
  and the squared norm into its epilogue: the (m, N, d_out) products never reach device memory. Used
  for bf16 matmuls; for tf32 only with ``kernel="fused"`` (cuBLAS was faster on an H200).
- :mod:`care_core.kernels.jvp_norm_first`: the same for a norm-first projector (the Qwen mergers, InternVL3's),
  its operand built in registers from the lifted directions and the norm's per-block terms.
- :mod:`care_core.kernels.norm_first_operand`: the norm-first path's second-layer input, written in one pass
  (where the fused kernel above does not run); then the next kernel, or cuBLAS's product and the norm.
- :mod:`care_core.kernels.gemm_norm`: those inputs' norms through the second layer's upper factor R, ``||R t||``
  per row, the product's tiles reduced in the epilogue (never written), each output block's K loop starting at its
  first column (R's zeros skipped).
- :mod:`care_core.kernels.greedy`: Eq. 3's K sequential greedy steps for B images in one launch, one single-block
  program per image over its precomputed cosine Gram matrix: no host synchronisation, no per-step launches.
- :mod:`care_core.kernels.divprune`: DivPrune's max-min greedy for B images in one launch (one program per
  image) over their precomputed distance matrices.
- :mod:`care_core.kernels.vision_rotary`: the Qwen vision towers' rotary embedding of queries and keys in one pass,
  bit for bit transformers' float32 passes (run by :mod:`care_core.backbones.vision_rotary`; not a CaRe kernel, and
  outside the ``kernel`` setting below: it runs wherever the fused kernels may run).
- :mod:`care_core.kernels.quick_gelu`: CLIP's QuickGELU activation in one pass, bit for bit PyTorch's three kernels
  (run by :mod:`care_core.backbones.vision_encoder` for LLaVA-1.5's and LLaVA-NeXT's towers; outside the ``kernel``
  setting, like the rotary kernel).
- :mod:`care_core.kernels.operands`: the weights as the kernels read them (bf16, or rounded to tf32), in PyTorch
  alone, so that a caller's gate can keep them (:meth:`~care_core.kernels.dispatch.KernelGate.operand`).

Which path runs is the ``kernel`` setting (``CaReConfig.kernel``), decided in :mod:`care_core.kernels.dispatch`:
"auto" (fused where it applies and can run), "torch" (never fused) or "fused" (fused wherever it applies, tf32
scoring included; a :class:`~care_core.errors.CareError` where it cannot run). The decision is made on every call;
no module state remembers it. A :class:`~care_core.kernels.dispatch.KernelGate` owned by the caller (e.g. a
:class:`care_core.scoring.Scorer`) may remember which kernels failed to build, for its own lifetime.
"""
