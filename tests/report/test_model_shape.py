"""The bytes and arithmetic the report reads from a model's config.json, against the models' published sizes
and the oracle's own KV constant, and the one clear error a config it cannot price gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.oracle.gpu import QWEN3_32B_CONFIG, QWEN3_32B_KV_BYTES_PER_TOKEN
from tracer.report.cli import report_command
from tracer.report.model_shape import ModelConfigError, ModelShape

# Meta-Llama-3-8B's config.json (the fields that size it), as published on Hugging Face.
LLAMA3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


def _config(tmp_path: Path, **fields) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields), encoding="utf-8")
    return path


def test_qwen3_32b_weighs_its_published_parameters_and_kv() -> None:
    shape = ModelShape.from_hf_config(QWEN3_32B_CONFIG)
    assert shape.weight_bytes / 2 == pytest.approx(32.8e9, rel=0.01)  # Qwen3-32B: 32.8B parameters, bf16
    assert shape.kv_bytes_per_token == QWEN3_32B_KV_BYTES_PER_TOKEN
    # The non-embedding parameters (31.2B, the model card) run two FLOPs a token each.
    assert shape.gemm_flops_per_token / 2 == pytest.approx(31.2e9, rel=0.01)


def test_llama3_8b_weighs_its_published_parameters(tmp_path: Path) -> None:
    shape = ModelShape.from_hf_config(_config(tmp_path, **LLAMA3_8B))
    assert shape.weight_bytes / 2 == pytest.approx(8.03e9, rel=0.01)
    assert shape.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16
    # A prompt of n tokens attends n^2 / 2 pairs, 4 x 128 FLOPs each per head and layer: 2 x 128 x 32 x 32 a unit.
    assert shape.attention_flops_per_pair == 2 * 128 * 32 * 32


@pytest.mark.parametrize(
    "fields, says",
    [
        ({k: v for k, v in LLAMA3_8B.items() if k != "hidden_size"}, "lacks hidden_size"),
        ({**LLAMA3_8B, "num_local_experts": 8}, "mixture of experts"),
        ({**LLAMA3_8B, "torch_dtype": "int3"}, "unknown dtype int3"),
    ],
)
def test_a_config_it_cannot_price_gets_one_clear_error(tmp_path: Path, fields: dict, says: str) -> None:
    with pytest.raises(ModelConfigError, match=says):
        ModelShape.from_hf_config(_config(tmp_path, **fields))


def test_the_cli_refuses_a_bad_config_before_reading_any_trace(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json", encoding="utf-8")
    missing_trace = tmp_path / "never-read.jsonl"
    missing_trace.write_text("", encoding="utf-8")
    result = CliRunner().invoke(
        report_command, [str(missing_trace), "--slo-ttft", "1", "--slo-itl", "0.05", "--model-config", str(bad)]
    )
    assert result.exit_code != 0
    assert "cannot read the model config" in result.output
