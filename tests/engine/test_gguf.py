"""GGUF loading: SmolLM2-135M-Instruct (Q4_1 / Q8_0 / F32 tensors) against transformers
loading the same file, float32 on CPU; and the pieces of the loader on their own."""

import pytest
import torch
from hf_models import assert_greedy_matches_hf
from smollm2 import PROMPTS, QUESTION, gguf_path, hf_model

from ostinato.engine import LLM, SamplingParams
from ostinato.engine.loading.gguf_file import GGUFCheckpoint, permute_rope_rows, unpermute_rope_rows
from ostinato.engine.loading.weights import WeightsError
from ostinato.engine.model.config import ModelConfigError


@pytest.fixture(scope="module")
def ours():
    gguf_path()
    return LLM(device="cpu", max_model_len=512, max_num_seqs=8, progress=False)


@pytest.fixture(scope="module")
def theirs():
    return hf_model(torch.float32)


def test_config_read_from_gguf_metadata(ours):
    c = ours.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (30, 576, 9, 3)
    assert (c.vocab_size, c.rope_theta, c.tie_word_embeddings) == (49152, 100000.0, True)
    assert ours.engine.scheduler.eos_token_ids == {2}


def test_logits_match_transformers_on_the_same_file(ours, theirs):
    prompts = [ours.tokenizer.encode(p) for p in PROMPTS] + [ours.chat_prompt(QUESTION)]
    reqs = [ours.engine.scheduler.add(p, SamplingParams()) for p in prompts]
    step = ours.engine.scheduler.schedule()
    logits = ours.engine.runner.execute(step).logits
    ours.engine.scheduler.abort(reqs)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            want = theirs(torch.tensor([p])).logits[0, -1].float()
        torch.testing.assert_close(logits[i], want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_greedy_tokens_match_transformers_generate(ours, theirs):
    prompts = [ours.tokenizer.encode(p) for p in PROMPTS]
    assert_greedy_matches_hf(ours, theirs, prompts, max_tokens=32, pad_token_id=2)


def test_chat_answers_the_capital_of_france(ours):
    (out,) = ours.chat(QUESTION, SamplingParams(max_tokens=32))
    assert "Paris" in out.text
    assert out.finish_reason.value == "stop"


def test_text_prompts_and_text_out(ours):
    (out,) = ours.generate(["The capital of Germany is"], SamplingParams(max_tokens=8))
    assert isinstance(out.text, str) and out.text == ours.decode(out.token_ids)


def test_rope_row_permutation_round_trips():
    w = torch.randn(9 * 64, 576)
    assert torch.equal(unpermute_rope_rows(permute_rope_rows(w, 9), 9), w)
    assert not torch.equal(permute_rope_rows(w, 9), w)
    # Per head, llama.cpp interleaves the two rotate-half halves: rows 0, 32, 1, 33, ...
    head = torch.arange(64.0)[:, None]
    assert permute_rope_rows(head, 1)[:4, 0].tolist() == [0, 32, 1, 33]


def test_folder_holding_one_gguf_file(tmp_path):
    path = gguf_path()
    (tmp_path / path.name).symlink_to(path)
    ckpt_config = GGUFCheckpoint(path).config
    llm = LLM(tmp_path, device="cpu", max_model_len=64, max_num_seqs=1, progress=False)
    assert llm.config == ckpt_config
    (tmp_path / "second.gguf").symlink_to(path)
    with pytest.raises(ModelConfigError, match="several GGUF files"):
        LLM(tmp_path, device="cpu", max_model_len=64, progress=False)


def test_truncated_gguf_is_named(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(gguf_path().read_bytes()[:4096])
    with pytest.raises(WeightsError, match="bad.gguf: not a readable GGUF file"):
        GGUFCheckpoint(bad)


def test_unsupported_tensor_type_is_named(monkeypatch):
    import gguf.quants

    ckpt = GGUFCheckpoint(gguf_path())

    def refuse(data, qtype):
        raise NotImplementedError(qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", refuse)
    with torch.device("meta"):
        from ostinato.engine.model.decoder import DecoderModel

        model = DecoderModel(ckpt.config)
    with pytest.raises(WeightsError, match="token_embd.weight has type Q8_0"):
        ckpt.load_into(model)


def test_the_plain_reader_reads_what_ggufs_own_reader_reads():
    import gguf
    import numpy as np

    stock, ours = gguf.GGUFReader(str(gguf_path())), GGUFCheckpoint(gguf_path()).reader
    assert type(ours.data) is np.ndarray  # (slices of it skip np.memmap's bookkeeping)
    assert list(stock.fields) == list(ours.fields)
    assert all(stock.fields[k].contents() == ours.fields[k].contents() for k in stock.fields)
    assert [t.name for t in stock.tensors] == [t.name for t in ours.tensors]
    pairs = zip(stock.tensors, ours.tensors, strict=True)
    assert all(np.array_equal(a.data, b.data) for a, b in pairs)


def test_the_tokenizer_saves_the_files_autotokenizer_s_would(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = gguf_path()
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    GGUFCheckpoint(path).tokenizer().save_pretrained(str(ours))
    auto = transformers.AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )
    auto.save_pretrained(str(theirs))
    names = sorted(p.name for p in theirs.iterdir())
    assert names == sorted(p.name for p in ours.iterdir()) and "tokenizer.json" in names
    for name in names:
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name


def test_tokenizer_files_beside_the_gguf_leave_the_choice_to_autotokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    from ostinato.engine.loading.gguf_file import _tokenizer_class

    direct = getattr(transformers, "TokenizersBackend", None)
    assert _tokenizer_class(transformers, tmp_path) is (direct or transformers.AutoTokenizer)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert _tokenizer_class(transformers, tmp_path) is transformers.AutoTokenizer
