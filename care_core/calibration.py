"""CGTC, paper Eq. 4–9: confidence-gated calibration signals injected into the anchors."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from care_core.anchors import cosine_similarity_matrix


@dataclass(frozen=True)
class Calibration:
    """Calibrated anchors and what fed them."""

    tokens: torch.Tensor  # (K, d_v) v_hat, row k belongs to anchors[k]
    residuals: torch.Tensor  # (|R|,) long, residual tokens R, ascending
    confidence: torch.Tensor  # (|R|,) c_r of Eq. 6 (1 for every r when ungated)
    signals: torch.Tensor  # (|R+|,) long, accepted signals R+, ascending
    signal_targets: torch.Tensor  # (|R+|,) long, the anchor each signal feeds most (argmax_j q_rj)


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
    is_anchor = torch.zeros(n, dtype=torch.bool, device=device)
    is_anchor[anchors] = True
    residuals = residual_indices(is_anchor, k, sync_free=device.type == "cuda")
    v_anc = features[anchors]
    if residuals.numel() == 0:
        empty = torch.empty(0, dtype=torch.long, device=device)
        return Calibration(v_anc.clone(), empty, features.new_empty(0), empty, empty)

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
    accepted_at = torch.nonzero(accepted).flatten()  # the one host synchronisation (R+ has a data-dependent size)
    signals = residuals[accepted_at]
    targets = anchors[assignment.argmax(dim=1)[accepted_at]]
    return Calibration(tokens, residuals, confidence, signals, targets)
