"""An export carries the format training used: transformers' `apply_chat_template` on the exported
tokenizer renders the text and tokens training built, and `generate` reads generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer, GenerationConfig

from nemotron_recipe.config import ASSETS_DIR
from nemotron_recipe.data import ChatFormatter, load_tokenizer
from nemotron_recipe.training.hf_io import save_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What colour is the cherry?"}, {"role": "assistant", "content": "The cherry is red."}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Opposite of late?"},
     {"role": "assistant", "content": "Early."}],
    [{"role": "user", "content": "Reverse: a b"}, {"role": "assistant", "content": "b a"},
     {"role": "user", "content": "And c d e?"}, {"role": "assistant", "content": " e d c "}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
     {"role": "user", "content": "bye"}, {"role": "assistant", "content": "bye!"}],
]
CHATML_LIKE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + eos_token }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def export_tokenizer(out: Path, tokenizer_dir: Path, setting: str) -> Path:
    save_tokenizer({"tokenizer": str(tokenizer_dir), "data": {"chat_template": setting}}, Path("step_x"), out)
    return out


@pytest.fixture(scope="module")
def templated_tokenizer(tmp_path_factory) -> Path:
    """The shipped tokenizer with a chat template of its own, which `auto` then trains with."""
    path = tmp_path_factory.mktemp("templated")
    tok = load_tokenizer(ASSETS_DIR)
    tok.chat_template = CHATML_LIKE.replace("<|' + m['role'] + '|>", "[' + m['role'] + ']").replace(
        "<|assistant|>", "[assistant]")
    tok.save_pretrained(str(path))
    return path


@pytest.mark.parametrize("setting", ["auto", "builtin", CHATML_LIKE, "own"])
def test_exported_template_renders_the_training_text_and_tokens(tmp_path, templated_tokenizer, setting):
    source = templated_tokenizer if setting == "own" else ASSETS_DIR
    setting = "auto" if setting == "own" else setting
    out = export_tokenizer(tmp_path, source, setting)
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())
    hf = AutoTokenizer.from_pretrained(str(out))
    train = ChatFormatter(load_tokenizer(source), template=setting)
    for turns in CONVERSATIONS:
        ids, _ = train.encode([turns], ["row"])[0]
        text = hf.apply_chat_template(turns, tokenize=False)
        # The template path renders this text itself; the built-in one joins ids, whose text this is.
        expected = train._render(turns, "row", generation_prompt=False) if train.uses_template else hf.decode(ids)
        assert text == expected
        assert hf.apply_chat_template(turns, tokenize=True)["input_ids"] == ids
        prompt = hf.apply_chat_template(turns[:-1], tokenize=True, add_generation_prompt=True)["input_ids"]
        assert prompt == train.encode_prompt(turns[:-1])
        assert ids[:len(prompt)] == prompt  # the reply follows the generation prompt, as trained
    if setting == "builtin" or (setting == "auto" and source == ASSETS_DIR):
        assert hf.apply_chat_template(CONVERSATIONS[0], tokenize=False) == \
            "<s><|user|>What colour is the cherry?<|assistant|>The cherry is red.</s>"


def test_export_writes_generation_config_and_replaces_an_older_template_file(tmp_path):
    (tmp_path / "chat_template.jinja").write_text("stale {{ messages }}")
    out = export_tokenizer(tmp_path, ASSETS_DIR, "auto")
    assert not (out / "chat_template.jinja").exists()
    tok = load_tokenizer(ASSETS_DIR)
    gen = GenerationConfig.from_pretrained(str(out))
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == \
        (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)


def test_builtin_template_refuses_an_unknown_role(tmp_path):
    hf = AutoTokenizer.from_pretrained(str(export_tokenizer(tmp_path, ASSETS_DIR, "builtin")))
    with pytest.raises(Exception, match="unknown role tool"):
        hf.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_transformers_generate_on_an_export_continues_like_the_training_samples(tmp_path):
    """A model exported with the run's format: transformers renders the prompt with the exported template,
    stops at the EOS of generation_config.json, and its greedy ids equal the samples' (`greedy_continue`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from helpers import SMALL_DIMS, perturb_off_init
    from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, NemotronHForCausalLM
    from nemotron_recipe.training.samples import configured_prompts, greedy_continue

    torch.manual_seed(0)
    ours = NemotronHForCausalLM(NemotronHConfig(pattern="M*-E", **{**SMALL_DIMS, "vocab_size": 512}))
    perturb_off_init(ours)
    tok = load_tokenizer(ASSETS_DIR)
    with torch.no_grad():  # EOS strong enough that some continuations end on it
        ours.lm_head.weight[tok.eos_token_id] *= 2
    ours.save_pretrained(str(tmp_path))
    export_tokenizer(tmp_path, ASSETS_DIR, "auto")

    texts = ["What colour is the cherry?", "hi"]
    prompts = configured_prompts(texts, ChatFormatter(tok))
    samples = greedy_continue(ours, [p.ids for p in prompts], 8, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path)).float().eval()
    assert hf.generation_config.eos_token_id == tok.eos_token_id
    reasons = []
    for text, prompt, (ids, why) in zip(texts, prompts, samples):
        rendered = hf_tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        assert rendered["input_ids"] == prompt.ids
        out = hf.generate(torch.tensor([prompt.ids]), max_new_tokens=8, do_sample=False)[0, len(prompt.ids):].tolist()
        # transformers keeps the EOS it stopped at (read from generation_config.json); the samples leave it out.
        assert out == ids + ([tok.eos_token_id] if why == "eos" else [])
        reasons.append(why)
    assert "eos" in reasons and "length" in reasons  # both ways of ending are compared
