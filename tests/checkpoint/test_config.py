"""Checkpoint configuration: TOML loading, validation, tensor filters."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from asyncflow_actors.checkpoint import (
    CheckpointConfig,
    ManifestError,
    PauseMode,
    PhaseDeadlines,
    TensorFilter,
)


def test_config_loads_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        """
[checkpoint]
bucket_bytes = 33554432
transport = "gloo"
pause_mode = "keep"
lora_only = true
exclude = ["embed"]
[checkpoint.deadlines]
pause = 5
broadcast = 90.5
"""
    )
    config = CheckpointConfig.from_toml(path)
    assert config.bucket_bytes == 32 << 20 and config.transport == "gloo"
    assert config.pause_mode is PauseMode.KEEP
    assert config.deadlines == PhaseDeadlines(pause=5, broadcast=90.5)
    assert config.lease == config.deadlines.total + 30
    keep = config.tensor_filter()
    assert keep("model.layers.0.q_proj.lora_A.default.weight")
    assert not keep("model.layers.0.q_proj.weight")
    assert not keep("model.embed.lora_embedding_A.default")  # excluded


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ({"bucket_bytes": 8}, "bucket_bytes"),
        ({"transport": "carrier-pigeon"}, "transport"),
        ({"transport": "file"}, "directory"),
        ({"pause_mode": "nap"}, "pause_mode"),
        ({"checksum": "md5"}, "checksum"),
        ({"deadlines": {"pause": 0}}, "pause must be"),
        ({"deadlines": {"lunch": 1}}, "unknown phases"),
        ({"include": ["("]}, "invalid"),
        ({"keep_versions": 0}, "keep_versions"),
        ({"fused_bytes": -1}, "fused_bytes"),
        ({"fused_bytes": True}, "fused_bytes"),
        ({"bukcet_bytes": 1}, "unknown keys"),
    ],
)
def test_bad_config_names_the_offending_key(table: dict[str, object], match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        CheckpointConfig.from_dict(table)


def test_tensor_filter_semantics() -> None:
    everything = TensorFilter()
    assert everything("anything")
    some = TensorFilter(include=[r"^layers\.0\."], exclude=["bias"])
    assert some("layers.0.w") and not some("layers.0.bias") and not some("layers.1.w")
    lora = TensorFilter(lora_only=True)
    assert lora("q.lora_B.default.weight") and lora("m.lora_magnitude_vector.default")
    assert not lora("q.weight") and not lora("my_lora_Athing")
    assert math.isinf(CheckpointConfig(deadlines={"broadcast": math.inf}).lease)
