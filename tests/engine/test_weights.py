"""Weight loading from Hugging Face folders: every layout loads, every bad one is named."""

import json

import pytest
import torch
from hf_models import write_checkpoint

from ostinato.engine import LLM
from ostinato.engine.loading.weights import WeightsError
from ostinato.engine.model.config import ModelConfigError

pytest.importorskip("transformers")


def logits(path, **kw):
    llm = LLM(path, device="cpu", max_model_len=64, max_num_seqs=2, progress=False, **kw)
    out = llm.generate([[1, 2, 3, 4, 5]])
    return llm, out[0].token_ids


@pytest.fixture
def reference(tmp_path):
    folder = tmp_path / "ref"
    hf = write_checkpoint("LlamaForCausalLM", folder)
    return hf, folder, logits(folder)[1]


def test_sharded_safetensors_with_index(reference, tmp_path):
    hf, _, want = reference
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    assert logits(tmp_path / "sharded")[1] == want


def test_pytorch_model_bin(reference, tmp_path):
    hf, _, want = reference
    folder = tmp_path / "bin"
    hf.save_pretrained(folder, safe_serialization=False)
    if not any(folder.glob("pytorch_model*.bin")):
        # transformers 5 always writes safetensors; write the legacy file ourselves.
        for f in folder.glob("*.safetensors*"):
            f.unlink()
        torch.save(hf.state_dict(), folder / "pytorch_model.bin")
    assert not any(folder.glob("*.safetensors"))
    assert logits(folder)[1] == want


def test_corrupt_safetensors_is_named(reference):
    _, folder, _ = reference
    (folder / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(WeightsError, match=r"model\.safetensors: cannot be read"):
        logits(folder)


def test_corrupt_bin_is_named(tmp_path):
    write_checkpoint("LlamaForCausalLM", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(WeightsError, match=r"pytorch_model\.bin: cannot be read"):
        logits(tmp_path)


def test_config_without_weights_needs_explicit_random(reference):
    _, folder, _ = reference
    (folder / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="no \\*.safetensors.*random_weights=True"):
        logits(folder)
    llm, tokens = logits(folder, random_weights=True)
    assert len(tokens) == 16


def test_index_naming_a_missing_shard(reference, tmp_path):
    hf, _, _ = reference
    folder = tmp_path / "sharded"
    hf.save_pretrained(folder, max_shard_size="200KB")
    next(iter(sorted(folder.glob("*.safetensors")))).unlink()
    with pytest.raises(WeightsError, match="names files that are missing"):
        logits(folder)


def test_tensor_with_no_place_in_the_model(reference, tmp_path):
    hf, _, _ = reference
    folder = tmp_path / "extra"
    hf.config.attention_bias = False
    hf.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] = 2  # the checkpoint has 3
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match="have no place in the model"):
        logits(folder)


def test_missing_tensor_and_bad_shape(reference, tmp_path):
    hf, _, _ = reference
    folder = tmp_path / "more"
    hf.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] = 4
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match="lacks.*layers.3"):
        logits(folder)
    cfg["num_hidden_layers"], cfg["intermediate_size"] = 3, 128
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match="has shape"):
        logits(folder)


def test_missing_and_empty_folders(tmp_path):
    with pytest.raises(ModelConfigError, match="no such file or folder"):
        logits(tmp_path / "absent")
    with pytest.raises(ModelConfigError, match="no config.json and no .gguf"):
        logits(tmp_path)


def test_legacy_non_zip_pytorch_model_bin(reference, tmp_path):
    hf, _, want = reference
    folder = tmp_path / "legacy"
    hf.save_pretrained(folder)
    for f in folder.glob("*.safetensors*"):
        f.unlink()
    torch.save(hf.state_dict(), folder / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    assert logits(folder)[1] == want


def test_random_weights_are_the_seeds_and_leave_the_default_generator_alone():
    from ostinato.engine.model.config import ModelConfig
    from ostinato.engine.model.decoder import DecoderModel
    from ostinato.engine.model.presets import SHAPES

    def drawn(seed, own):
        model = DecoderModel(ModelConfig.from_hf(SHAPES["tiny"]))
        if own:
            model.reset_parameters(torch.Generator().manual_seed(seed))
        else:
            torch.manual_seed(seed)
            model.reset_parameters()
        return model.state_dict()

    own, default, other = drawn(3, True), drawn(3, False), drawn(4, True)
    assert all(torch.equal(own[k], default[k]) for k in own)
    down = "layers.0.mlp.down_proj.weight"
    assert not torch.equal(own[down], other[down])
    state = torch.get_rng_state()
    LLM("tiny", device="cpu", max_model_len=64, max_num_seqs=2, progress=False, seed=5)
    assert torch.equal(torch.get_rng_state(), state)
