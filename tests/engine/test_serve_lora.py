"""`ostinato serve --lora-modules` as a real process with SmolLM2-135M-Instruct and two
random adapters on the CPU, through the official `openai` client: the adapters are models
of their own, a request naming one equals the offline engine's with that adapter, an
unknown model is 404; with `--allow-runtime-lora`, adapters loaded and unloaded while it
serves."""

from pathlib import Path

import pytest
from smollm2 import gguf_path

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from serve_harness import served  # noqa: E402

from benchmarks.lora_cost import write_adapter  # noqa: E402
from ostinato.engine import LLM, SamplingParams  # noqa: E402

PROMPT = "The history of the Roman Empire begins with"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    gguf_path()
    folder = tmp_path_factory.mktemp("serve_lora")
    base = LLM(device="cpu", max_model_len=256, max_num_seqs=4, progress=False)
    for i, name in enumerate(("calm", "wild")):
        write_adapter(base.config, folder / name, rank=4, seed=i, scale=0.05)
    write_adapter(base.config, folder / "big", rank=8, seed=2, scale=0.05)  # (not served)
    base.close()
    return {name: str(folder / name) for name in ("calm", "wild")}


def test_adapters_are_served_as_models_and_equal_the_offline_engine(adapters):
    modules = [f"{name}={path}" for name, path in adapters.items()]
    args = ["--device", "cpu", "--max-model-len", "256", "--quiet", "--enable-lora",
            "--max-lora-rank", "4", "--max-loras", "1", "--lora-modules", *modules]  # fmt: skip
    offline = LLM(device="cpu", max_model_len=256, max_num_seqs=4, progress=False,
                  enable_lora=True, max_lora_rank=4, lora_modules=tuple(modules))  # fmt: skip
    params = SamplingParams(max_tokens=12)
    want = {name: offline.generate([PROMPT], params, lora=name)[0].text for name in adapters}
    want["smollm2-135m"] = offline.generate([PROMPT], params)[0].text
    offline.close()
    assert len(set(want.values())) == 3  # each adapter changes the answer
    with served(args) as server:
        client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["smollm2-135m", "calm", "wild"]
        for model, text in want.items():  # one slot: the adapters take turns in it
            got = client.completions.create(
                model=model, prompt=PROMPT, max_tokens=12, temperature=0
            )
            assert got.choices[0].text == text, model
        with pytest.raises(openai.NotFoundError) as missing:
            client.completions.create(model="tame", prompt=PROMPT, max_tokens=2)
        assert missing.value.code == "model_not_found"


def test_adapters_load_and_unload_while_the_server_runs(adapters):
    folder = Path(adapters["calm"]).parent
    args = ["--device", "cpu", "--max-model-len", "256", "--quiet", "--enable-lora",
            "--max-lora-rank", "4", "--max-loras", "1", "--allow-runtime-lora"]  # fmt: skip
    calm = (f"calm={folder / 'calm'}",)
    offline = LLM(device="cpu", max_model_len=256, max_num_seqs=4, progress=False,
                  enable_lora=True, max_lora_rank=4, lora_modules=calm)  # fmt: skip
    want = offline.generate([PROMPT], SamplingParams(max_tokens=12), lora="calm")[0].text
    offline.close()
    with served(args) as server:
        client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)

        def post(route: str, **body: str) -> httpx.Response:
            return httpx.post(f"{server}/v1/{route}", json=body, timeout=120)

        def listed() -> list[str]:
            return [m.id for m in client.models.list().data]

        assert listed() == ["smollm2-135m"]
        loaded = post("load_lora_adapter", lora_name="calm", lora_path=str(folder / "calm"))
        assert loaded.status_code == 200, loaded.text
        assert listed() == ["smollm2-135m", "calm"]
        got = client.completions.create(model="calm", prompt=PROMPT, max_tokens=12, temperature=0)
        assert got.choices[0].text == want
        big = post("load_lora_adapter", lora_name="big", lora_path=str(folder / "big"))
        assert big.status_code == 400 and big.json()["error"]["param"] == "lora_path"
        assert "exceeds max_lora_rank=4" in big.json()["error"]["message"]
        taken = post("load_lora_adapter", lora_name="calm", lora_path=str(folder / "wild"))
        assert taken.status_code == 400 and taken.json()["error"]["param"] == "lora_name"
        assert post("unload_lora_adapter", lora_name="calm").status_code == 200
        assert listed() == ["smollm2-135m"]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="calm", prompt=PROMPT, max_tokens=2)
        again = post("unload_lora_adapter", lora_name="calm")
        assert again.status_code == 404 and again.json()["error"]["code"] == "model_not_found"
