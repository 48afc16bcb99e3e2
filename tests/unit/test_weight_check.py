"""NaN and Inf weights are reported at load, naming the tensors (issue #24).

A tiny llama checkpoint with a NaN in one tensor and an Inf in another fails to load with a
ValueError naming the model parameters (with counts) and the checkpoint tensors; values that are
finite in the checkpoint but overflow the model's dtype are named as an overflow;
``check_weights_finite=False`` (``--skip-weight-check``) loads them anyway. The serve flags reach
the engine: ``--skip-weight-check`` and ``serve``'s chat template bounds.
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file, save_file

from attnserve import LLM
from attnserve.entrypoints.cli import build_parser
from attnserve.entrypoints.engine_args import engine_kwargs
from tests.server.conftest import build_tiny_llama

KW = dict(max_model_len=32, max_num_seqs=2, kv_cache_memory=0.001)


@pytest.fixture(scope="module")
def clean_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("finite"))


def _edit(src, dst, edits: dict[str, tuple[tuple, float]]):
    import shutil

    shutil.copytree(src, dst)
    (file,) = dst.glob("*.safetensors")
    tensors = load_file(str(file))
    for name, (index, value) in edits.items():
        tensors[name][index] = value
    save_file(tensors, str(file), metadata={"format": "pt"})
    return dst


def test_nan_and_inf_weights_are_named(clean_dir, tmp_path):
    bad = _edit(clean_dir, tmp_path / "bad", {"model.layers.1.mlp.down_proj.weight": ((0, 3), float("nan")),
                                              "model.layers.0.self_attn.k_proj.weight": ((1, 1), float("inf"))})
    with pytest.raises(ValueError, match="NaN or Inf") as err:
        LLM(str(bad), dtype="float32", **KW)
    message = str(err.value)
    assert "'model.layers.1.mlp.down_proj.weight'" in message  # the checkpoint's names
    assert "'model.layers.0.self_attn.k_proj.weight'" in message
    assert "(1 NaN, 0 Inf)" in message and "(0 NaN, 1 Inf)" in message  # the parameters' counts
    llm = LLM(str(bad), dtype="float32", check_weights_finite=False, **KW)  # skipped: it loads
    assert llm.llm_engine.config.model.check_weights_finite is False
    LLM(str(clean_dir), dtype="float32", **KW)  # a clean checkpoint passes the check


def test_values_that_overflow_the_dtype_are_named_as_such(clean_dir, tmp_path):
    big = _edit(clean_dir, tmp_path / "big", {"model.layers.0.mlp.up_proj.weight": ((2, 2), 1e6)})
    LLM(str(big), dtype="float32", **KW)
    with pytest.raises(ValueError, match="every checkpoint tensor is finite, so values overflow torch.float16"):
        LLM(str(big), dtype="float16", **KW)


def test_the_flags_reach_the_engine_and_the_server():
    parser = build_parser()
    assert "check_weights_finite" not in engine_kwargs(parser.parse_args(["serve"]))
    assert engine_kwargs(parser.parse_args(["serve", "--skip-weight-check"]))["check_weights_finite"] is False
    args = parser.parse_args(["serve", "--max-chat-template-bytes", "10", "--chat-template-timeout", "0.5",
                              "--max-chat-template-output-chars", "99"])
    assert (args.max_chat_template_bytes, args.chat_template_timeout, args.max_chat_template_output_chars) \
        == (10, 0.5, 99)
    with pytest.raises(ValueError, match="check_weights_finite"):
        LLM("x", check_weights_finite="no")
