"""`python -m recipes.generate`: what it prints, the paths it takes, and the errors it names first."""

import json
from pathlib import Path

import pytest
import torch

from nemotron_recipe.data import load_tokenizer
from nemotron_recipe.data.tokenizer import DEFAULT_ASSETS_DIR
from nemotron_recipe.generation import GenerationConfig, generate
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.training.finetune import run
from nemotron_recipe.training.hf_io import export_hf
from recipes import generate as recipe

from helpers import RUN_BASE, SMALL_DIMS, compose_run

PROMPTS = ["Hello there", "The answer is forty"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A Hugging Face directory of a small model of every block kind, with the shipped tokenizer."""
    path = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    NemotronHForCausalLM(NemotronHConfig(pattern="M*-EM", **{**SMALL_DIMS, "vocab_size": 512})).save_pretrained(path)
    load_tokenizer(DEFAULT_ASSETS_DIR).save_pretrained(str(path))
    return path


def _json_run(capsys, *argv: str) -> list[dict]:
    assert recipe.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_holds_what_generate_returns_and_text_streams(model_dir, capsys):
    args = [str(model_dir), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-new-tokens", "8"]
    printed = _json_run(capsys, *args, "--batch-size", "2")
    tokenizer = load_tokenizer(model_dir)
    model = NemotronHForCausalLM.from_pretrained(str(model_dir))
    expected = generate(model, [tokenizer.encode(p) for p in PROMPTS], GenerationConfig(max_new_tokens=8),
                        tokenizer=tokenizer)
    assert printed == [{"prompt": p, "completion": r.text, "completion_ids": r.completion_ids,
                        "finish_reason": r.finish_reason} for p, r in zip(PROMPTS, expected)]

    assert recipe.main(args) == 0
    out = capsys.readouterr().out
    for prompt, r in zip(PROMPTS, expected):
        assert f">>> {prompt}\n{r.text}\n[{r.finish_reason}, {len(r.completion_ids)} tokens]" in out


def _no_weights(monkeypatch):
    def refuse(*_, **__):
        raise AssertionError("weights were read before the input was checked")

    monkeypatch.setattr(NemotronHForCausalLM, "from_pretrained", refuse)


@pytest.mark.parametrize("case,needle", [
    ("missing", "does not exist; it is neither a training checkpoint"),
    ("empty-dir", "it is neither a training checkpoint"),
    ("chat", "needs a chat template, and this tokenizer has none"),
    ("too-long", "more than the model takes (max_length=16)"),
])
def test_bad_input_is_one_line_before_any_weight_is_read(model_dir, tmp_path, monkeypatch, capsys, case, needle):
    _no_weights(monkeypatch)
    path, extra = model_dir, []
    if case == "missing":
        path = tmp_path / "nowhere"
    elif case == "empty-dir":
        path = tmp_path
    elif case == "chat":
        extra = ["--chat"]
    else:  # a model directory whose config limits the positions
        path = tmp_path / "limited"
        path.mkdir()
        for f in model_dir.iterdir():
            (path / f.name).write_bytes(f.read_bytes())
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16}))
        extra = ["--max-new-tokens", "12"]
    assert recipe.main([str(path), "--prompt", "one two three four five six seven", *extra]) == 1
    err = capsys.readouterr().err.strip()
    assert needle in err and err.startswith("Error: ") and "\n" not in err


def test_lora_checkpoint_generates_as_its_merged_export_and_its_peft_adapter(model_dir, tmp_path, capsys):
    """Three LoRA steps on `model_dir` (every default target, routed experts and Mamba2 out_proj
    included): greedy ids from the checkpoint (adapters unmerged, on the base it recorded) equal those
    of its `--merge` export and of its PEFT adapter directory on that base."""
    overrides = ["peft=lora", "peft.base_dtype=fp32", f"model.pretrained={model_dir}", "trainer.max_steps=3",
                 "trainer.val_every=0", "optim.warmup_steps=0", "optim.lr=1e-2"]
    checkpoint = run(compose_run(tmp_path / "run", *overrides, base=RUN_BASE))["checkpoint"]
    export_hf(checkpoint, tmp_path / "merged", merge=True)
    export_hf(checkpoint, tmp_path / "adapter")
    capsys.readouterr()  # the training run's console output
    args = ["--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-new-tokens", "12", "--batch-size", "2"]
    ids = {name: [r["completion_ids"] for r in _json_run(capsys, str(path), *args)]
           for name, path in [("checkpoint", checkpoint), ("merged", tmp_path / "merged"),
                              ("adapter", tmp_path / "adapter"), ("base", model_dir)]}
    assert ids["checkpoint"] == ids["merged"] == ids["adapter"]
    assert ids["checkpoint"] != ids["base"]  # the adapters do change what is generated
