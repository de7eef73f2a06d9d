"""The parallelizer against a single-process run: step-0 logits, losses of five steps and step-1
gradients, for data, tensor, sequence and context parallel and their combinations.

Each torchrun job trains the same seeded model on several meshes in turn (tests/distributed/
parity_worker.py); the single-process reference runs inside the same job on rank 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from nemotron_recipe.distributed import ParallelConfigError, ParallelPlan
from nemotron_recipe.distributed.plan import check_experts_split
from nemotron_recipe.models.nemotron_v3 import PRESETS, NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.models.nemotron_v3.parallelization import (
    _decoder_blocks,
    check_context_parallel,
    check_expert_parallel,
    check_tensor_parallel,
)

WORKER = Path(__file__).parent / "distributed" / "parity_worker.py"
FP32_LOSS_RTOL = 1e-5
FP32_GRAD_RTOL = 1e-5  # max |g - g_ref| / max |g_ref| per parameter, after step 1
BF16_LOSS_RTOL = 2e-2
BF16_GRAD_RTOL = 1e-1


def torchrun(nproc: int, out: Path, cases: list[str], timeout: int = 600) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(WORKER), str(out), *cases]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(out.read_text())


def check_case(result: dict, dtype: str) -> None:
    loss_tol, grad_tol = (FP32_LOSS_RTOL, FP32_GRAD_RTOL) if dtype == "fp32" else (BF16_LOSS_RTOL, BF16_GRAD_RTOL)
    if dtype == "fp32":
        assert result["logits_rel_err"] <= FP32_LOSS_RTOL, f"step-0 logits differ by {result['logits_rel_err']:.2e}"
    for step, (loss, ref) in enumerate(zip(result["losses"], result["ref_losses"])):
        assert abs(loss - ref) <= loss_tol * abs(ref), f"step {step}: {loss} vs single process {ref}"
    assert not result["missing_grads"]
    worst = max(result["grad_rel_err"].items(), key=lambda kv: kv[1])
    assert worst[1] <= grad_tol, f"gradient of {worst[0]} differs by {worst[1]:.2e} (relative)"


TWO_RANK_CASES = [
    # dp_replicate, dp_shard, cp, tp, sequence_parallel, ac, dtype
    "1,2,1,1,0,none,fp32",  # FSDP 2
    "1,2,1,1,0,blocks,fp32",
    "1,1,1,2,0,none,fp32",  # TP 2
    "1,1,1,2,0,blocks,fp32",
    "1,1,1,2,1,none,fp32",  # TP 2 + SP
    "1,1,1,2,1,blocks,fp32",
    "1,1,1,2,1,full,fp32",
    "1,2,1,1,0,selective,bf16",
    "1,1,1,2,1,none,bf16_offload",
    "1,1,2,1,0,none,fp32",  # CP 2
    "1,1,2,1,0,blocks,fp32",
    "1,2,1,1,0,none,fp32,moe,ep2",  # expert parallel 2 over dp_shard
    "1,2,1,1,0,none,fp32,moe_grouped,ep2",
    "1,2,1,1,0,full,fp32,moe,ep2",
    "1,1,2,1,0,none,fp32,moe,ep2",  # expert parallel 2 over cp
    "1,2,1,1,0,none,fp32,moe,ep2,mean",  # FSDP's averaging: the experts divide by every data-parallel rank too
    "1,1,1,2,1,full,fp32,moe_grouped",  # TP 2 + SP: each tp rank routes its sequence shard
    "1,1,2,1,0,none,fp32,moe_aux",  # CP 2 with the sequence-wise balance loss: sequences split over ranks
    "1,1,1,2,1,none,fp32,moe,ep1,mean",  # TP 2 + SP under FSDP's averaging: MoE gradients sum over tp
]
FOUR_RANK_CASES = [
    "1,2,1,2,0,none,fp32",  # FSDP 2 x TP 2
    "1,2,1,2,0,blocks,fp32",
    "2,2,1,1,0,none,fp32",  # HSDP 2 x 2
    "2,2,1,1,0,blocks,fp32",
    "1,2,1,2,1,blocks,bf16",  # FSDP 2 x TP 2 + SP, bf16
    "1,2,1,2,0,none,fp32,hf",  # transformers' NemotronH, reference plan
    "1,1,2,2,0,none,fp32",  # CP 2 x TP 2
    "1,1,2,2,1,blocks,fp32",  # CP 2 x TP 2 + SP
    "1,2,2,1,0,none,fp32",  # FSDP 2 x CP 2
    "1,1,4,1,0,none,fp32",  # CP 4
    "1,1,1,4,0,none,fp32",  # TP 4 over 2 key/value heads: each lives on 2 ranks
    "1,1,1,4,1,full,fp32",  # the same with SP and full recompute
    "1,1,4,1,0,none,fp32,groups2",  # CP 4 over 2 Mamba groups: each group split in two
    "1,1,2,2,0,none,fp32,groups2",  # CP 2 x TP 2 over 2 Mamba groups: 1 group per tp rank, split in two
    "1,2,1,2,1,none,fp32,moe,ep2",  # EP 2 x TP 2 + SP
    "1,2,1,2,1,blocks,fp32,moe_aux,ep2",  # ... with the balance loss and recompute
    "1,2,2,1,0,blocks,fp32,moe_grouped,ep2",  # EP 2 x CP 2: each expert FSDP-sharded over 2 ranks
    "2,2,1,1,0,none,fp32,moe,ep2",  # EP 2 inside HSDP 2 x 2
    "1,4,1,1,0,none,fp32,moe,ep4",
]
EP_CASES = [case for case in TWO_RANK_CASES + FOUR_RANK_CASES if ",ep" in case]
SPLIT_GROUP_CASES = [case for case in FOUR_RANK_CASES if case.endswith(",groups2")]


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory):
    return torchrun(2, tmp_path_factory.mktemp("tp") / "out.json", TWO_RANK_CASES)


@pytest.fixture(scope="module")
def four_rank(tmp_path_factory):
    return torchrun(4, tmp_path_factory.mktemp("tp") / "out.json", FOUR_RANK_CASES)


@pytest.mark.distributed
@pytest.mark.parametrize("case", TWO_RANK_CASES)
def test_two_ranks_match_single_process(two_rank, case):
    check_case(two_rank[case], case.split(",")[6].removesuffix("_offload"))


@pytest.mark.distributed
@pytest.mark.parametrize("case", FOUR_RANK_CASES)
def test_four_ranks_match_single_process(four_rank, case):
    check_case(four_rank[case], case.split(",")[6])


@pytest.mark.distributed
def test_tensor_parallel_shards_every_dense_block(two_rank, four_rank):
    for result in (two_rank["1,1,1,2,0,none,fp32"], four_rank["1,2,1,2,0,none,fp32"]):
        for block, fraction in result["tp_held_fraction"].items():
            if block.endswith("moe"):
                assert fraction == 1.0  # MoE blocks stay replicated across tp
            else:
                assert fraction <= 0.55, f"block {block} keeps {fraction:.0%} of its parameters per rank"
    hf = four_rank["1,2,1,2,0,none,fp32,hf"]["tp_held_fraction"]
    assert all(f <= 0.55 for b, f in hf.items() if b.endswith("mlp"))


@pytest.mark.distributed
def test_moe_blocks_route_each_tp_ranks_sequence_shard(two_rank, four_rank):
    """With sequence parallel each tp rank routes only its part of the sequence (no gather); without, all."""
    results = two_rank | four_rank
    for case in ("1,1,1,2,1,none,fp32", "1,1,1,2,1,full,fp32,moe_grouped", "1,2,1,2,1,none,fp32,moe,ep2"):
        assert results[case]["moe_token_share"] == 0.5, case
    for case in ("1,1,1,2,0,none,fp32", "1,2,1,2,0,none,fp32", "1,2,1,1,0,none,fp32,moe,ep2"):
        assert results[case]["moe_token_share"] == 1.0, case


@pytest.mark.distributed
def test_cp_beyond_the_groups_of_a_rank_splits_them(four_rank):
    """The groups2 cases match one process through the virtual-group path, not around it."""
    for case in SPLIT_GROUP_CASES:
        assert four_rank[case]["split_group_scans"] > 0, f"{case}: no Mamba2 scan ran on split groups"
    assert four_rank["1,1,4,1,0,none,fp32"]["split_group_scans"] == 0  # 4 groups over cp 4: whole groups


@pytest.mark.distributed
def test_expert_parallel_ranks_hold_their_share_of_the_experts(two_rank, four_rank):
    """Each rank holds n_routed_experts / ep experts, further split by FSDP over the ranks left."""
    for case in EP_CASES:
        rep, shard, cp, tp = (int(v) for v in case.split(",")[:4])
        result = (two_rank if rep * shard * cp * tp == 2 else four_rank)[case]
        held, total = result["expert_elements"]
        ep = int(case.split(",")[8].removeprefix("ep"))
        assert held * shard * cp == total, f"{case}: a rank holds {held} of {total} expert elements (ep {ep})"


# ------------------------------------------------------------------ validation, no ranks needed
def _model(**dims):
    return NemotronHForCausalLM(NemotronHConfig(**{**vars(PRESETS["tiny"]), **dims}))


@pytest.mark.parametrize(
    "dims,tp,needle",
    [
        (dict(pattern="*", num_attention_heads=6, num_key_value_heads=2), 4, "num_attention_heads=6"),
        (dict(pattern="*", num_attention_heads=12, num_key_value_heads=3), 4, "num_key_value_heads=3"),
        (dict(pattern="M", mamba_num_heads=8, n_groups=2), 4, "n_groups=2"),
        (dict(pattern="-", intermediate_size=30), 4, "intermediate_size=30"),
    ],
)
def test_tp_that_does_not_divide_is_a_clear_error(dims, tp, needle):
    with pytest.raises(ParallelConfigError, match=f"mesh.tp={tp}") as err:
        check_tensor_parallel(_model(**dims), tp, None, False)
    assert needle in str(err.value) and "Fix:" in str(err.value)


@pytest.mark.parametrize(
    "dims,tp,cp,needle",
    [
        (dict(pattern="M", mamba_num_heads=6, n_groups=2), 1, 4, "6 heads in 2 groups"),
        (dict(pattern="M", mamba_num_heads=12, n_groups=3), 1, 2, "12 heads in 3 groups"),
        (dict(pattern="M", mamba_num_heads=8, n_groups=4), 2, 8, "4 heads in 2 groups"),
    ],
)
def test_cp_that_does_not_split_mamba_is_a_clear_error(dims, tp, cp, needle):
    with pytest.raises(ParallelConfigError, match=f"mesh.cp={cp}") as err:
        check_context_parallel(_model(**dims), tp, cp)
    assert needle in str(err.value)


def test_cp_needs_the_native_model():
    transformers = pytest.importorskip("transformers")
    hf = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**PRESETS["tiny"].to_hf_dict()))
    with pytest.raises(ParallelConfigError, match="native model|NemotronHForCausalLM"):
        check_context_parallel(hf, 1, 2)


def test_zigzag_chunks_balance_and_cover():
    from nemotron_recipe.distributed.context_parallel import zigzag_positions

    parts = [zigzag_positions(24, 3, r) for r in range(3)]
    assert [p.tolist() for p in parts][0] == [0, 1, 2, 3, 20, 21, 22, 23]
    assert sorted(torch.cat(parts).tolist()) == list(range(24))
    with pytest.raises(ValueError, match="trainer.seq_len=20"):
        zigzag_positions(20, 3, 0)


def test_index_tensors_made_while_tracing_with_fake_tensors_are_not_kept():
    """The memory planner traces a launch with fake tensors before the launch runs the same shapes:
    a cached fake index would reach the real run."""
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    from nemotron_recipe.distributed.context_parallel import zigzag_positions

    zigzag_positions.cache_clear()
    with FakeTensorMode():
        assert is_fake(zigzag_positions(40, 2, 1, torch.device("cpu")))
    real = zigzag_positions(40, 2, 1, torch.device("cpu"))
    assert not is_fake(real) and zigzag_positions(40, 2, 1, torch.device("cpu")) is real  # cached outside


def test_unknown_plan_and_sp_misuse_are_clear_errors():
    model = _model()
    with pytest.raises(ParallelConfigError, match="unknown plan"):
        check_tensor_parallel(model, 2, "rows", False)
    with pytest.raises(ParallelConfigError, match="sequence_parallel"):
        check_tensor_parallel(model, 2, "mlp", True)


def _plan_cfg(seq_len=128, ac="none", every=2, param_dtype="fp32", **mesh):
    mesh = {"dp_replicate": 1, "dp_shard": -1, "cp": 1, "tp": 1, "ep": 1, "sequence_parallel": False, **mesh}
    return SimpleNamespace(
        mesh=SimpleNamespace(**mesh), ac=SimpleNamespace(mode=ac, every=every),
        fsdp=SimpleNamespace(param_dtype=param_dtype, reduce_dtype="fp32", offload=False, reshard_after_forward=None),
        trainer=SimpleNamespace(seq_len=seq_len),
    )


@pytest.mark.parametrize(
    "settings,world,needle",
    [
        (dict(dp_shard=2, tp=2), 8, "= 4, but the world size is 8"),
        (dict(tp=3), 8, "does not divide the world size 8"),
        (dict(sequence_parallel=True), 2, "needs tensor parallel"),
        (dict(tp=4), 1, "needs 4 processes, but this is a single process"),
        (dict(cp=2, seq_len=30), 2, "trainer.seq_len=30 is not divisible by 4"),
        (dict(tp=2, sequence_parallel=True, cp=2, seq_len=36), 4, "not divisible by 8"),
        (dict(ac="sometimes"), 1, "ac.mode='sometimes'"),
        (dict(ac="every_nth", every=0), 1, "ac.every=0"),
        (dict(param_dtype="fp16"), 1, "fsdp.param_dtype='fp16'"),
        (dict(ep=3), 4, "mesh.ep=3 does not divide dp_shard x cp = 4 x 1 = 4"),
        (dict(ep=4, tp=2), 4, "mesh.ep=4 does not divide dp_shard x cp = 2 x 1 = 2"),
        (dict(ep=0), 2, "mesh.ep=0: must be >= 1"),
        (dict(ep=4, cp=2), 1, "mesh.cp=2 mesh.ep=4 needs 4 processes"),
    ],
)
def test_plan_errors_name_the_field_and_a_fix(settings, world, needle):
    with pytest.raises(ParallelConfigError, match=needle) as err:
        ParallelPlan.from_config(_plan_cfg(**settings), world)
    assert "Fix:" in str(err.value)


def test_single_process_asked_for_a_mesh_is_told_how_to_launch():
    with pytest.raises(ParallelConfigError) as err:
        ParallelPlan.from_config(_plan_cfg(tp=4), 1)
    assert "torchrun --standalone --nproc-per-node 4 -m recipes.finetune mesh.tp=4" in str(err.value)
    assert "NPROC_PER_NODE=4 launch/torchrun.sh mesh.tp=4" in str(err.value)


def test_plan_infers_dp_shard_and_sizes_the_data_layout():
    plan = ParallelPlan.from_config(_plan_cfg(dp_replicate=2, tp=2, sequence_parallel=True), 8)
    assert plan.describe() == {"dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 2}
    assert (plan.world_size, plan.dp_size, plan.seq_len_divisor) == (8, 4, 2)
    plan = ParallelPlan.from_config(_plan_cfg(cp=2, ep=4), 8)  # ep takes whole cp groups and dp_shard ranks
    assert plan.describe() == {"dp_replicate": 1, "dp_shard": 4, "cp": 2, "tp": 1, "ep": 4}


def test_expert_parallel_on_a_model_it_cannot_split_is_refused_before_sharding():
    import transformers

    native = NemotronHForCausalLM(NemotronHConfig(pattern="ME", n_routed_experts=6))
    with pytest.raises(ParallelConfigError, match="mesh.ep=4 does not divide the model's 6 routed experts"):
        check_expert_parallel(native, 4)
    check_expert_parallel(native, 2)
    hf = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**NemotronHConfig(pattern="ME").to_hf_dict()))
    with pytest.raises(ParallelConfigError, match="needs the native model's routed experts"):
        check_expert_parallel(hf, 2)


def test_experts_that_ep_cannot_split_evenly_are_refused():
    assert "mesh.ep=2: the model has no MoE block" in check_experts_split(2, 8, has_moe=False)
    assert "mesh.ep=4 does not divide the model's 6 routed experts" in check_experts_split(4, 6, has_moe=True)
    assert check_experts_split(2, 6, has_moe=True) is None and check_experts_split(1, 6, has_moe=False) is None


class _RemoteBlock(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.block_type = kind
        self.mixer = nn.Linear(4, 4)


@pytest.mark.parametrize("as_dict", [False, True])
def test_decoder_blocks_finds_remote_code_layout(as_dict):
    kinds = ["mamba", "attention", "mlp", "moe"]
    blocks = [_RemoteBlock(k) for k in kinds]
    model = nn.Module()
    model.backbone = nn.Module()
    model.backbone.layers = (
        nn.ModuleDict({str(i): b for i, b in enumerate(blocks)}) if as_dict else nn.ModuleList(blocks)
    )
    container, found = _decoder_blocks(model)
    assert container is model.backbone.layers and found == blocks


def test_decoder_blocks_native_and_transformers():
    model = _model()
    container, blocks = _decoder_blocks(model)
    assert container is model.model.layers and len(blocks) == len(PRESETS["tiny"].pattern)
    transformers = pytest.importorskip("transformers")
    hf = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**PRESETS["tiny"].to_hf_dict()))
    container, blocks = _decoder_blocks(hf)
    assert container is hf.model.layers
    assert [b.block_type for b in blocks] == ["linear_attention", "full_attention", "linear_attention", "mlp",
                                              "linear_attention", "moe"]
