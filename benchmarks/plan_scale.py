"""The planner at scale: every preset at world sizes 8, 64 and 512 with the mesh a user would pick,
bf16 compute with fp32 master weights and AdamW, one sequence of `--seq-len` tokens per micro-batch,
on 80 GiB devices; prints a Markdown table (per-rank GiB, verdict, seconds to plan) for docs/planner-validation.md.

    python -m benchmarks.plan_scale
    python -m benchmarks.plan_scale --models nemotron_h_56b --worlds 8,16,32,64,128,256,512 --ac none,full
"""

from __future__ import annotations

import argparse
import time

from hydra import compose, initialize_config_dir

import nemotron_recipe.config  # noqa: F401  (registers the schema)
from nemotron_recipe.training.planner.estimate import Planner
from nemotron_recipe.training.planner.launch import GIB, Launch, evaluate
from tests.helpers import CONF

# The mesh a user would choose per model: dense models up to 9B shard with FSDP alone; the 47B and
# 56B models add tensor parallel over a node with sequence parallel; the MoE model splits its experts.
MESHES = {
    "tiny": [],
    "nemotron_h_8b": [],
    "nemotron_nano_9b_v2": [],
    "nemotron3_nano_30b_a3b": ["mesh.ep=8"],
    "nemotron_h_47b": ["mesh.tp=8", "mesh.sequence_parallel=true"],
    "nemotron_h_56b": ["mesh.tp=8", "mesh.sequence_parallel=true"],
}


def plan_row(model: str, world: int, ac: str, seq_len: int, planners: dict) -> str:
    mesh = MESHES[model]
    tp = next((int(o.split("=")[1]) for o in mesh if o.startswith("mesh.tp=")), 1)
    overrides = [f"model={model}", *mesh, f"ac={ac}", "fsdp=bf16", f"trainer.seq_len={seq_len}",
                 "trainer.micro_batch_size=1", f"trainer.global_batch_size={world // tp}", "run_dir=/tmp/plan_scale"]
    began = time.perf_counter()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="finetune", overrides=overrides)
    launch = Launch.from_config(cfg, world, 80 * GIB)
    key = (model, ac, seq_len)
    planner = planners.setdefault(key, Planner(launch.config, launch.work, launch.trainability))
    o = evaluate(planner, launch)
    e = o.estimate
    seconds = time.perf_counter() - began
    act = f"{e.activations / GIB:.1f}" if e.trace else "-"
    verdict = "fits" if o.fits else "no"
    return (f"| {model} | {' '.join(m.removeprefix('mesh.') for m in mesh) or 'fsdp'} | {world} | {ac} | "
            f"{e.state.params / GIB:.1f} | {e.state.grads / GIB:.1f} | {e.state.optimizer / GIB:.1f} | {act} | "
            f"{e.device_total / GIB:.1f} | {verdict} | {o.time['floor_s']:.2f} | {seconds:.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MESHES))
    p.add_argument("--worlds", default="8,64,512")
    p.add_argument("--ac", default="full")
    p.add_argument("--seq-len", type=int, default=8192)
    args = p.parse_args()
    print("| model | mesh | world | ac | params | grads | optimizer | activations | total GiB | fits 80 GiB "
          "| step floor s | plan s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    planners: dict = {}
    for model in args.models.split(","):
        for ac in args.ac.split(","):
            for world in map(int, args.worlds.split(",")):
                print(plan_row(model, world, ac, args.seq_len, planners), flush=True)


if __name__ == "__main__":
    main()
