"""The plan as text for a terminal, or as one JSON object."""

from __future__ import annotations

from typing import Any

from .launch import GIB, Outcome
from .suggest import Suggestion


def _gib(n: float) -> float:
    return round(n / GIB, 2)


def verdict(outcome: Outcome) -> str:
    if outcome.estimate.trace is None:
        return "does not fit (the sharded state alone exceeds the device)"
    return "fits" if outcome.fits else "does not fit"


def as_dict(outcome: Outcome, suggestions: list[Suggestion]) -> dict[str, Any]:
    launch, est = outcome.launch, outcome.estimate
    p, w, hw = launch.plan, launch.work, launch.hardware
    return {
        "model": {"pattern": launch.config.pattern, "hidden_size": launch.config.hidden_size,
                  "lora_rank": launch.trainability.lora.rank if launch.trainability.lora else None},
        "world_size": p.world_size,
        "mesh": {**p.describe(), "sequence_parallel": p.sequence_parallel},
        "ac": p.ac.mode, "param_dtype": str(p.param_dtype).removeprefix("torch."), "offload": p.offload,
        "micro_batch_size": w.micro_batch, "seq_len": w.seq_len, "grad_accum_steps": launch.grad_accum,
        "per_rank_gib": {
            "params": _gib(est.state.params), "grads": _gib(est.state.grads), "optimizer": _gib(est.state.optimizer),
            "reference": _gib(est.reference),
            "activations": _gib(est.activations) if est.trace else None,
            "total": _gib(est.device_total), "host_offloaded": _gib(est.host_total),
        },
        "per_rank_bytes": {"params": est.state.params, "grads": est.state.grads, "optimizer": est.state.optimizer,
                           "reference": est.reference,
                           "activations": est.activations if est.trace else None, "total": est.device_total},
        "device_memory_gib": _gib(launch.budget), "device": launch.device,
        "verdict": verdict(outcome), "fits": outcome.fits,
        "bytes_per_rank_per_step": {k: int(v) for k, v in outcome.traffic.items()},
        "step_time_s": dict(outcome.time),
        "hardware": {"tflops_per_device": hw.tflops_per_device, "link_gbps": hw.link_gbps, "ib_gbps": hw.ib_gbps,
                     "devices_per_node": hw.devices_per_node, "pcie_gbps": hw.pcie_gbps},
        "pipeline": _pipeline_dict(outcome),
        "suggestions": [{"change": s.change, "total_gib": _gib(s.outcome.estimate.device_total),
                         "fits": s.outcome.fits, "floor_s": s.outcome.time["floor_s"]}
                        for s in suggestions],
    }


def _pipeline_dict(outcome: Outcome) -> dict[str, Any] | None:
    r = outcome.pipeline
    if r is None:
        return None
    return {"schedule": r.layout.schedule, "virtual_stages": r.layout.virtual_stages,
            "split_points": r.split.split_points, "by_hand": r.split.by_hand,
            "stage_time_shares": [round(x, 4) for x in r.split.shares],
            "slowest_share": round(r.split.slowest_share, 4), "equal_split_slowest_share": round(r.split.equal_slowest_share, 4),
            "bubble": round(r.played.bubble, 4), "rank_total_gib": [_gib(t) for t in r.rank_totals],
            "reported_rank": r.rank, "rank_stages": [list(s) for s in r.rank_stages]}


def pipeline_lines(outcome: Outcome) -> list[str]:
    r = outcome.pipeline
    if r is None:
        return []
    n, pp = outcome.launch.grad_accum, outcome.launch.plan.pp
    totals = ", ".join(f"{_gib(t):.2f}" for t in r.rank_totals)
    return [f"pipeline: pp={pp}, {r.split.n_stages} stages, {r.layout.schedule} over {n} micro-batches per step: "
            f"bubble {r.played.bubble:.1%} of the step; GiB per pipeline rank [{totals}] (the figures above are "
            f"rank {r.rank}'s, the largest)", *r.split.describe()]


def suggestion_lines(suggestions: list[Suggestion]) -> list[str]:
    lines = []
    for i, s in enumerate(suggestions, 1):
        total = s.outcome.estimate.device_total
        at_least = "" if s.outcome.estimate.trace is not None else ">= "
        mark = "fits" if s.outcome.fits else "does not fit"
        lines.append(f"  {i}. {s.change}: {at_least}{total / GIB:.2f} GiB per rank ({mark})")
    return lines


def as_text(outcome: Outcome, suggestions: list[Suggestion]) -> str:
    d = as_dict(outcome, suggestions)
    g, hw = d["per_rank_gib"], d["hardware"]
    mesh = " ".join(f"{k}={v}" for k, v in d["mesh"].items())
    act = "not traced" if g["activations"] is None else f"{g['activations']:.2f} GiB"
    lines = [
        (f"world {d['world_size']}: {mesh}; ac={d['ac']}, compute {d['param_dtype']}, offload {d['offload']}; "
        f"micro-batch {d['micro_batch_size']} x {d['seq_len']} tokens, {d['grad_accum_steps']} per step"),
        "per rank:",
        f"  parameters   {g['params']:8.2f} GiB",
        f"  gradients    {g['grads']:8.2f} GiB",
        f"  optimizer    {g['optimizer']:8.2f} GiB",
        f"  activations  {act:>12}   (peak of one micro-batch: activations, temporaries, gathered parameters)",
        f"  total        {g['total']:8.2f} GiB of {d['device_memory_gib']:.2f} GiB ({d['device']}): {d['verdict']}",
    ]
    if g["host_offloaded"]:
        lines.append(f"  host memory  {g['host_offloaded']:8.2f} GiB (offloaded state)")
    lines.append("bytes sent per rank per step:")
    lines += [f"  {k:20} {v / GIB:10.3f} GiB" for k, v in d["bytes_per_rank_per_step"].items() if v]
    t = d["step_time_s"]
    lines.append(f"step-time floor {t['floor_s']:.3f} s (compute {t['compute_s']:.3f} s at {hw['tflops_per_device']:g} "
                 f"TFLOP/s, traffic {t['comm_s']:.3f} s at {hw['link_gbps']:g} Gbit/s in a node of "
                 f"{hw['devices_per_node']}, {hw['ib_gbps']:g} Gbit/s across, {hw['pcie_gbps']:g} Gbit/s to the host; "
                 "perfect overlap)")
    lines += pipeline_lines(outcome)
    if suggestions:
        lines.append("faster layouts that also fit, fastest first:" if d["fits"] else "changes that fit, fastest first:")
        lines += suggestion_lines(suggestions)
    elif not d["fits"]:
        lines.append("no change tried fits (one split, precision, offload, LoRA or checkpointing change at a time, two "
                     "memory savers together, up to 64x the ranks): a smaller model or more memory per device is needed")
    return "\n".join(lines)
