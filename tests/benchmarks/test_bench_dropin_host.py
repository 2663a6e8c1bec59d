"""The drop-in host benchmark's meter: operators and seconds per step (counts written by hand, a nested step's
operators counted in its caller too), and its wrappers gone after the block, from the model class and the module."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

import care_core.dropin
from benchmarks import bench_dropin_host as bench
from benchmarks.bench_host_path import OpCounter


def test_each_step_gets_its_own_operators_and_a_caller_those_of_its_callees() -> None:
    meter = bench.StepMeter()
    inner = meter.wrap("inner", lambda: torch.ones(3).sum())
    outer = meter.wrap("outer", lambda: inner() + torch.zeros(2).sum())
    with torch.no_grad(), OpCounter() as counter:
        meter.counter = counter
        outer()
    assert meter.ops["inner"] == {"ones": 1, "sum": 1}
    assert meter.ops["outer"] == {"ones": 1, "sum": 2, "zeros": 1, "add": 1}
    assert set(meter.seconds) == {"inner", "outer"} and meter.seconds["outer"] >= meter.seconds["inner"] > 0


class _Model:
    def generate(self) -> str:
        return "answer"


class _Reduction:
    def _reduce(self) -> str:  # a method of the class: wrapped on the instance, removed after
        return "reduced"


def test_the_block_leaves_every_step_and_the_models_generate_as_it_found_them() -> None:
    reduction: Any = _Reduction()
    reduction._question = lambda: "question"  # an instance's own attribute: put back after
    own_question = reduction._question
    reduction.adapter, reduction.method, reduction._pipeline = SimpleNamespace(), SimpleNamespace(), SimpleNamespace()
    reduction.model = _Model()
    module_step, class_generate = care_core.dropin._image_span, _Model.generate
    meter = bench.StepMeter()
    with bench.metered(reduction, meter):
        assert reduction._reduce() == "reduced" and reduction.model.generate() == "answer"
        assert care_core.dropin._image_span is not module_step and _Model.generate is not class_generate
    assert set(meter.seconds) == {"_reduce", "generate"}
    assert care_core.dropin._image_span is module_step and _Model.generate is class_generate
    assert "_reduce" not in vars(reduction) and reduction._question is own_question
