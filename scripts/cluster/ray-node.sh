#!/usr/bin/env bash
# Start this host's Ray node for rlkit: the head, or a worker that joins it. Run it on every host
# (head first), then rlkit on the head with --address HEAD_IP:PORT.
#
#   scripts/cluster/ray-node.sh head [ray start options]             # prints the address to give rlkit
#   scripts/cluster/ray-node.sh worker HEAD_IP:PORT [ray start options]
#
# Options go to `ray start` as they are: --node-ip-address=IP (the address the other hosts reach
# this one at; needed where the host has several networks), --num-cpus / --num-gpus,
# --resources='{"NPU": 8}' (ascend-910b.sh sets it), --block (stay in the foreground: Slurm, tests).
# RLKIT_RAY_PORT sets the head's port (6379).
#
# Every host needs the same rlkit install (same Python environment) and must see output_dir and
# model.path at the same path (a shared filesystem); rlkit checks both before launch.
# Token authentication: `ray start --head` turns it on where ~/.ray/auth_token exists; every host
# and the rlkit client then need that token (a shared home, or RAY_AUTH_MODE=token with
# RAY_AUTH_TOKEN_PATH pointing at a copy).
set -euo pipefail
role=${1:-}
shift || true
ray=${RAY:-ray}
port=${RLKIT_RAY_PORT:-6379}
export RAY_USAGE_STATS_ENABLED=0
case "$role" in
  head)
    exec "$ray" start --head --port="$port" --disable-usage-stats "$@" ;;
  worker)
    address=${1:?usage: ray-node.sh worker HEAD_IP:PORT [ray start options]}
    shift
    exec "$ray" start --address="$address" --disable-usage-stats "$@" ;;
  *)
    echo "usage: ray-node.sh head [ray start options] | ray-node.sh worker HEAD_IP:PORT [ray start options]" >&2
    exit 2 ;;
esac
