"""What a pipeline-parallel mesh does not run: each refused before any process group or model exists."""

from __future__ import annotations

from typing import Any


def pipeline_problems(cfg: Any) -> list[str]:
    """Settings a pipeline-parallel run (mesh.pp > 1) cannot train with, each naming its field and a fix;
    checked on every rank before any process group or model exists."""
    pp = int(getattr(cfg.mesh, "pp", 1))
    if pp <= 1:
        return []
    problems = []
    if cfg.objective.name != "sft":
        problems.append(f"objective.name={cfg.objective.name} with mesh.pp={pp}: a pipeline trains the sft objective "
                        "only (DPO's reference forward and its pair loss are not run through the stages). Fix: "
                        "objective=sft, or mesh.pp=1 with FSDP/TP to fit the model.")
    if cfg.trainer.compile:
        problems.append(f"trainer.compile=true with mesh.pp={pp}: compiling pipeline stages is not supported. "
                        "Fix: trainer.compile=false.")
    return problems
