"""Backbone specs: the published numbers, names, and `from_config` on llava / llava_next / qwen2_5_vl configs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from care_core.backbones.qwen3_5.demo import build_tiny_qwen3_5
from care_core.errors import CareError
from care_core.flops.specs import KNOWN_BACKBONES, BackboneSpecError, from_config, resolve_backbone

LLAVA_HF_7B = {  # llava-hf/llava-1.5-7b-hf config.json (text_config names Vicuna and sets only the vocab)
    "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
    "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu",
    "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                    "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                    "torch_dtype": "float16", "vocab_size": 32064},
    "tie_word_embeddings": False, "torch_dtype": "float16",
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                      "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
}  # fmt: skip
QWEN_7B = {  # Qwen/Qwen2.5-VL-7B-Instruct config.json (text fields at the top level)
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_size": 3584,
    "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "vocab_size": 152064, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
}  # fmt: skip


def _write(folder: Path, data: object, name: str = "config.json") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_published_numbers() -> None:
    lm = {
        name: (s.lm.layers, s.lm.hidden, s.lm.intermediate, s.lm.heads, s.lm.kv_heads)
        for name, s in KNOWN_BACKBONES.items()
    }
    assert lm == {
        "llava-1.5-7b": (32, 4096, 11008, 32, 32), "llava-1.5-13b": (40, 5120, 13824, 40, 40),
        "llava-next-7b": (32, 4096, 11008, 32, 32), "llava-next-13b": (40, 5120, 13824, 40, 40),
        "qwen2.5-vl-3b": (36, 2048, 11008, 16, 2), "qwen2.5-vl-7b": (28, 3584, 18944, 28, 4),
        "qwen3-vl-8b": (36, 4096, 12288, 32, 8),
        "internvl3-8b": (28, 3584, 18944, 28, 4),
        "llava-onevision-7b": (28, 3584, 18944, 28, 4),
        "qwen3.5-9b": (32, 4096, 12288, 16, 4), "qwen3.5-27b": (64, 5120, 17408, 24, 4),
        "gemma3-4b": (34, 2560, 10240, 8, 4), "gemma3-12b": (48, 3840, 15360, 16, 8),  # GEMMA3_4B_HUB below
    }  # fmt: skip
    internvl = KNOWN_BACKBONES["internvl3-8b"]
    assert internvl.projector.linears == ((4096, 3584), (3584, 3584)) and internvl.projector.layer_norm == 4096
    assert (internvl.vision.layers, internvl.vision.hidden, internvl.vision.intermediate) == (24, 1024, 4096)
    assert KNOWN_BACKBONES["llava-1.5-7b"].projector.linears == ((1024, 4096), (4096, 4096))
    assert KNOWN_BACKBONES["llava-1.5-13b"].projector.linears == ((1024, 5120), (5120, 5120))
    assert KNOWN_BACKBONES["qwen2.5-vl-7b"].projector.linears == ((5120, 5120), (5120, 3584))
    assert KNOWN_BACKBONES["qwen2.5-vl-3b"].projector.linears == ((5120, 5120), (5120, 2048))
    assert KNOWN_BACKBONES["llava-1.5-7b"].vision.layers == 24 and KNOWN_BACKBONES["qwen2.5-vl-7b"].vision.layers == 32


@pytest.mark.parametrize(("name", "full"), [("llava-1.5", "llava-1.5-7b"), ("llava-next", "llava-next-7b"),
                                            ("qwen2.5-vl", "qwen2.5-vl-7b"), ("LLaVA-1.5-13B", "llava-1.5-13b"),
                                            ("Qwen/Qwen2.5-VL-3B-Instruct", "qwen2.5-vl-3b"),
                                            ("qwen3-vl", "qwen3-vl-8b"), ("qwen3.5", "qwen3.5-9b"),
                                            ("Qwen/Qwen3.5-27B", "qwen3.5-27b"),
                                            ("Qwen/Qwen3-VL-8B-Instruct", "qwen3-vl-8b"),
                                            ("internvl3", "internvl3-8b"),
                                            ("OpenGVLab/InternVL3-8B-hf", "internvl3-8b")])  # fmt: skip
def test_names(name: str, full: str) -> None:
    assert resolve_backbone(name).name == full


def test_unknown_name_suggests() -> None:
    with pytest.raises(BackboneSpecError, match="did you mean llava-next"):
        resolve_backbone("llava-nxt")
    with pytest.raises(BackboneSpecError, match="no such file"):
        resolve_backbone("./missing/config.json")


def test_qwen3_vl_config_gives_the_registry_dims_and_its_processor_budget(tmp_path: Path) -> None:
    config = {"model_type": "qwen3_vl",
              "text_config": {"hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
                              "num_hidden_layers": 36, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936},
              "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                                "out_hidden_size": 4096, "patch_size": 16, "spatial_merge_size": 2,
                                "deepstack_visual_indexes": [8, 16, 24]}}  # fmt: skip
    folder = tmp_path / "qwen3"
    _write(folder, config)
    spec, ref = from_config(folder), KNOWN_BACKBONES["qwen3-vl-8b"]
    assert (spec.lm, spec.projector, spec.vision, spec.family) == (ref.lm, ref.projector, ref.vision, "qwen3-vl")
    assert spec.display == "Qwen3-VL-8B" and spec.default_tokens == 1024
    _write(folder, {"size": {"shortest_edge": 1024, "longest_edge": 4096}}, "preprocessor_config.json")
    assert (from_config(folder).min_pixels, from_config(folder).max_pixels) == (1024, 4096)


def test_llava_hf_config_resolves_to_vicuna_dims(tmp_path: Path) -> None:
    spec = from_config(_write(tmp_path / "llava", LLAVA_HF_7B))
    ref = KNOWN_BACKBONES["llava-1.5-7b"]
    assert (spec.lm, spec.projector, spec.vision) == (ref.lm, ref.projector, ref.vision)
    assert spec.paper_key == "LLaVA-1.5-7B" and spec.default_tokens == 576
    assert spec.family == ref.family == "llava-1.5"  # model_type "llava": the family's one spelling
    assert from_config(tmp_path / "llava").lm == ref.lm  # the folder works too


@pytest.mark.parametrize(("feature_layer", "layers_run"), [(-2, 23), (-1, None), ([-2, -5], 23), (3, 3)])
def test_a_llava_config_counts_its_tower_up_to_the_deepest_feature_layer(
    tmp_path: Path, feature_layer: object, layers_run: int | None
) -> None:
    spec = from_config(_write(tmp_path / "llava", {**LLAVA_HF_7B, "vision_feature_layer": feature_layer}))
    assert spec.vision.layers_run == layers_run and spec.vision.layers == 24


@pytest.mark.parametrize("feature_layer", [25, -26, [], "last"])
def test_a_llava_feature_layer_outside_the_tower_is_refused(tmp_path: Path, feature_layer: object) -> None:
    with pytest.raises(BackboneSpecError, match="vision_feature_layer"):
        from_config(_write(tmp_path / "llava", {**LLAVA_HF_7B, "vision_feature_layer": feature_layer}))


def test_llava_next_and_qwen_configs(tmp_path: Path) -> None:
    pins = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
    nxt = from_config(_write(tmp_path / "next", {**LLAVA_HF_7B, "model_type": "llava_next",
                                                 "image_grid_pinpoints": pins}))  # fmt: skip
    assert nxt.paper_key == "LLaVA-NeXT-7B" and nxt.default_tokens == 2880 and nxt.family == "llava-next"
    qwen = from_config(_write(tmp_path / "qwen", QWEN_7B))
    assert qwen.family == "qwen2.5-vl"
    ref = KNOWN_BACKBONES["qwen2.5-vl-7b"]
    assert (qwen.lm, qwen.projector, qwen.vision) == (ref.lm, ref.projector, ref.vision)
    _write(tmp_path / "qwen", {"min_pixels": 200704, "max_pixels": 1003520}, "preprocessor_config.json")
    assert from_config(tmp_path / "qwen").max_pixels == 1003520


ONEVISION_7B = {  # the llava-onevision-qwen2-7b-ov-hf shape as transformers' config class describes it (no hub file)
    "model_type": "llava_onevision", "vision_feature_layer": -1, "vision_feature_select_strategy": "full",
    "vision_aspect_ratio": "anyres_max_9",
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
                      "num_hidden_layers": 26, "num_attention_heads": 16, "image_size": 384, "patch_size": 14},
    "text_config": {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                    "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064},
}  # fmt: skip


def test_llava_onevision_spec_and_config(tmp_path: Path) -> None:
    ref = KNOWN_BACKBONES["llava-onevision-7b"]
    assert ref.projector.linears == ((1152, 3584), (3584, 3584)) and ref.projector.kind == "mlp2x_gelu"
    assert (ref.vision.kind, ref.vision.layers, ref.vision.feature_tokens, ref.max_crops) == ("siglip", 26, 729, 9)
    assert len(ref.grid_pinpoints) == 36 and {p for pin in ref.grid_pinpoints for p in pin} == set(
        range(384, 2305, 384)
    )
    assert ref.default_tokens == 729 + 54 * 54 and ref.default_image == (768, 768)  # 2x2 crops, nothing unpadded
    assert resolve_backbone("llava-onevision") == ref
    spec = from_config(_write(tmp_path / "ov", ONEVISION_7B))
    assert (spec.lm, spec.projector, spec.vision, spec.grid_pinpoints) == (ref.lm, ref.projector, ref.vision,
                                                                           ref.grid_pinpoints)  # fmt: skip
    assert spec.family == "llava-onevision" and spec.display == "LLaVA-OneVision-7B" and spec.default_tokens == 3645


#: google/gemma-3-4b-it's config.json as transformers' conversion script writes it (convert_gemma3_weights.py,
#: _VARIANTS["gemma3_4b"] and _VISION_CONFIG): text_config states only what differs from Gemma3TextConfig's
#: defaults (8 heads, 4 KV heads, head_dim 256, vocab 262144 + 64 image rows = 262208 are those defaults)
GEMMA3_4B_HUB = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "mm_tokens_per_image": 256,
    "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
    "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                    "num_hidden_layers": 34, "sliding_window": 1024,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
                      "num_hidden_layers": 27, "num_attention_heads": 16, "image_size": 896, "patch_size": 14,
                      "vision_use_head": False},
}  # fmt: skip
#: google/gemma-3-12b-it's: the same script's _VARIANTS["gemma3_12b"] (it states its heads, 16 and 8 KV)
GEMMA3_12B_HUB = {**GEMMA3_4B_HUB, "text_config": {
    "model_type": "gemma3_text", "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
    "num_attention_heads": 16, "num_key_value_heads": 8, "sliding_window": 1024,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}}  # fmt: skip


#: a tiny Gemma 3: head_dim 32 with 2 heads, so q_dim 64 differs from the hidden 48 (as in the real ones)
TINY_GEMMA3_TEXT = {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 2,
                    "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 1000}  # fmt: skip
TINY_GEMMA3_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                      "image_size": 56, "patch_size": 14}  # fmt: skip


@pytest.mark.parametrize(("config", "name"), [(GEMMA3_4B_HUB, "gemma3-4b"), (GEMMA3_12B_HUB, "gemma3-12b")])
def test_gemma3_hub_configs_read_as_the_published_specs(tmp_path: Path, config: dict, name: str) -> None:
    spec, ref = from_config(_write(tmp_path, config)), KNOWN_BACKBONES[name]
    assert (spec.lm, spec.projector, spec.vision) == (ref.lm, ref.projector, ref.vision)
    assert (spec.lm.head_dim, spec.lm.vocab, spec.lm.q_dim) == (256, 262208, 256 * spec.lm.heads)  # not H / heads
    assert spec.family == "gemma3" and spec.default_tokens == 256 and spec.display == ref.display
    assert ref.projector.linears == ((1152, ref.lm.hidden),) and ref.vision.feature_tokens == 256


def test_gemma3_config_saved_by_transformers_gives_its_sizes(tmp_path: Path) -> None:
    """A tiny Gemma3Config written by save_pretrained: the reader takes every size from the file, the tokens from
    mm_tokens_per_image (one 56 px view of 14 px patches, 4x4 patches pooled to 2x2 = 4)."""
    from transformers import Gemma3Config

    Gemma3Config(text_config=TINY_GEMMA3_TEXT, vision_config=TINY_GEMMA3_VISION,
                 mm_tokens_per_image=4).save_pretrained(tmp_path)  # fmt: skip
    spec = from_config(tmp_path)
    lm = spec.lm
    assert (lm.layers, lm.hidden, lm.intermediate, lm.heads, lm.kv_heads, lm.head_dim, lm.vocab) == (
        2, 48, 96, 2, 1, 32, 1000)  # fmt: skip
    assert (spec.vision.kind, spec.vision.layers, spec.vision.hidden, spec.vision.intermediate) == ("siglip", 1, 32, 64)
    assert (spec.vision.image_size, spec.vision.patch_size, spec.default_tokens) == (56, 14, 4)
    assert spec.projector.linears == ((32, 48),) and spec.family == "gemma3"


def test_unmatched_config_has_no_paper_rows(tmp_path: Path) -> None:
    data = {**LLAVA_HF_7B, "text_config": {**LLAVA_HF_7B["text_config"], "num_hidden_layers": 2}}
    spec = from_config(_write(tmp_path / "small", data))
    assert spec.lm.layers == 2 and spec.paper_key is None


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"model_type": "llava", ', "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"model_type": "bert"}', "not supported"),
        ('{"model_type": "llava", "text_config": "x"}', "malformed"),
        ('{"model_type": "llava", "text_config": {"model_type": "llama", "hidden_size": -4}}', "malformed"),
    ],
)
def test_malformed_configs(tmp_path: Path, content: str, message: str) -> None:
    with pytest.raises(CareError, match=message):
        from_config(_write(tmp_path, content))


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(BackboneSpecError, match=r"no config\.json"):
        resolve_backbone(str(tmp_path))


def test_internvl_config_and_its_tile_limit(tmp_path: Path) -> None:
    config = {"model_type": "internvl", "downsample_ratio": 0.5,
              "vision_config": {"hidden_size": 1024, "image_size": [448, 448], "patch_size": [14, 14],
                                "num_hidden_layers": 24, "intermediate_size": 4096, "num_attention_heads": 16},
              "text_config": {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28,
                              "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
                              "vocab_size": 151674}}  # fmt: skip
    spec = from_config(_write(tmp_path / "internvl", config))
    ref = KNOWN_BACKBONES["internvl3-8b"]
    assert (spec.lm, spec.projector, spec.vision, spec.family) == (ref.lm, ref.projector, ref.vision, "internvl3")
    assert spec.default_tokens == 1280  # 672x672: 2x2 tiles + thumbnail, 256 each
    _write(tmp_path / "internvl", {"max_patches": 1}, "preprocessor_config.json")
    assert from_config(tmp_path / "internvl").default_tokens == 256  # one tile, no thumbnail


@pytest.mark.parametrize(("name", "families"), [("llava", ["llava-1.5", "llava-next", "llava-onevision"]),
                                                ("qwen", ["qwen2.5-vl", "qwen3-vl"]),
                                                ("Qwen", ["qwen2.5-vl", "qwen3-vl"])])  # fmt: skip
def test_a_name_that_begins_several_families_is_ambiguous(name: str, families: list[str]) -> None:
    with pytest.raises(BackboneSpecError, match="ambiguous") as info:
        resolve_backbone(name)
    assert all(family in str(info.value) for family in families), info.value


@pytest.mark.parametrize("typo", ["llava15x", "llava-1.6x", "llava-nxt", "qwen25-vlx", "lava", "internvl"])
def test_suggestions_name_only_backbones_the_error_lists(typo: str) -> None:
    with pytest.raises(BackboneSpecError) as info:
        resolve_backbone(typo)
    message = str(info.value)
    suggested = re.search(r"did you mean (.*?)\?", message)
    listed = re.search(r"known: (.*?);", message)
    assert suggested and listed, message
    assert set(suggested.group(1).split(", ")) <= set(listed.group(1).split(", ")), message


def _qwen3_5_config(layers: int, hidden: int, intermediate: int, heads: int, value_heads: int) -> dict:
    """A Qwen3.5 config.json as the released checkpoints write it (explicit layer_types, every 4th full)."""
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    text = {
        "model_type": "qwen3_5_text",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "vocab_size": 248320,
        "layer_types": types,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
    }
    vision = {"model_type": "qwen3_5", "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
              "out_hidden_size": hidden, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "deepstack_visual_indexes": []}  # fmt: skip
    return {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
            "vision_config": vision}  # fmt: skip


@pytest.mark.parametrize(("name", "dims"), [("qwen3.5-9b", (32, 4096, 12288, 16, 32)),
                                            ("qwen3.5-27b", (64, 5120, 17408, 24, 48))])  # fmt: skip
def test_a_released_qwen3_5_config_reads_as_its_registry_spec(tmp_path: Path, name: str, dims: tuple) -> None:
    folder = tmp_path / name
    _write(folder, _qwen3_5_config(*dims))
    spec, ref = from_config(folder), KNOWN_BACKBONES[name]
    assert (spec.lm, spec.projector, spec.vision, spec.family) == (ref.lm, ref.projector, ref.vision, "qwen3.5")
    assert spec.display == ref.display
    linear = spec.lm.linear_layers
    assert len(linear) == 3 * dims[0] // 4 and 3 not in linear and linear[:3] == (0, 1, 2)
    assert spec.lm.attention_output_gate and spec.lm.linear_attention.value_heads == dims[4]


def test_the_tiny_qwen3_5_config_reads_its_hybrid_decoder(tmp_path: Path) -> None:
    model, _ = build_tiny_qwen3_5()
    folder = tmp_path / "tiny"
    folder.mkdir()
    model.config.to_json_file(folder / "config.json")
    lm = from_config(folder).lm
    # the demo (demo.tiny_text_config): 4 layers, linear, linear, linear, full; 2 key / 4 value heads of 16, kernel 4;
    # GQA 4 / 2 heads of 32
    assert lm.linear_layers == (0, 1, 2) and lm.layers == 4
    assert (lm.heads, lm.kv_heads, lm.head_dim, lm.hidden) == (4, 2, 32, 64)
    gdn = lm.linear_attention
    assert (gdn.key_heads, gdn.value_heads, gdn.key_head_dim, gdn.value_head_dim, gdn.conv_kernel) == (2, 4, 16, 16, 4)


def test_a_qwen3_5_config_with_a_layer_type_it_cannot_count_is_refused(tmp_path: Path) -> None:
    config = _qwen3_5_config(4, 64, 128, 4, 4)
    config["text_config"]["layer_types"] = ["linear_attention", "sliding_attention", "linear_attention",
                                            "full_attention"]  # fmt: skip
    _write(tmp_path, config)
    with pytest.raises(BackboneSpecError, match="layer_types"):
        from_config(tmp_path)
