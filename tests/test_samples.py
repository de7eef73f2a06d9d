"""Samples during training: greedy continuations by full recompute, equal under every mesh to one process's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import SMALL_DIMS, perturb_off_init

from nemotron_recipe.config import ASSETS_DIR
from nemotron_recipe.data import ChatFormatter, load_sft_examples, load_tokenizer
from nemotron_recipe.generation import GenerationConfig, generate
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.training.samples import configured_prompts, greedy_continue, validation_prompts

WORKER = Path(__file__).parent / "distributed" / "samples_worker.py"
MESH_CASES = [
    "1,2,1,1,0,none,fp32",  # FSDP 2
    "1,1,1,2,1,none,fp32",  # TP 2 + SP
    "1,1,2,1,0,none,fp32",  # CP 2
    "1,2,1,1,0,none,fp32,moe,ep2",  # expert parallel 2
]


def small_model() -> NemotronHForCausalLM:
    torch.manual_seed(0)
    model = NemotronHForCausalLM(NemotronHConfig(pattern="M*-E", **SMALL_DIMS))
    perturb_off_init(model)
    return model


def one_by_one(model, prompt: list[int], steps: int, eos: int | None) -> list[int]:
    """Greedy decoding of one prompt, unpadded: the definition the batched, padded version must meet."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            if nxt == eos:
                break
            ids.append(nxt)
    return ids[len(prompt):]


def test_batched_padded_decoding_equals_each_prompt_alone():
    model = small_model()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (7, 2, 12)]
    free = greedy_continue(model, prompts, 9, eos_id=None, pad_id=0, seq_len_divisor=8)
    assert [why for _, why in free] == ["length"] * 3 and model.training
    assert [ids for ids, _ in free] == [one_by_one(model, p, 9, None) for p in prompts]
    eos = free[1][0][2]  # the second row's third token: that row stops there, the others go on
    stopped = greedy_continue(model, prompts, 9, eos_id=eos, pad_id=0)
    assert stopped[1] == (free[1][0][:2], "eos")
    for (ids, why), p in zip(stopped, prompts):
        assert ids == one_by_one(model, p, 9, eos) and (why == "eos") == (len(ids) < 9)
    assert greedy_continue(model, prompts, 0, eos_id=None, pad_id=0) == [([], "length")] * 3
    # The cached decoder (recipes' generation) agrees: the same ids and endings, by another road.
    cached = generate(model, prompts, GenerationConfig(max_new_tokens=9, eos_token_ids=(eos,)))
    assert [(r.completion_ids, r.finish_reason) for r in cached] == stopped


def test_sample_prompts_are_the_training_prompts():
    tok = load_tokenizer(ASSETS_DIR)
    val = load_sft_examples(ASSETS_DIR / "tiny_sft_val.jsonl", tok, seq_len=64)
    rows = [json.loads(line) for line in (ASSETS_DIR / "tiny_sft_val.jsonl").read_text().splitlines()[:2]]
    formatter = ChatFormatter(tok)
    from_val = validation_prompts(val, tok)
    assert [(p.text, p.reference) for p in from_val] == [(r["prompt"], r["response"]) for r in rows]
    given = configured_prompts([r["prompt"] for r in rows], formatter)
    assert [p.ids for p in from_val] == [p.ids for p in given]
    assert given[0].ids == formatter.encode_prompt([{"role": "user", "content": rows[0]["prompt"]}])
    assert tok.convert_ids_to_tokens(given[0].ids[:2] + given[0].ids[-1:]) == ["<s>", "<|user|>", "<|assistant|>"]
    assert validation_prompts(None, tok) == [] and len(validation_prompts(val, tok, count=5)) == 5


@pytest.mark.parametrize("override, needle", [
    ("eval.sample_tokens=-1", "eval.sample_tokens=-1: must be >= 0"),
    ("eval.samples=['ok','  ']", "eval.samples[1]='  ': an empty prompt"),
])
def test_bad_sample_settings_are_named(tmp_path, override, needle):
    from helpers import compose_run
    from nemotron_recipe.config import ConfigError, validate_config

    with pytest.raises(ConfigError, match=re.escape(needle)):
        validate_config(compose_run(tmp_path, override))


@pytest.mark.distributed
def test_samples_under_fsdp_tp_sp_cp_and_ep_equal_one_process(tmp_path):
    out = tmp_path / "samples.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER), str(out),
         *MESH_CASES], capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = json.loads(out.read_text())
    for case in MESH_CASES:
        r = results[case]
        assert r["samples"] == r["reference"], case
        assert r["ranks_agree"] and r["training"], case
        first_ids, first_why = r["reference"][0]
        assert first_why == "eos" and len(first_ids) == 3  # the first row ended early, at its 4th token


@pytest.mark.parametrize("mode, thinking", [("train", True), ("drop", False)])
def test_nemotron3_sample_prompt_is_the_released_templates_generation_prompt(mode, thinking):
    tok = load_tokenizer(ASSETS_DIR)
    released = (Path(__file__).parent / "fixtures" / "nemotron3_nano_chat_template.jinja").read_text()
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]
    text = tok.apply_chat_template(turns, chat_template=released, tokenize=False, add_generation_prompt=True,
                                   enable_thinking=thinking)
    ids = ChatFormatter(tok, template="nemotron3", reasoning=mode).encode_prompt(turns)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
