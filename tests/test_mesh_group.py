"""The `mesh` config group: named layouts that compose with `mesh.*` keys, and the process count
that launch/torchrun.sh reads from them (recipes/mesh_size.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from nemotron_recipe.config import MeshConfig
from recipes import mesh_size
from tests.helpers import CONF, REPO

# name: (dp_replicate, dp_shard, cp, tp, sequence_parallel), processes without GPUs
LAYOUTS = {
    "single": ((1, -1, 1, 1, False), 1),
    "fsdp": ((1, -1, 1, 1, False), 1),
    "hsdp": ((2, -1, 1, 1, False), 2),
    "tp2": ((1, -1, 1, 2, False), 2),
    "tp2_sp": ((1, -1, 1, 2, True), 2),
    "tp4_sp": ((1, -1, 1, 4, True), 4),
    "tp8_sp": ((1, -1, 1, 8, True), 8),
    "cp2": ((1, -1, 2, 1, False), 2),
    "tp2_cp2": ((1, -1, 2, 2, False), 4),
    "pp2": ((1, 1, 1, 1, False, 2), 2),
    "pp2_fsdp": ((1, -1, 1, 1, False, 2), 2),
    "pp4_tp2_sp": ((1, -1, 1, 2, True, 4), 8),
}
FIELDS = ("dp_replicate", "dp_shard", "cp", "tp", "sequence_parallel", "pp")


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="finetune", overrides=list(overrides), return_hydra_config=True)


def _values(mesh) -> tuple:
    """The sizes, `pp` only where it is not 1."""
    values = tuple(getattr(mesh, name) for name in FIELDS)
    return values if values[-1] != 1 else values[:-1]


def test_every_layout_file_is_tested() -> None:
    assert sorted(p.stem for p in (CONF / "mesh").glob("*.yaml")) == sorted(LAYOUTS)


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_composes(name: str) -> None:
    values, nproc = LAYOUTS[name]
    cfg = _compose(f"mesh={name}")
    assert _values(cfg.mesh) == values
    assert cfg.hydra.runtime.choices.mesh == name
    assert mesh_size.processes_needed(cfg.mesh) == nproc


def test_default_is_single_and_the_schema_defaults() -> None:
    cfg = _compose()
    assert cfg.hydra.runtime.choices.mesh == "single"
    assert OmegaConf.to_container(cfg.mesh) == OmegaConf.to_container(OmegaConf.structured(MeshConfig))
    job = OmegaConf.to_container(cfg)
    job.pop("hydra")
    explicit = OmegaConf.to_container(_compose("mesh=single"))
    explicit.pop("hydra")
    assert job == explicit


@pytest.mark.parametrize(
    ("overrides", "values"),
    [
        (["mesh=tp2_sp", "mesh.cp=2"], (1, -1, 2, 2, True)),
        (["mesh.cp=2", "mesh=tp2_sp"], (1, -1, 2, 2, True)),  # keys win over the group in any order
        (["mesh=hsdp", "mesh.dp_shard=4", "mesh.tp=2"], (2, 4, 1, 2, False)),
        (["mesh.tp=4", "mesh.sequence_parallel=true"], (1, -1, 1, 4, True)),
    ],
)
def test_layout_and_keys_combine(overrides: list[str], values: tuple) -> None:
    assert _values(_compose(*overrides).mesh) == values


def test_a_layout_keeps_the_schema_types() -> None:
    with pytest.raises(Exception, match="mesh.tp"):
        _compose("mesh=tp2", "mesh.tp=two")


@pytest.mark.parametrize(
    ("overrides", "printed"),
    [([], "1"), (["mesh=tp2_sp", "mesh.cp=2"], "4"), (["mesh=hsdp", "mesh.dp_shard=3"], "6"),
     (["mesh=pp2_fsdp", "mesh.dp_shard=2"], "4")],
)
def test_mesh_size_prints_the_process_count(
    overrides: list[str], printed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert mesh_size.main(overrides) == 0
    assert capsys.readouterr().out == printed + "\n"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["mesh=tp3"], "Could not find 'mesh/tp3'"),
        (["mesh.tp=two"], "could not be converted to Integer"),
        (["mesh.tpp=2"], "mesh.tpp"),
        (["mesh.tp=0"], "mesh.tp=0: must be >= 1."),
        (["mesh.dp_shard=0"], "mesh.dp_shard=0: must be >= 1, or -1"),
    ],
)
def test_mesh_size_reports_bad_overrides(
    overrides: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert mesh_size.main(overrides) == 1
    out, err = capsys.readouterr()
    assert out == "" and message in err


def test_help_lists_the_layouts() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.finetune", "--help"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"mesh: {', '.join(sorted(LAYOUTS))}" in proc.stdout.splitlines()
