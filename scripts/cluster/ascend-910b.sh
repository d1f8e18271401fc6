#!/usr/bin/env bash
# A Ray node on an Atlas 800T A2 host (8 x Ascend 910B, seed 002's hardware): the NPUs as Ray's
# "NPU" resource (rlkit's device layer asks for it on NPU) and the HCCL settings for two or more
# hosts. Same arguments as ray-node.sh:
#
#   scripts/cluster/ascend-910b.sh head --node-ip-address=10.0.0.1
#   scripts/cluster/ascend-910b.sh worker 10.0.0.1:6379 --node-ip-address=10.0.0.2
#
# HCCL_SOCKET_IFNAME: the interface the hosts reach each other on (e.g. enp189s0f0), when the
# host has several; set it before running this script.
set -euo pipefail
export HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-1800}  # seed 002: slow first connections of 16 ranks
export HCCL_EXEC_TIMEOUT=${HCCL_EXEC_TIMEOUT:-1800}
export HCCL_BUFFSIZE=${HCCL_BUFFSIZE:-200}  # MiB per link; the default 200, named here to tune
export ASCEND_RT_VISIBLE_DEVICES=${ASCEND_RT_VISIBLE_DEVICES:-0,1,2,3,4,5,6,7}
npus=$(awk -F, '{print NF}' <<<"$ASCEND_RT_VISIBLE_DEVICES")
role=${1:?usage: ascend-910b.sh head|worker [HEAD_IP:PORT] [ray start options]}
shift
if [[ $role == worker ]]; then
  address=${1:?usage: ascend-910b.sh worker HEAD_IP:PORT [ray start options]}
  shift
  set -- "$address" "$@"
fi
exec "$(dirname "$0")/ray-node.sh" "$role" "$@" --num-gpus=0 --resources="{\"NPU\": $npus}"
