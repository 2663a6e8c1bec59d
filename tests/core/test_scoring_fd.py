"""The fd engine (Eq. 1) on a Linear-act-Linear projector shares the first layer by linearity and subtracts before
the second (optionally through W2's triangular factor): the literal Eq. 1 values, checked against a literal
computation written here, one (direction, token) at a time; any other projector still runs literally."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from care_core.scoring import Scorer, joint_responses, perturbation_responses, triangular_factor, unit_directions

H = 0.01  # ZOO-Prune's step: the largest cancellation of the engine's uses


def _literal(features: torch.Tensor, projector: nn.Module, directions: torch.Tensor, h: float) -> torch.Tensor:
    """C[x, i] = ||M(v_i + h u_x) - M(v_i - h u_x)|| / 2h, one direction at a time through the whole projector."""
    with torch.no_grad():
        rows = [(projector(features + h * u) - projector(features - h * u)).norm(dim=-1) / (2 * h) for u in directions]
    return torch.stack(rows)


def _sequential(act: nn.Module, d_out: int = 40) -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(12, 32), act, nn.Linear(32, d_out)).double().eval()


def _llava() -> nn.Module:
    from transformers import LlavaConfig
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    vision = {"model_type": "clip_vision_model", "hidden_size": 12, "num_attention_heads": 2}
    config = LlavaConfig(text_config={"model_type": "llama", "hidden_size": 32}, vision_config=vision)
    torch.manual_seed(4)
    return LlavaMultiModalProjector(config).double().eval()


PROJECTORS = {
    "gelu": lambda: _sequential(nn.GELU()),
    "tanh-gelu-narrow-out": lambda: _sequential(nn.GELU(approximate="tanh"), d_out=20),  # d_out < d_h: R trapezoidal
    "silu": lambda: _sequential(nn.SiLU()),
    "llava": _llava,
}


def _problem(n: int = 90, m: int = 11, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 12, generator=g, dtype=torch.float64) * 2, unit_directions(m, 12, seed, dtype=torch.float64)


@pytest.mark.parametrize("name", PROJECTORS)
@pytest.mark.parametrize("through_factor", [False, True])
def test_mlp_path_gives_the_literal_eq1_values_in_float64(name: str, through_factor: bool) -> None:
    projector = PROJECTORS[name]()
    features, u = _problem()
    factor = triangular_factor(projector.state_dict()[_second_weight(projector)]) if through_factor else None
    got = perturbation_responses(features, projector, u, h=H, engine="fd", factor=factor)
    torch.testing.assert_close(got, _literal(features, projector, u, H), rtol=2e-12, atol=0)


def _second_weight(projector: nn.Module) -> str:
    return "2.weight" if isinstance(projector, nn.Sequential) else "linear_2.weight"


@pytest.mark.parametrize("name", ["gelu", "llava"])
@pytest.mark.parametrize("second_layer", ["dense", "triangular"])
def test_mlp_path_in_float32_is_within_float32_rounding_and_no_worse_than_the_literal(
    name: str, second_layer: str
) -> None:
    projector = PROJECTORS[name]()
    features, u = _problem(n=120, m=16, seed=6)
    exact = _literal(features, projector, u, H)
    projector32 = PROJECTORS[name]().float()
    got = Scorer(projector32, second_layer=second_layer).responses(features.float(), u.float(), h=H, engine="fd")
    assert got.dtype == torch.float32
    error = ((got.double() - exact).abs() / exact).max().item()
    literal32 = _literal(features.float(), projector32, u.float(), H)
    literal_error = ((literal32.double() - exact).abs() / exact).max().item()
    assert error < 3e-4  # float32 roundings of the pre-activations (~1e-7 relative), divided by h
    assert error <= literal_error  # the difference is taken before W2, which no longer amplifies two roundings


class _Rows:
    """Counts the rows a module's forward sees."""

    def __init__(self, module: nn.Module) -> None:
        self.rows: list[int] = []
        module.register_forward_hook(lambda _m, args, _out: self.rows.append(int(args[0].shape[0])))


def test_mlp_path_runs_the_first_layer_once_on_the_tokens_and_never_the_whole_projector() -> None:
    projector = _sequential(nn.GELU())
    first, second, whole = _Rows(projector[0]), _Rows(projector[2]), _Rows(projector)
    features, u = _problem(n=50, m=7)
    perturbation_responses(features, projector, u, h=H, engine="fd")
    assert first.rows == [50] and second.rows == [] and whole.rows == []  # W1 u and W2 t go through the weights


class _LayerNormed(nn.Module):
    """LayerNorm, then an MLP: not Linear-act-Linear, so Eq. 1 runs literally."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(12), _sequential(nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm(x))


@pytest.mark.parametrize(
    "make",
    [_LayerNormed, lambda: _sequential(nn.Softmax(dim=-1))],  # a row-wise softmax is no elementwise activation
    ids=["layernorm-mlp", "softmax-mlp"],
)
def test_other_projectors_run_eq1_literally_with_two_passes_per_direction(make) -> None:
    projector = make().double()
    whole = _Rows(projector)
    features, u = _problem(n=40, m=6)
    r = triangular_factor(torch.randn(40, 32, dtype=torch.float64))  # ignored: no MLP path to use it
    got = perturbation_responses(features, projector, u, h=H, engine="fd", factor=r)
    # one row to read the output width, then every perturbed point of the chunk (6 directions x 40 tokens) through
    # the projector, at +h and at -h
    assert whole.rows == [1, 6 * 40, 6 * 40]
    torch.testing.assert_close(got, _literal(features, projector, u, H), rtol=1e-12, atol=0)


def test_joint_passes_through_the_factor_give_each_image_its_literal_responses() -> None:
    projector = _sequential(nn.GELU())
    r = triangular_factor(projector[2].weight)
    images = [_problem(n=n, seed=n)[0] for n in (30, 45, 28)]
    _, u = _problem(m=9)
    got = joint_responses(images, projector, u, h=H, engine="fd", max_rows=80, factor=r)
    for c, v in zip(got, images, strict=True):
        torch.testing.assert_close(c, _literal(v, projector, u, H), rtol=2e-12, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("through_factor", [False, True])
def test_tf32_second_layer_on_cuda_stays_within_a_thousandth_of_eq1(through_factor: bool) -> None:
    """On CUDA "auto" runs the second layer's product on the float32 difference in tf32: relative to Eq. 1 in
    float64 it errs by about 1e-3 of the response, not of the two large terms (their difference is formed first)."""
    projector = _llava()
    features, u = _problem(n=300, m=16)
    exact = _literal(features, projector, u, H)
    gpu = projector.float().cuda()
    factor = triangular_factor(gpu.linear_2.weight) if through_factor else None
    got = perturbation_responses(features.float().cuda(), gpu, u.float().cuda(), h=H, engine="fd", factor=factor,
                                 matmul="auto")  # fmt: skip
    assert torch.allclose(got.double().cpu(), exact, rtol=5e-3, atol=0)
