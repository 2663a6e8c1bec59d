"""CGTC, paper Eq. 4–9: confidence-gated calibration signals injected into the anchors."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from care_core.anchors import cosine_similarity_matrix, unit_rows


@dataclass(frozen=True)
class Calibration:
    """Calibrated anchors and what fed them. R+ is kept as a mask over R: its size depends on the data, so listing it
    waits for the device, which :attr:`signals` does only when asked (never before the tokens are used)."""

    tokens: torch.Tensor  # (K, d_v) v_hat, row k belongs to anchors[k]
    residuals: torch.Tensor  # (|R|,) long, residual tokens R, ascending
    confidence: torch.Tensor  # (|R|,) c_r of Eq. 6 (1 for every r when ungated)
    accepted: torch.Tensor  # (|R|,) bool, r in R+ (Eq. 6)
    nearest: torch.Tensor  # (|R|,) long, the anchor each residual feeds most (argmax_j q_rj, Eq. 7)

    @property
    def signals(self) -> torch.Tensor:
        """(|R+|,) long, the accepted signals R+, ascending (a wait for the device)."""
        return self.residuals[self.accepted]

    @property
    def signal_targets(self) -> torch.Tensor:
        """(|R+|,) long, the anchor each signal feeds most (a wait for the device)."""
        return self.nearest[self.accepted]


def spatial_affinity(p_res: torch.Tensor, p_anc: torch.Tensor, sigma_p: float) -> torch.Tensor:
    """exp(-||p_r - p_j||^2 / (2 sigma_p^2)), the spatial term of Eq. 4; (|R|, K)."""
    sq_dist = ((p_res[:, None, :] - p_anc[None, :, :]) ** 2).sum(dim=-1)
    return torch.exp(-sq_dist / (2 * sigma_p**2))


def gate_confidence(affinity: torch.Tensor, k: int, *, tau_g: float, tau_c: float, theta_s: float) -> torch.Tensor:
    """c_r = c_sim (1 + c_ent) / 2 from each row's top-k_f affinities (Eq. 5–6)."""
    k_f = min(k, max(2, math.ceil(0.1 * k)))
    top = affinity.topk(k_f, dim=1).values  # descending, top[:, 0] = A_r^(1)
    c_sim = torch.sigmoid((top[:, 0] - theta_s) / tau_c)
    if k_f == 1:
        c_ent = torch.ones_like(c_sim)
    else:
        pi = torch.softmax(top / tau_g, dim=1)
        c_ent = 1 + torch.special.xlogy(pi, pi).sum(dim=1) / math.log(k_f)  # 0 log 0 = 0
    return c_sim * (1 + c_ent) / 2


def residual_indices(is_anchor: torch.Tensor, k: int, *, sync_free: bool) -> torch.Tensor:
    """R: the indices where ``is_anchor`` is False, ascending; ``k`` distinct anchors are marked.

    ``sync_free`` (CUDA): a stable sort puts the N - k residuals first in index order, so their count is known
    without reading the mask back; the rest of the calibration is then queued while the GPU still scores.
    """
    if sync_free:
        return torch.argsort(is_anchor.to(torch.int32), stable=True)[: is_anchor.shape[0] - k]
    return torch.nonzero(~is_anchor).flatten()


def calibrate(
    features: torch.Tensor,
    positions: torch.Tensor,
    anchors: torch.Tensor,
    weights: torch.Tensor,
    *,
    eta: float,
    theta_s: float,
    theta_c: float,
    alpha: float,
    sigma_p: float,
    tau_g: float,
    tau_c: float,
    tau_s: float,
    eps: float,
    gated: bool = True,
) -> Calibration:
    """Calibrate the anchors (ascending `anchors`) with residual tokens, Eq. 4–9.

    `weights` is psi_bar (N,); the anchors are distinct (as Eq. 3 selects them). With `gated=False` every
    residual token is a signal with c_r = 1 (the paper's "simple calibration" ablation). With K = N there is
    nothing to calibrate.
    """
    n = features.shape[0]
    k = anchors.shape[0]
    device = features.device
    # index_fill_ takes True as a kernel argument; ``is_anchor[anchors] = True`` would copy it from the host and wait
    # for all queued work (the scoring) before the rest of the calibration could be queued
    is_anchor = torch.zeros(n, dtype=torch.bool, device=device).index_fill_(0, anchors, True)
    residuals = residual_indices(is_anchor, k, sync_free=device.type == "cuda")
    v_anc = features[anchors]
    if residuals.numel() == 0:
        empty = torch.empty(0, dtype=torch.long, device=device)
        return Calibration(v_anc.clone(), empty, features.new_empty(0), empty.bool(), empty)

    v_res = features[residuals]
    cos_ra = cosine_similarity_matrix(v_res, v_anc, eps)  # (|R|, K)
    if gated:
        affinity = cos_ra + eta * spatial_affinity(positions[residuals], positions[anchors], sigma_p)  # Eq. 4
        confidence = gate_confidence(affinity, k, tau_g=tau_g, tau_c=tau_c, theta_s=theta_s)
        accepted = confidence >= theta_c  # R+ of Eq. 6
    else:
        confidence = torch.ones(residuals.shape[0], dtype=features.dtype, device=device)
        accepted = torch.ones_like(confidence, dtype=torch.bool)
    source_weight = torch.where(accepted, (weights[residuals] + eps) * confidence, 0.0)  # w_r
    assignment = torch.softmax(cos_ra / tau_s, dim=1)  # q_rj over all anchors (Eq. 7)
    mass = source_weight[:, None] * assignment  # P_rj = w_r q_rj
    signal = (mass.T @ v_res) / (mass.sum(dim=0)[:, None] + eps)  # g_j (Eq. 8)
    shifted = v_anc + alpha * signal
    tokens = v_anc.norm(dim=1, keepdim=True) / (shifted.norm(dim=1, keepdim=True) + eps) * shifted  # Eq. 9
    # R+ stays a mask: listing it (a data-dependent size) would wait for the device before the tokens could be used
    return Calibration(tokens, residuals, confidence, accepted, anchors[assignment.argmax(dim=1)])


def _padded(rows: list[torch.Tensor], length: int, fill: float = 0.0) -> torch.Tensor:
    """(B, length, ...) from B tensors of at most ``length`` rows, the rest ``fill``."""
    out = rows[0].new_full((len(rows), length, *rows[0].shape[1:]), fill)
    for i, x in enumerate(rows):
        out[i, : x.shape[0]] = x
    return out


def _on(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small tensor made on the host, on ``device`` without waiting for queued work (a blocking copy would)."""
    return host.to(device, non_blocking=True)


def _batch_confidence(
    affinity: torch.Tensor, anchor_ok: torch.Tensor, ks: list[int], *, tau_g: float, tau_c: float, theta_s: float
) -> torch.Tensor:
    """Eq. 5–6 per residual row of (B, R, K) ``affinity`` over each image's own K_i anchors (k_f per image)."""
    k_fs = [min(k, max(2, math.ceil(0.1 * k))) for k in ks]
    minus_inf = torch.finfo(affinity.dtype).min
    top = affinity.masked_fill(~anchor_ok[:, None, :], minus_inf).topk(max(k_fs), dim=2).values  # (B, R, k_f max)
    in_top = _on(torch.arange(top.shape[2])[None, :] < torch.tensor(k_fs)[:, None], top.device)
    c_sim = torch.sigmoid((top[:, :, 0] - theta_s) / tau_c)
    pi = torch.softmax((top / tau_g).masked_fill(~in_top[:, None, :], float("-inf")), dim=2)
    log_k = _on(torch.tensor([math.log(k) if k > 1 else 1.0 for k in k_fs], dtype=top.dtype), top.device)
    c_ent = 1 + torch.special.xlogy(pi, pi).sum(dim=2) / log_k[:, None]  # 0 log 0 = 0 on the masked slots
    single = _on(torch.tensor([k == 1 for k in k_fs]), top.device)[:, None]
    c_ent = torch.where(single, torch.ones_like(c_ent), c_ent)
    return c_sim * (1 + c_ent) / 2


@dataclass(frozen=True)
class _Layout:
    """Where each image's anchors and residuals sit in the padded batch."""

    rows: torch.Tensor  # (B, 1) batch index
    anchor_index: torch.Tensor  # (B, K max) each image's anchors, pads point at token 0
    anchor_ok: torch.Tensor  # (B, K max) True on real anchors
    residual_index: torch.Tensor  # (B, R max) each image's residuals R, ascending, then whatever
    residual_ok: torch.Tensor  # (B, R max) True on real residuals


def _layout(anchors: list[torch.Tensor], sizes: list[int], device: torch.device) -> _Layout:
    ks = [int(a.shape[0]) for a in anchors]
    counts = [n - k for n, k in zip(sizes, ks, strict=True)]
    n_max, k_max = max(sizes), max(ks)
    anchor_ok = _on(torch.arange(k_max)[None, :] < torch.tensor(ks)[:, None], device)
    anchor_index = _padded(anchors, k_max).long()
    # token n_max is a spare column: the pads mark it, so no pad can overwrite a real anchor's mark
    taken = _on(torch.arange(n_max + 1)[None, :] >= torch.tensor(sizes)[:, None], device)  # padding counts as taken
    taken.scatter_(1, torch.where(anchor_ok, anchor_index, n_max), True)
    residual_index = torch.argsort(taken[:, :n_max].to(torch.int32), dim=1, stable=True)[:, : max(counts)]
    residual_ok = _on(torch.arange(max(counts))[None, :] < torch.tensor(counts)[:, None], device)
    rows = torch.arange(len(anchors), device=device)[:, None]
    return _Layout(rows, anchor_index, anchor_ok, residual_index, residual_ok)


def calibrate_batch(
    features: list[torch.Tensor],
    positions: list[torch.Tensor],
    anchors: list[torch.Tensor],
    weights: list[torch.Tensor],
    *,
    eta: float,
    theta_s: float,
    theta_c: float,
    alpha: float,
    sigma_p: float,
    tau_g: float,
    tau_c: float,
    tau_s: float,
    eps: float,
    gated: bool = True,
) -> list[Calibration]:
    """:func:`calibrate` (Eq. 4–9) for B images at once: residuals and anchors padded to (B, max R_i) and
    (B, max K_i) and masked, every step one batched operation, one host synchronisation for the whole batch.
    Per image, what :func:`calibrate` gives it alone (to the rounding of a batched product)."""
    sizes, ks = [int(v.shape[0]) for v in features], [int(a.shape[0]) for a in anchors]
    if all(n == k for n, k in zip(sizes, ks, strict=True)):  # nothing to calibrate anywhere
        return [calibrate(v, p, a, w, eta=eta, theta_s=theta_s, theta_c=theta_c, alpha=alpha, sigma_p=sigma_p,
                          tau_g=tau_g, tau_c=tau_c, tau_s=tau_s, eps=eps, gated=gated)
                for v, p, a, w in zip(features, positions, anchors, weights, strict=True)]  # fmt: skip
    at = _layout(anchors, sizes, features[0].device)
    rows, n_max = at.rows, max(sizes)
    v, p, w = _padded(features, n_max), _padded(positions, n_max), _padded(weights, n_max)
    v_res, v_anc = v[rows, at.residual_index], v[rows, at.anchor_index]
    cos_ra = unit_rows(v_res, eps) @ unit_rows(v_anc, eps).transpose(1, 2)  # (B, R, K)
    if gated:
        sq_dist = ((p[rows, at.residual_index][:, :, None, :] - p[rows, at.anchor_index][:, None, :, :]) ** 2).sum(-1)
        affinity = cos_ra + eta * torch.exp(-sq_dist / (2 * sigma_p**2))  # Eq. 4
        confidence = _batch_confidence(affinity, at.anchor_ok, ks, tau_g=tau_g, tau_c=tau_c, theta_s=theta_s)
        accepted = (confidence >= theta_c) & at.residual_ok  # R+ of Eq. 6
    else:
        confidence = torch.ones_like(cos_ra[:, :, 0])
        accepted = at.residual_ok
    source_weight = torch.where(accepted, (w[rows, at.residual_index] + eps) * confidence, 0.0)  # w_r
    logits = (cos_ra / tau_s).masked_fill(~at.anchor_ok[:, None, :], float("-inf"))
    assignment = torch.softmax(logits, dim=2)  # q_rj over each image's anchors (Eq. 7)
    mass = source_weight[:, :, None] * assignment  # P_rj = w_r q_rj
    signal = (mass.transpose(1, 2) @ v_res) / (mass.sum(dim=1)[:, :, None] + eps)  # g_j (Eq. 8)
    shifted = v_anc + alpha * signal
    tokens = v_anc.norm(dim=2, keepdim=True) / (shifted.norm(dim=2, keepdim=True) + eps) * shifted  # Eq. 9
    tokens = torch.where(at.residual_ok[:, :1, None], tokens, v_anc)  # K = N: the anchors as they are (calibrate's)
    targets = torch.gather(at.anchor_index, 1, assignment.argmax(dim=2))
    return _split(tokens, at.residual_index, confidence, accepted, targets, sizes, ks)


def _split(tokens: torch.Tensor, residual_index: torch.Tensor, confidence: torch.Tensor, accepted: torch.Tensor,
           targets: torch.Tensor, sizes: list[int], ks: list[int]) -> list[Calibration]:  # fmt: skip
    """Each image's Calibration from the padded batch (no wait for the device: R+ stays a mask)."""
    return [Calibration(tokens[i, :k], residual_index[i, : n - k], confidence[i, : n - k], accepted[i, : n - k],
                        targets[i, : n - k]) for i, (n, k) in enumerate(zip(sizes, ks, strict=True))]  # fmt: skip
