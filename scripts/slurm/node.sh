#!/usr/bin/env bash
# One node's launcher, as the sbatch scripts beside this file run it (`srun`, one task per node):
#   bash scripts/slurm/node.sh torchrun|accelerate STAGE [--option value ...]
# Everything the launcher needs comes from SLURM's variables:
#   nnodes     SLURM_NNODES                          how many nodes the job has
#   node_rank  SLURM_NODEID                          this node's index, 0 .. nnodes-1
#   head       first host of SLURM_JOB_NODELIST      node 0, where the rendezvous listens
#   port       MAE_PORT, else 29500 + job id % 1000  a free TCP port on the head node
#   procs      MAE_PROCS_PER_NODE, else SLURM_GPUS_ON_NODE, else 1: processes on this node (one per GPU)
# `python -m torch.distributed.run` is `torchrun`, `python -m accelerate.commands.launch` is `accelerate launch`;
# MAE_PYTHON picks the interpreter (default: python on PATH).
set -euo pipefail
launcher=${1:?usage: node.sh torchrun|accelerate STAGE [options]}
shift
nnodes=${SLURM_NNODES:?not set: run this under sbatch/srun}
node_rank=${SLURM_NODEID:?not set: run this under sbatch/srun}
# `scontrol show hostnames | head -n1` in one pipe would fail now and then under pipefail: head exits after one line
# and scontrol, still writing, dies of SIGPIPE. So the whole list first, then its first line.
nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST") || {
    echo "node.sh: scontrol show hostnames '$SLURM_JOB_NODELIST' failed" >&2
    exit 2
}
head=$(head -n1 <<<"$nodes")
port=${MAE_PORT:-$((29500 + ${SLURM_JOB_ID:-0} % 1000))}
procs=${MAE_PROCS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
python=${MAE_PYTHON:-python}
# On SIGTERM the launcher passes the signal on and waits this long for the processes to write their checkpoint
# before it kills them (torch's default is 30 s; a torch whose launcher does not read the variable keeps that).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-110}

case $launcher in
torchrun)
    exec "$python" -m torch.distributed.run --nnodes "$nnodes" --node_rank "$node_rank" --nproc_per_node "$procs" \
        --rdzv-backend c10d --rdzv-endpoint "$head:$port" --rdzv-id "${SLURM_JOB_ID:-mae}" -m mae "$@"
    ;;
accelerate)
    # --multi_gpu: Accelerate's multi-process launcher (torchrun's); on nodes without GPUs it joins over gloo.
    exec "$python" -m accelerate.commands.launch --multi_gpu --num_machines "$nnodes" --machine_rank "$node_rank" \
        --main_process_ip "$head" --main_process_port "$port" --num_processes $((nnodes * procs)) -m mae "$@"
    ;;
*)
    echo "node.sh: unknown launcher '$launcher'; use torchrun or accelerate" >&2
    exit 2
    ;;
esac
