"""An embedding model's pooling, read from sentence-transformers' files in its folder or from a GGUF's
`<arch>.pooling_type`; and an embedding checkpoint as Qwen3-Embedding ships it (the bare decoder's
weights, no LM head) loads."""

from __future__ import annotations

import json

import gguf
import pytest
from localserve.models.pooling import PoolingMethod, PoolingSpec

from localserve.loading.gguf import gguf_model_config
from localserve.loading.pooling_config import PoolingConfigError, folder_pooling, gguf_pooling

QWEN3 = "Qwen3ForCausalLM"
POOLING = {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"}
NORMALIZE = {"type": "sentence_transformers.models.Normalize", "path": "2_Normalize"}


def write_config(folder, modules, pooling_config=None):
    (folder / "modules.json").write_text(json.dumps(modules))
    if pooling_config is not None:
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    return folder


@pytest.mark.parametrize(("modules", "flags", "architecture", "spec"), [
    ([POOLING, NORMALIZE], {"pooling_mode_lasttoken": True}, QWEN3, PoolingSpec(PoolingMethod.LAST, True, True)),
    ([POOLING, NORMALIZE], {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}, "LlamaForCausalLM",
     PoolingSpec(PoolingMethod.LAST, True, False)),  # Matryoshka is Qwen3-Embedding's, not any last-token model's
    ([POOLING], {"pooling_mode_lasttoken": True}, QWEN3, PoolingSpec(PoolingMethod.LAST, False, False)),
    ([POOLING], {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, "Qwen2ForCausalLM",
     PoolingSpec(PoolingMethod.MEAN, False, False)),
    ([POOLING, NORMALIZE], {"pooling_mode_cls_token": True}, QWEN3, PoolingSpec(PoolingMethod.CLS, True, False)),
])
def test_sentence_transformers_config_names_the_pooling(tmp_path, modules, flags, architecture, spec):
    assert folder_pooling(write_config(tmp_path, modules, flags), architecture) == spec


def test_a_folder_without_a_pooling_module_is_a_generation_model(tmp_path):
    assert folder_pooling(tmp_path, QWEN3) is None
    assert folder_pooling(write_config(tmp_path, [NORMALIZE]), QWEN3) is None


@pytest.mark.parametrize(("flags", "message"), [
    ({"pooling_mode_max_tokens": True}, "pooling_mode_max_tokens"),
    ({"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": True}, "exactly one"),
    ({}, "none"),
    (None, "missing file"),
])
def test_a_pooling_this_project_cannot_do_is_refused_naming_the_file(tmp_path, flags, message):
    with pytest.raises(PoolingConfigError, match=message) as caught:
        folder_pooling(write_config(tmp_path, [POOLING], flags), QWEN3)
    assert "1_Pooling" in str(caught.value)


@pytest.mark.parametrize(("pooling_type", "spec"), [
    (None, None), (0, None), (1, PoolingSpec(PoolingMethod.MEAN, True, False)),
    (2, PoolingSpec(PoolingMethod.CLS, True, False)), (3, PoolingSpec(PoolingMethod.LAST, True, True)),
])
def test_gguf_pooling_type(pooling_type, spec):
    assert gguf_pooling(pooling_type, QWEN3, "model.gguf") == spec


def test_gguf_rank_pooling_is_refused():
    with pytest.raises(PoolingConfigError, match="model.gguf: pooling_type 4"):
        gguf_pooling(4, QWEN3, "model.gguf")


def test_gguf_metadata_carries_the_pooling(tmp_path):
    path = tmp_path / "embed.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    for add, value in [(writer.add_block_count, 2), (writer.add_context_length, 512), (writer.add_embedding_length, 64),
                       (writer.add_feed_forward_length, 128), (writer.add_head_count, 4), (writer.add_head_count_kv, 2),
                       (writer.add_vocab_size, 256), (writer.add_pooling_type, gguf.PoolingType.LAST)]:
        add(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_model_config(path).pooling == PoolingSpec(PoolingMethod.LAST, True, True)


def test_an_untied_embedding_checkpoint_loads_without_a_head_and_cannot_generate(tmp_path):
    """Qwen3-Embedding-8B's shape: untied embeddings, yet no lm_head in the checkpoint."""
    from localserve.engine.builder import build_engine
    from localserve.engine.config import EngineConfig
    from localserve.engine.embedding_params import EmbeddingParams
    from localserve.engine.sampling_params import SamplingParams
    from localserve.loading.hf import load_model
    from tests.helpers.embedding_models import cosine, reference_embedding, write_tiny_embedding_model

    reference = write_tiny_embedding_model(tmp_path, "last")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    loaded = load_model(tmp_path)
    assert not hasattr(loaded.model, "lm_head") and not loaded.model.can_generate
    engine = build_engine(loaded.model, None, EngineConfig(num_kv_blocks=8))
    with pytest.raises(ValueError, match="it cannot generate text"):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    engine.add_request([5, 6, 7], EmbeddingParams(), "e")
    vector = engine.run_to_completion()["e"].embedding
    assert cosine(vector, reference_embedding(reference, [5, 6, 7], "last")) > 0.9999
