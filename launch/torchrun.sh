#!/usr/bin/env bash
# Launch `recipes.finetune` under torchrun on one node or, with NNODES > 1, on each of several nodes.
# Every argument is passed through as a Hydra override.
#
#   launch/torchrun.sh trainer.max_steps=500 mesh.tp=4
#   NNODES=2 MASTER_ADDR=node001 RDZV_ID=job42 launch/torchrun.sh mesh.tp=8   # on every node
#   DRY_RUN=1 launch/torchrun.sh ...   (or --dry-run as the first argument): print the command only
#
# Environment (defaults in brackets):
#   NNODES          number of nodes [1]
#   NPROC_PER_NODE  processes per node [one per visible GPU, counted from CUDA_VISIBLE_DEVICES if
#                   set, else nvidia-smi; without GPUs, on one node as many as the mesh needs
#                   (`python -m recipes.mesh_size <overrides>`), on several nodes 1]
#   MASTER_ADDR     host of the rendezvous store, reachable from every node [required when NNODES > 1]
#   MASTER_PORT     its port [29500]
#   RDZV_ID         id shared by the nodes of one launch [NR_RUN_ID; required when NNODES > 1]
#   NODE_RANK       this node's index; when set, node 0 hosts the rendezvous store [unset: torchrun
#                   picks the node whose own address is MASTER_ADDR]
#   NR_RUN_ID       run directory name, outputs/<NR_RUN_ID>; a named run keeps its directory from day to
#                   day, so relaunching the same line resumes it [single node: <date>/<start time>;
#                   several nodes: RDZV_ID]
set -euo pipefail

dry_run=${DRY_RUN:-0}
if [[ ${1:-} == --dry-run ]]; then
    dry_run=1
    shift
fi

die() {
    echo "launch/torchrun.sh: $*" >&2
    exit 2
}

# One line that a POSIX shell reads back as the same words.
shell_quote() {
    local word line='' sq="'" escaped_sq="'\\''"
    for word in "$@"; do
        if [[ ! $word =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
            word="'${word//$sq/$escaped_sq}'"
        fi
        line+=${line:+ }$word
    done
    printf '%s\n' "$line"
}

visible_gpus() {
    if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then
        # An empty list hides every GPU; otherwise each comma-separated entry is one device.
        if [[ -z $CUDA_VISIBLE_DEVICES ]]; then
            echo 0
        else
            local -a ids
            IFS=, read -ra ids <<<"$CUDA_VISIBLE_DEVICES"
            echo "${#ids[@]}"
        fi
    elif command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
    else
        echo 0
    fi
}

nnodes=${NNODES:-1}
[[ $nnodes =~ ^[1-9][0-9]*$ ]] || die "NNODES=$nnodes: expected a positive integer."
nproc_per_node=${NPROC_PER_NODE:-}
if [[ -z $nproc_per_node ]]; then
    nproc_per_node=$(visible_gpus)
    if ((nproc_per_node == 0 && nnodes == 1)); then
        # No devices to count, so start as many processes as the mesh needs. They are counted from
        # the recipe's own composition, so a mesh group, a key override or a mistake reads as it
        # will there, and a mistake stops the launch before any process starts.
        nproc_per_node=$(python -m recipes.mesh_size "$@") ||
            die "cannot count the processes the mesh needs (above); fix the overrides, or set NPROC_PER_NODE."
    fi
    ((nproc_per_node > 0)) || nproc_per_node=1
fi
[[ $nproc_per_node =~ ^[1-9][0-9]*$ ]] || die "NPROC_PER_NODE=$nproc_per_node: expected a positive integer."

torchrun_args=(--nnodes "$nnodes" --nproc-per-node "$nproc_per_node")
if ((nnodes == 1)); then
    torchrun_args+=(--standalone)
    # torchrun --standalone names its rendezvous with a random UUID; the start date and time read
    # better as a run directory and are shared by all local ranks through the environment.
    run_id=${NR_RUN_ID:-$(date +%Y-%m-%d/%H-%M-%S)}
else
    [[ -n ${MASTER_ADDR:-} ]] ||
        die "NNODES=$nnodes needs MASTER_ADDR, the address of the node that hosts the rendezvous."
    rdzv_id=${RDZV_ID:-${NR_RUN_ID:-}}
    [[ -n $rdzv_id ]] ||
        die "NNODES=$nnodes needs RDZV_ID (or NR_RUN_ID), the same on every node of this launch."
    torchrun_args+=(
        --rdzv-backend c10d
        --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}"
        --rdzv-id "$rdzv_id"
    )
    if [[ -n ${NODE_RANK:-} ]]; then
        [[ $NODE_RANK =~ ^[0-9]+$ ]] || die "NODE_RANK=$NODE_RANK: expected a non-negative integer."
        # The c10d rendezvous assigns ranks itself, so the node rank only settles which node hosts
        # the store; guessing it from MASTER_ADDR fails when that is an alias or another interface.
        if ((NODE_RANK == 0)); then
            torchrun_args+=(--rdzv-conf is_host=true)
        else
            torchrun_args+=(--rdzv-conf is_host=false)
        fi
    fi
    # A per-node timestamp would split one run over several directories.
    run_id=${NR_RUN_ID:-$rdzv_id}
fi

cmd=(torchrun "${torchrun_args[@]}" -m recipes.finetune "$@")

if [[ -n $dry_run && $dry_run != 0 ]]; then
    shell_quote "NR_RUN_ID=$run_id" "${cmd[@]}"
    exit 0
fi

export NR_RUN_ID=$run_id
# exec, so that signals meant for the launch reach torchrun rather than an idle shell. Dispositions
# survive exec: launch/slurm.sbatch starts this script with SIGUSR1 ignored, so the torchrun agent
# ignores it too, while the trainer processes install their own handler.
exec "${cmd[@]}"
