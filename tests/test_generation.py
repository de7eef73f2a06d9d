"""Incremental decoding: the cache against recomputing the whole sequence, sampling, stopping and errors."""

import contextlib
import importlib
import os

import pytest
import torch

from nemotron_recipe.generation import DecodeCache, GenerationConfig, GenerationError, cache_bytes, generate
from nemotron_recipe.generation.packed import packed_linears, packing_available
from nemotron_recipe.generation.sampling import filter_logits
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.models.nemotron_v3.lora import LoRASpec, add_adapters, init_adapters

from helpers import SMALL_DIMS, perturb_off_init

# Every block kind with group-limited routing; chunk 8 so that 64 steps cross many chunk boundaries.
PATTERN = "M*-EM"
DIMS = {**SMALL_DIMS, "n_routed_experts": 4, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5}


def _model(seed: int = 0, **overrides) -> NemotronHForCausalLM:
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(NemotronHConfig(pattern=PATTERN, **{**DIMS, **overrides})).eval()
    perturb_off_init(model)
    return model


def _prompts(lengths, seed=1, vocab=64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _left_padded(prompts):
    length = max(map(len, prompts))
    ids = torch.zeros(len(prompts), length, dtype=torch.long)
    valid = torch.zeros(len(prompts), length, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, length - len(p):] = torch.tensor(p)
        valid[i, length - len(p):] = True
    return ids, valid


def test_cached_decoding_equals_full_recompute():
    """64 greedy steps from left-padded prompts of different lengths, on every block kind with LatentMoE,
    group-limited routing and unmerged LoRA adapters (non-zero, the routed experts' included): each
    step's logits equal those of recomputing the whole sequences from scratch (padding run as a
    document of its own), within 1e-5, across many chunk boundaries of the scan."""
    model = _lora_model()
    ids, valid = _left_padded(_prompts([13, 1, 6]))
    steps = 64
    cache = DecodeCache(valid, ids.shape[1] + steps, len(model.model.layers))
    worst = 0.0
    with torch.no_grad():
        logits = model(ids, cache=cache).logits[:, -1]
        for _ in range(steps):
            full = model(ids, document_ids=valid.long()).logits[:, -1]
            worst = max(worst, (full - logits).abs().max().item())
            token = logits.argmax(-1, keepdim=True)
            ids, valid = torch.cat([ids, token], 1), torch.cat([valid, torch.ones_like(token, dtype=torch.bool)], 1)
            logits = model(token, cache=cache).logits[:, -1]
    assert worst <= 1e-5, worst
    assert cache.length == ids.shape[1]
    assert cache.nbytes() == cache_bytes(model.config, 3, cache.capacity, torch.float32)


def _lora_model():
    model = _model(moe_latent_size=16)
    add_adapters(model, LoRASpec(rank=4, alpha=8.0))
    init_adapters(model, seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("lora_B.weight", ".B")):
                p.normal_(std=0.05)
    return model


def _worst_step_error(model, prompts, steps: int, decoding=contextlib.nullcontext) -> float:
    """The largest difference between `steps` cached steps' logits (run inside `decoding()`) and
    recomputing the whole sequences with the plain model, on the model's device."""
    device = model.lm_head.weight.device
    ids, valid = (t.to(device) for t in _left_padded(prompts))
    cache = DecodeCache(valid, ids.shape[1] + steps, len(model.model.layers))
    decoded = []
    with torch.no_grad():
        with decoding():
            logits = model(ids, cache=cache).logits[:, -1]
            for _ in range(steps):
                decoded.append(logits)
                logits = model(logits.argmax(-1, keepdim=True), cache=cache).logits[:, -1]
        worst = 0.0
        for logits in decoded:
            full = model(ids, document_ids=valid.long()).logits[:, -1]
            worst = max(worst, (full - logits).abs().max().item())
            token = logits.argmax(-1, keepdim=True)
            ids, valid = torch.cat([ids, token], 1), torch.cat([valid, torch.ones_like(token, dtype=torch.bool)], 1)
    return worst


@pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")
def test_reordered_weights_decode_as_the_linears_compute(monkeypatch):
    """Inside `packed_linears` every linear layer (LM head and unmerged LoRA bases included) runs on
    oneDNN's reordered weights: 16 cached steps give the logits of recomputing the whole sequences
    with the plain layers (1e-5), `generate` the same greedy ids, and nothing stays patched. By
    default they are made only where the copy takes at most half the free memory."""
    model = _lora_model()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    taken = []

    @contextlib.contextmanager
    def packed():
        with packed_linears(model, 3, enabled=True) as n:
            taken.append(n)
            yield

    assert _worst_step_error(model, _prompts([13, 1, 6]), 16, packed) <= 1e-5
    assert taken == [len(linears)] and not any("forward" in vars(m) for m in linears)
    prompts = _prompts([9, 4, 7])
    ids_of = [[r.completion_ids for r in generate(model, prompts, GenerationConfig(max_new_tokens=12,
                                                                                  prepack_weights=pack))]
              for pack in (True, False)]
    assert ids_of[0] == ids_of[1]
    with packed_linears(model, 1) as n:  # by default on CPU: fp32 at one row too
        assert n == len(linears)
    with packed_linears(model, 1, enabled=False) as n:
        assert n == 0
    weight_bytes = sum(m.weight.nbytes for m in linears)
    page = os.sysconf("SC_PAGE_SIZE")
    for free, expected in ((weight_bytes, 0), (4 * weight_bytes, len(linears))):  # the copy needs half the free memory
        monkeypatch.setattr(os, "sysconf", lambda name, free=free: free // page if name == "SC_AVPHYS_PAGES" else page)
        with packed_linears(model, 1) as n:
            assert n == expected


def test_compiled_one_row_steps_decode_as_the_eager_steps(monkeypatch, caplog):
    """With `compile`, one-row steps of the Mamba2 and MLP blocks (biases on) run compiled: 16 cached
    steps give the logits of recomputing the whole sequence (1e-5, fp32) and `generate` the eager
    ids. Attention, MoE and LoRA-adapted blocks stay eager, nothing stays patched, batches of several
    rows are not compiled, and a compiler failure decodes eagerly with a warning."""
    from nemotron_recipe.generation import compiled

    # The package's `generate` is the function; its module is reached by name.
    generate_module = importlib.import_module("nemotron_recipe.generation.generate")
    model = _model(use_bias=True, mlp_bias=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.bias"):
                p.normal_(std=0.1)
    blocks = list(model.model.layers)
    taken, calls = [], []
    real_compiled = compiled._compiled
    monkeypatch.setattr(compiled, "_compiled", lambda fn: calls.append(fn.__name__) or real_compiled(fn))

    @contextlib.contextmanager
    def compiled_decoding():
        with compiled.compiled_steps(model, True) as linears:
            taken.append(linears)
            yield

    assert _worst_step_error(model, _prompts([13]), 16, compiled_decoding) <= 1e-5
    expected = [lin for b in blocks if b.block_type in ("mamba", "mlp")
                for lin in ((b.mixer.in_proj, b.mixer.out_proj) if b.block_type == "mamba"
                            else (b.mixer.up_proj, b.mixer.down_proj))]
    assert taken == [expected] and not any("forward" in vars(b) for b in blocks)
    assert calls.count("_mamba_block_step") == 2 * 16 and calls.count("_mlp_block_step") == 16  # every step compiled
    with compiled.compiled_steps(_lora_model(), True) as linears:
        assert linears == []  # adapted projections keep the LoRA modules' own path

    prompt = _prompts([11])
    eager_ids, compiled_ids = ([r.completion_ids for r in generate(model, prompt, GenerationConfig(
        max_new_tokens=12, compile=c))] for c in (False, True))
    assert compiled_ids == eager_ids

    enabled = []
    real = generate_module.compiled_steps
    monkeypatch.setattr(generate_module, "compiled_steps", lambda m, on: enabled.append(on) or real(m, on))
    generate(model, _prompts([5, 7]), GenerationConfig(max_new_tokens=2, compile=True))
    generate(model, _prompts([5, 7]), GenerationConfig(max_new_tokens=2, compile=True, batch_size=1))
    assert enabled == [False, True]

    def broken(fn):
        def fail(*args):
            raise RuntimeError("no C++ compiler")
        return fail

    monkeypatch.setattr(compiled, "_compiled", broken)
    with caplog.at_level("WARNING"):
        ids = [r.completion_ids for r in generate(model, prompt, GenerationConfig(max_new_tokens=12, compile=True))]
    assert ids == eager_ids and "no C++ compiler" in caplog.text and "decoding eagerly" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_cached_decoding_equals_full_recompute():
    """On the GPU, with mamba_ssm's and causal_conv1d's step kernels where installed (else the PyTorch
    steps): 24 cached steps against recomputing the whole sequences on the GPU, relative to the
    logits' scale: 1e-4 on the PyTorch paths, TF32's 2e-2 where mamba_ssm's scan (TF32 products)
    runs the recompute and the prefill; greedy ids equal the CPU's on the PyTorch paths."""
    from nemotron_recipe.models.nemotron_v3 import kernels

    model = _lora_model()
    prompts = _prompts([13, 1, 6])
    config = GenerationConfig(max_new_tokens=24)
    on_cpu = [r.completion_ids for r in generate(model, prompts, config)]
    model.cuda()
    kernels_run = kernels.triton_scan_available() or kernels._cuda_state_update() is not None
    with torch.no_grad():
        scale = model(_left_padded(prompts)[0].cuda()).logits.abs().max().item()
    worst = _worst_step_error(model, prompts, 24)
    assert worst <= (2e-2 if kernels_run else 1e-4) * scale, (worst, scale)
    if not kernels_run:
        assert [r.completion_ids for r in generate(model, prompts, config)] == on_cpu


def test_completion_does_not_depend_on_batch_or_padding():
    model = _model()
    prompts = _prompts([9, 2, 5, 12])
    config = GenerationConfig(max_new_tokens=10, batch_size=4)
    together = generate(model, prompts, config)
    alone = [generate(model, [p], config)[0] for p in prompts]
    assert [r.completion_ids for r in together] == [r.completion_ids for r in alone]
    assert all(r.finish_reason == "length" and len(r.completion_ids) == 10 and r.text is None for r in together)


def test_same_seed_same_text_whatever_the_batch():
    model = _model()
    prompts = _prompts([7, 3, 10])
    sample = {"max_new_tokens": 12, "greedy": False, "temperature": 1.3, "top_k": 20, "top_p": 0.95}
    first = generate(model, prompts, GenerationConfig(seed=5, batch_size=3, **sample))
    again = generate(model, prompts, GenerationConfig(seed=5, batch_size=1, **sample))
    other = generate(model, prompts, GenerationConfig(seed=6, batch_size=3, **sample))
    greedy = generate(model, prompts, GenerationConfig(max_new_tokens=12))
    ids = [r.completion_ids for r in first]
    assert ids == [r.completion_ids for r in again]
    assert ids != [r.completion_ids for r in other]
    assert ids != [r.completion_ids for r in greedy]
    top1 = generate(model, prompts, GenerationConfig(seed=5, max_new_tokens=12, greedy=False, top_k=1))
    assert [r.completion_ids for r in top1] == [r.completion_ids for r in greedy]


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()

    def kept(k, p):
        return torch.isfinite(filter_logits(logits, k, p))[0].tolist()

    assert kept(2, 1.0) == [True, True, False, False]
    assert kept(0, 0.5) == [True, False, False, False]  # the first token reaches 0.5 alone
    assert kept(0, 0.7) == [True, True, False, False]
    assert kept(0, 0.81) == [True, True, True, False]
    assert kept(3, 0.99) == [True, True, True, False]


def test_eos_ends_a_completion_without_being_part_of_it():
    model = _model()
    prompt = _prompts([6])[0]
    full = generate(model, [prompt], GenerationConfig(max_new_tokens=12))[0].completion_ids
    at = next(i for i in range(1, 12) if full[i] not in full[:i])
    ended = generate(model, [prompt], GenerationConfig(max_new_tokens=12, eos_token_ids=(full[at],)))[0]
    assert (ended.completion_ids, ended.finish_reason) == (full[:at], "eos")


def test_stop_strings_and_streaming_with_the_tokenizer():
    from nemotron_recipe.data import load_tokenizer
    from nemotron_recipe.data.tokenizer import DEFAULT_ASSETS_DIR

    tokenizer = load_tokenizer(DEFAULT_ASSETS_DIR)
    model = _model(vocab_size=len(tokenizer))
    prompts = [tokenizer.encode("The answer is"), tokenizer.encode("Hello")]
    config = GenerationConfig(max_new_tokens=16, eos_token_ids=())
    full = generate(model, prompts, config, tokenizer=tokenizer)
    text = full[0].text
    assert text == tokenizer.decode(full[0].completion_ids, skip_special_tokens=True)
    at = next(i for i in range(1, len(text) - 2) if text[i:i + 2] not in text[:i + 1])
    stop = text[at:at + 2]
    streamed = {0: "", 1: ""}

    def on_text(index, delta):
        streamed[index] += delta

    cut = generate(model, prompts, GenerationConfig(max_new_tokens=16, eos_token_ids=(), stop_strings=(stop,)),
                   tokenizer=tokenizer, stream=on_text)
    assert (cut[0].text, cut[0].finish_reason) == (text[:at], "stop")
    assert full[0].completion_ids[:len(cut[0].completion_ids)] == cut[0].completion_ids
    assert streamed == {0: cut[0].text, 1: cut[1].text}


@pytest.mark.parametrize("prompts,config,needle", [
    ([[]], GenerationConfig(), "prompt 0 is empty"),
    ([[1, 2], [70]], GenerationConfig(), "prompt 1 holds token ids [70] outside the model's vocabulary"),
    ([[1] * 10], GenerationConfig(max_new_tokens=8, max_length=16), "at most 8 tokens"),
    ([[1]], GenerationConfig(stop_strings=("x",)), "pass the tokenizer"),
])
def test_bad_prompts_are_named_before_any_work(prompts, config, needle):
    with pytest.raises(GenerationError) as err:
        generate(_model(), prompts, config)
    assert needle in str(err.value)


def test_bad_settings_are_named():
    with pytest.raises(GenerationError, match="top_p=1.5"):
        GenerationConfig(top_p=1.5)
    with pytest.raises(GenerationError, match="temperature=0"):
        GenerationConfig(temperature=0)
    with pytest.raises(GenerationError, match="compile='yes'"):
        GenerationConfig(compile="yes")


def _fake_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """mamba_ssm's `selective_state_update` contract, in plain PyTorch: state [b,h,p,n], x/dt [b,h,p],
    A [h,p,n], B/C [b,g,n], D [h,p]; the state updated in place."""
    assert z is None and dt_bias is None and not dt_softplus
    r = x.shape[1] // B.shape[1]
    Bh, Ch = B.repeat_interleave(r, 1), C.repeat_interleave(r, 1)
    state.copy_(state * torch.exp(dt[..., None] * A) + (dt * x)[..., None] * Bh[:, :, None, :])
    return ((state * Ch[:, :, None, :]).sum(-1) + D * x).to(x.dtype)


def _fake_conv_update(x, conv_state, weight, bias=None, activation=None):
    """causal_conv1d's `causal_conv1d_update` contract: x [b,C], conv_state [b,C,state_len] shifted in place."""
    window = torch.cat([conv_state, x[..., None]], -1)
    conv_state.copy_(window[..., 1:])
    out = (window[..., -weight.shape[-1]:] * weight).sum(-1) + (0 if bias is None else bias)
    return torch.nn.functional.silu(out) if activation == "silu" else out


def test_single_step_kernels_get_what_they_expect(monkeypatch):
    """Where mamba_ssm and causal_conv1d are installed (CUDA), decoding steps call their update kernels;
    stand-ins with the kernels' contracts give the PyTorch path's completions."""
    from nemotron_recipe.models.nemotron_v3 import kernels

    model = _model()
    prompts = _prompts([9, 4])
    config = GenerationConfig(max_new_tokens=12)
    expected = [r.completion_ids for r in generate(model, prompts, config)]
    calls = []
    monkeypatch.setattr(kernels, "_KERNEL_DEVICES", ("cuda", "cpu"))
    def counted(*args, **kwargs):
        calls.append(1)
        return _fake_state_update(*args, **kwargs)

    monkeypatch.setattr(kernels, "_cuda_state_update", lambda: counted)
    monkeypatch.setattr(kernels, "_cuda_conv_update", lambda: _fake_conv_update)
    assert [r.completion_ids for r in generate(model, prompts, config)] == expected
    assert len(calls) == 11 * 2  # two Mamba blocks, eleven steps after the prefill
