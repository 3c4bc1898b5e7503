"""A checkpoint's config.json and generation_config.json as the worker reads them: every family's fields,
the rope forms transformers and the Hub write, sliding windows, sampling defaults, and an error naming the
file and the field for each thing nanoserve cannot serve, raised before any weight is read."""
import json

import pytest

from nanoserve_model.config import ConfigError, ModelConfig, RopeConfig, SamplingDefaults
from nanoserve_model.registry import read_model_config
from nanoserve_cli.demo_model import SHAPE, config_json
from tests.worker.worker_steps import cpu_runner


def write_config(path, family: str = "qwen3", generation: dict | None = None, **change):
    config = config_json(False, SHAPE, family=family) | change
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not ...}))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def test_every_family_reads_its_shape(tmp_path):
    for family, architecture in (("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                                 ("mistral", "MistralForCausalLM"), ("qwen3", "Qwen3ForCausalLM")):
        config = read_model_config(write_config(tmp_path, family))
        assert (config.architecture, config.hidden_size, config.num_key_value_heads, config.head_dim) == (
            architecture, 64, 2, 16)
        assert (config.attention_bias, config.mlp_bias) == ((True, True) if family == "llama" else (False, False))


def test_the_checkpoint_dtype_is_dtype_or_the_older_torch_dtype(tmp_path):
    assert read_model_config(write_config(tmp_path, dtype=..., torch_dtype="float16")).dtype == "float16"
    assert read_model_config(write_config(tmp_path, dtype="bfloat16", torch_dtype="float16")).dtype == "bfloat16"


@pytest.mark.parametrize("change, message", [
    (dict(architectures=["GPT2LMHeadModel"]), r"config\.json: `architectures` 'GPT2LMHeadModel' is not supported: one "
                                              r"of LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                                              r"Qwen3MoeForCausalLM"),
    (dict(architectures=...), r"config\.json: `architectures` is \[\]; expected one model class name"),
    (dict(quantization_config={"quant_method": "awq", "bits": 4}), r"config\.json: `quantization_config` quant_method "
                                                                   r"'awq' is not supported: nanoserve reads fp8"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), r"config\.json: `rope_scaling` rope_type 'yarn' is not "
                                                              r"supported: one of default, llama3"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4}), r"`rope_parameters` rope_type 'dynamic'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
     r"config\.json: `rope_scaling` of rope_type llama3 has no 'original_max_position_embeddings'"),
    (dict(partial_rotary_factor=0.5), r"config\.json: `partial_rotary_factor` is not supported"),
    (dict(hidden_act="gelu"), r"config\.json: `hidden_act` 'gelu' is not supported \(only silu\)"),
    (dict(dtype="float8_e4m3fn"), r"config\.json: `dtype` 'float8_e4m3fn' is not supported"),
    (dict(hidden_size=...), r"config\.json: `hidden_size` is missing or not an integer"),
])
def test_what_cannot_be_served_is_named_with_file_and_field(tmp_path, change, message):
    write_config(tmp_path, **change)
    with pytest.raises(ConfigError, match=message) as info:
        read_model_config(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)


def test_an_unsupported_checkpoint_fails_before_any_weight_is_read(tmp_path):
    """The weights file is not even a safetensors file: the config's error comes first."""
    write_config(tmp_path, quantization_config={"quant_method": "gptq"})
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="quantization_config"):
        cpu_runner(tmp_path)


def test_the_hub_rope_form_and_transformers_5s_read_alike(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    legacy = read_model_config(write_config(tmp_path, "llama", rope_scaling=scaling, rope_theta=500000.0)).rope
    current = read_model_config(write_config(tmp_path, "llama", rope_scaling=..., rope_theta=...,
                                             rope_parameters={**scaling, "rope_theta": 500000.0})).rope
    assert legacy == current == RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 8192)
    plain = read_model_config(write_config(tmp_path, "qwen2", rope_theta=...,
                                           rope_parameters={"rope_type": "default", "rope_theta": 1e6})).rope
    assert plain == RopeConfig(1e6)
    assert read_model_config(write_config(tmp_path, "mistral", rope_theta=...)).rope == RopeConfig(10000.0)


@pytest.mark.parametrize("family, change, window", [
    ("mistral", dict(sliding_window=...), 4096),     # transformers' default when the field is absent
    ("mistral", dict(sliding_window=None), None),    # Mistral 7B v0.2 and later
    ("mistral", dict(sliding_window=512), 512),      # v0.1
    ("qwen2", dict(sliding_window=512, use_sliding_window=False), None),
    ("qwen2", dict(sliding_window=512, use_sliding_window=True), 512),
    ("qwen3", dict(sliding_window=512, use_sliding_window=True), 512),
    ("llama", dict(sliding_window=512), None),       # Llama has no sliding window
])
def test_each_family_says_how_its_config_sets_a_sliding_window(tmp_path, family, change, window):
    assert read_model_config(write_config(tmp_path, family, **change)).sliding_window == window


def test_the_context_limit_stays_within_the_attention_window(tmp_path):
    windowed = read_model_config(write_config(tmp_path, "mistral", sliding_window=512))
    assert windowed.context_limit(0) == 512 and windowed.context_limit(300) == 300
    with pytest.raises(ConfigError, match=r"--max-model-len 1024 exceeds the model's attention window: config\.json "
                                          r"`sliding_window` is 512 .* serve with --max-model-len 512 or less"):
        windowed.context_limit(1024)
    full = read_model_config(write_config(tmp_path, "llama"))
    assert full.context_limit(0) == SHAPE["max_position_embeddings"]
    with pytest.raises(ConfigError, match=r"--max-model-len 5000 exceeds the model's max_position_embeddings 4096"):
        full.context_limit(5000)


def test_generation_config_gives_eos_ids_and_sampling_defaults(tmp_path):
    write_config(tmp_path, eos_token_id=7, generation={"eos_token_id": [9, 7], "temperature": 0.6, "top_p": 0.95,
                                                        "top_k": 20, "do_sample": True})
    config = ModelConfig.from_dir(tmp_path)
    assert config.eos_token_ids == (7, 9)
    assert config.sampling_defaults == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20)
    write_config(tmp_path, generation={"eos_token_id": 3})
    assert ModelConfig.from_dir(tmp_path).sampling_defaults == SamplingDefaults()


@pytest.mark.parametrize("field, value", [("top_p", 1.5), ("temperature", -1), ("top_k", "many"), ("top_k", 2.5)])
def test_a_bad_sampling_default_is_named(tmp_path, field, value):
    write_config(tmp_path, generation={field: value})
    with pytest.raises(ConfigError, match=rf"generation_config\.json: `{field}` .* is not a valid value"):
        ModelConfig.from_dir(tmp_path)


def test_the_worker_reports_the_sampling_defaults(tmp_path, tiny_model_dir):
    for name in ("model.safetensors", "tokenizer.json"):
        (tmp_path / name).symlink_to(tiny_model_dir / name)
    write_config(tmp_path, generation={"temperature": 0.7, "top_k": 20})
    info = cpu_runner(tmp_path).info()
    assert info.sampling_defaults.temperature == pytest.approx(0.7) and info.sampling_defaults.top_k == 20
    assert not info.sampling_defaults.HasField("top_p")
