"""Plain, independent reference implementation of CaRe (paper Eq. 1-9) and CSR (Supp. A).

This module shares no code with ``care_core``. It is written line by line from the paper
and from ``docs/design/care.md`` and ``docs/design/measures.md`` (§Budget to §Numerics, §CSR), in float64 numpy.
Loops are used where they keep the equations obvious; simple numpy vectorisation is used
only where a pure Python loop would be far too slow (the projector, the cosine matrix).

The projector is the two-layer GELU MLP ``M(x) = W2 @ gelu(W1 @ x + b1) + b2`` with the
exact (erf) GELU, computed with ``math.erf`` element by element.

torch is used for exactly one thing: the default direction draw, whose recipe is fixed by
``docs/design/care.md §Directions`` (a CPU ``torch.Generator`` seeded with ``seed``).
"""

from __future__ import annotations

import math

import numpy as np

DEFAULTS: dict = {
    "h": 5e-4,
    "m": 64,
    "lam": 0.5,
    "eta": 0.45,
    "theta_s": 0.4,
    "theta_c": 0.9,
    "alpha": 0.15,
    "sigma_p": 0.2,
    "tau_g": 0.07,
    "tau_c": 0.1,
    "tau_s": 0.07,
    "eps": 1e-8,
    "seed": 42,
    "engine": "fd",
}

_erf = np.vectorize(math.erf, otypes=[np.float64])
_SQRT2 = math.sqrt(2.0)


# --------------------------------------------------------------------------- projector
def gelu(z: np.ndarray) -> np.ndarray:
    """Exact GELU: 0.5 * z * (1 + erf(z / sqrt 2))."""
    z = np.asarray(z, dtype=np.float64)
    return 0.5 * z * (1.0 + _erf(z / _SQRT2))


def gelu_prime(z: np.ndarray) -> np.ndarray:
    """d/dz GELU(z) = Phi(z) + z * phi(z)."""
    z = np.asarray(z, dtype=np.float64)
    Phi = 0.5 * (1.0 + _erf(z / _SQRT2))
    phi = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    return Phi + z * phi


def mlp(X: np.ndarray, W1, b1, W2, b2) -> np.ndarray:
    """M applied to each row of X (n, d_v) -> (n, d_t). W1 is (d_h, d_v), W2 is (d_t, d_h)."""
    pre = X @ W1.T + b1
    return gelu(pre) @ W2.T + b2


# --------------------------------------------------------------------------- budget
def budget(N: int, ratio=None, keep=None) -> int:
    """K = max(1, floor(ratio * N)); exactly one of ratio / keep; keep in 1..N."""
    if (ratio is None) == (keep is None):
        raise ValueError("give exactly one of ratio and keep")
    if ratio is not None:
        ratio = float(ratio)
        if not (ratio > 0.0 and ratio <= 1.0):  # NaN fails both comparisons
            raise ValueError(f"ratio must be in (0, 1], got {ratio}")
        return max(1, math.floor(ratio * N))
    keep = int(keep)
    if keep < 1 or keep > N:
        raise ValueError(f"keep must be in 1..{N}, got {keep}")
    return keep


# --------------------------------------------------------------------------- helpers
def default_directions(m: int, d_v: int, seed: int) -> np.ndarray:
    """docs/design/care.md §Directions: torch.randn(m, d_v, generator=Generator().manual_seed(seed), float64), unit."""
    import torch  # the only use of torch in this module

    g = torch.randn(m, d_v, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    g = g.numpy().astype(np.float64)
    out = np.empty_like(g)
    for x in range(m):
        out[x] = g[x] / math.sqrt(float(np.sum(g[x] * g[x])))
    return out


def cos(a: np.ndarray, b: np.ndarray, eps: float) -> float:
    """cos(a, b) = a.b / (max(||a||, eps) * max(||b||, eps))."""
    na = max(math.sqrt(float(np.dot(a, a))), eps)
    nb = max(math.sqrt(float(np.dot(b, b))), eps)
    return float(np.dot(a, b)) / (na * nb)


def cos_matrix(X: np.ndarray, Y: np.ndarray, eps: float) -> np.ndarray:
    """Matrix of cos(x_i, y_j), same formula as ``cos`` (vectorised for speed)."""
    nx = np.maximum(np.sqrt(np.sum(X * X, axis=1)), eps)
    ny = np.maximum(np.sqrt(np.sum(Y * Y, axis=1)), eps)
    return (X @ Y.T) / (nx[:, None] * ny[None, :])


def softmax(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(z - np.max(z))
    return e / np.sum(e)


def sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


# --------------------------------------------------------------------------- PRCA
def responses_fd(V, W1, b1, W2, b2, U, h) -> np.ndarray:
    """Eq. 1 literally: C[x, i] = ||M(v_i + h u_x) - M(v_i - h u_x)|| / (2h). Shape (m, N)."""
    m = U.shape[0]
    N = V.shape[0]
    C = np.empty((m, N), dtype=np.float64)
    for x in range(m):
        plus = mlp(V + h * U[x][None, :], W1, b1, W2, b2)
        minus = mlp(V - h * U[x][None, :], W1, b1, W2, b2)
        diff = plus - minus
        C[x] = np.sqrt(np.sum(diff * diff, axis=1)) / (2.0 * h)
    return C


def responses_jvp(V, W1, b1, W2, b2, U) -> np.ndarray:
    """h -> 0 limit of Eq. 1: ||J_M(v_i) u_x|| = ||W2 diag(gelu'(W1 v_i + b1)) W1 u_x||."""
    m = U.shape[0]
    N = V.shape[0]
    gp = gelu_prime(V @ W1.T + b1)  # (N, d_h)
    C = np.empty((m, N), dtype=np.float64)
    for x in range(m):
        W1u = W1 @ U[x]  # (d_h,)
        Ju = (gp * W1u[None, :]) @ W2.T  # (N, d_t)
        C[x] = np.sqrt(np.sum(Ju * Ju, axis=1))
    return C


def robust_scores(C: np.ndarray, lam: float, eps: float):
    """Eq. 2 + risk-penalised score + min-max. Returns (Z, psi, psi_bar)."""
    m, N = C.shape
    Z = np.empty_like(C)
    for x in range(m):
        med = float(np.median(C[x]))  # even count: mean of the two middle values
        mad = float(np.median(np.abs(C[x] - med)))
        Z[x] = (C[x] - med) / (mad + eps)
    psi = np.empty(N, dtype=np.float64)
    for i in range(N):
        mu = float(np.sum(Z[:, i])) / m
        sigma = math.sqrt(float(np.sum((Z[:, i] - mu) ** 2)) / m)
        psi[i] = mu - lam * sigma
    lo, hi = float(np.min(psi)), float(np.max(psi))
    psi_bar = (psi - lo) / (hi - lo + eps)
    return Z, psi, psi_bar


def greedy_anchors(V: np.ndarray, psi_bar: np.ndarray, K: int, eps: float):
    """Eq. 3. Returns (anchor_order, margin) where margin is the smallest gap between the
    winning and the runner-up objective over all steps that had a runner-up (inf if none);
    tests use it to make sure inputs are not near-ties."""
    N = V.shape[0]
    D = 1.0 - cos_matrix(V, V, eps)  # D(v_i, v_j) = 1 - cos(v_i, v_j)
    first = int(np.argmax(psi_bar))  # argmax returns the lowest index on ties
    S = [first]
    selected = np.zeros(N, dtype=bool)
    selected[first] = True
    srt = np.sort(psi_bar)[::-1]
    margin = float(srt[0] - srt[1]) if N > 1 else math.inf
    delta = D[:, first].copy()  # delta_i = min_{j in S} D(v_i, v_j)
    while len(S) < K:
        obj = psi_bar * delta
        obj[selected] = -np.inf
        nxt = int(np.argmax(obj))  # lowest index on ties
        cand = np.sort(obj[~selected])[::-1]
        if cand.size > 1:
            margin = min(margin, float(cand[0] - cand[1]))
        S.append(nxt)
        selected[nxt] = True
        delta = np.minimum(delta, D[:, nxt])
    return S, margin


# --------------------------------------------------------------------------- CGTC
def calibrate(V, P, S_sorted, psi_bar, cfg):
    """Eq. 4-9. Returns (tokens (K, d_v), signals (ascending), diagnostics dict)."""
    eps = cfg["eps"]
    N = V.shape[0]
    K = len(S_sorted)
    in_S = set(S_sorted)
    R = [r for r in range(N) if r not in in_S]
    if not R:
        return V[np.asarray(S_sorted, dtype=np.int64)].copy(), [], {"c": {}}

    k_f = min(K, max(2, math.ceil(0.1 * K)))
    c = {}
    for r in R:
        # Eq. 4: affinity to every anchor.
        A = np.empty(K, dtype=np.float64)
        for a, j in enumerate(S_sorted):
            dp = P[r] - P[j]
            A[a] = cos(V[r], V[j], eps) + cfg["eta"] * math.exp(-float(np.dot(dp, dp)) / (2.0 * cfg["sigma_p"] ** 2))
        top = np.sort(A)[::-1][:k_f]
        pi = softmax(top / cfg["tau_g"])
        c_sim = sigmoid((float(top[0]) - cfg["theta_s"]) / cfg["tau_c"])
        if k_f == 1:
            c_ent = 1.0
        else:
            ent = 0.0
            for p in pi:
                if p > 0.0:
                    ent += float(p) * math.log(float(p))
            c_ent = 1.0 + ent / math.log(k_f)  # Eq. 5
        c[r] = c_sim * (1.0 + c_ent) / 2.0  # Eq. 6
    R_plus = [r for r in R if c[r] >= cfg["theta_c"]]

    d_v = V.shape[1]
    num = np.zeros((K, d_v), dtype=np.float64)
    den = np.zeros(K, dtype=np.float64)
    for r in R_plus:
        w_r = (psi_bar[r] + eps) * c[r]
        logits = np.array([cos(V[r], V[j], eps) / cfg["tau_s"] for j in S_sorted])
        q = softmax(logits)  # Eq. 7, over all anchors
        for a in range(K):
            P_rj = w_r * q[a]
            num[a] += P_rj * V[r]
            den[a] += P_rj
    tokens = np.empty((K, d_v), dtype=np.float64)
    for a, j in enumerate(S_sorted):
        g = num[a] / (den[a] + eps)  # Eq. 8
        v_prime = V[j] + cfg["alpha"] * g
        nv = math.sqrt(float(np.dot(V[j], V[j])))
        nvp = math.sqrt(float(np.dot(v_prime, v_prime)))
        tokens[a] = nv / (nvp + eps) * v_prime  # Eq. 9
    return tokens, R_plus, {"c": c, "k_f": k_f}


# --------------------------------------------------------------------------- public
def reference_care(V, W1, b1, W2, b2, P, K, directions=None, cfg=None) -> dict:
    """Full CaRe (PRCA + CGTC) on numpy float64 inputs.

    Returns dict(indices, anchor_order, tokens, signals, psi_bar) plus diagnostics
    (C, margin, c, directions)."""
    full = dict(DEFAULTS)
    if cfg:
        full.update(cfg)
    cfg = full
    V = np.asarray(V, dtype=np.float64)
    P = np.asarray(P, dtype=np.float64)
    W1, b1, W2, b2 = (np.asarray(a, dtype=np.float64) for a in (W1, b1, W2, b2))
    N, d_v = V.shape
    if not 1 <= K <= N:
        raise ValueError("K must be in 1..N")
    if directions is None:
        U = default_directions(cfg["m"], d_v, cfg["seed"])
    else:
        U = np.asarray(directions, dtype=np.float64)

    if cfg["engine"] == "fd":
        C = responses_fd(V, W1, b1, W2, b2, U, cfg["h"])
    elif cfg["engine"] == "jvp":
        C = responses_jvp(V, W1, b1, W2, b2, U)
    else:
        raise ValueError(f"unknown engine {cfg['engine']!r}")
    _, _, psi_bar = robust_scores(C, cfg["lam"], cfg["eps"])
    order, margin = greedy_anchors(V, psi_bar, K, cfg["eps"])
    S_sorted = sorted(order)
    tokens, signals, diag = calibrate(V, P, S_sorted, psi_bar, cfg)
    c = diag["c"]
    gate_margin = min((abs(v - cfg["theta_c"]) for v in c.values()), default=math.inf)
    return {
        "indices": np.asarray(S_sorted, dtype=np.int64),
        "anchor_order": np.asarray(order, dtype=np.int64),
        "tokens": tokens,
        "signals": np.asarray(signals, dtype=np.int64),
        "psi_bar": psi_bar,
        "C": C,
        "margin": margin,
        "gate_margin": gate_margin,
        "c": c,
        "directions": U,
    }


def reference_csr(full, reduced, question) -> float:
    """CSR (Supp. A): L2-normalised rows (zero rows stay zero);
    r_i = max_l [v_i.t_l]_+, w = r / sum r (uniform if sum r == 0),
    c_i = max_j [v_i.s_j]_+, CSR = sum_i w_i c_i."""

    def normalise(X):
        X = np.asarray(X, dtype=np.float64)
        out = np.zeros_like(X)
        for i in range(X.shape[0]):
            n = math.sqrt(float(np.dot(X[i], X[i])))
            if n > 0.0:
                out[i] = X[i] / n
        return out

    V, S, T = normalise(full), normalise(reduced), normalise(question)
    N = V.shape[0]
    r = np.array([max(max(float(np.dot(V[i], t)), 0.0) for t in T) for i in range(N)])
    total = float(np.sum(r))
    w = r / total if total > 0.0 else np.full(N, 1.0 / N)
    c = np.array([max(max(float(np.dot(V[i], s)), 0.0) for s in S) for i in range(N)])
    return float(np.sum(w * c))
