#!/usr/bin/env bash
# `make demo-cluster`: the local cluster in DIR with the CPU quickstart TrainingJob training on
# it (examples/cpu-quickstart.yaml as shipped, its data made by e2e/cluster/prepare-data.yaml),
# left running for a person to look at with kubectl. Stop it with e2e/cluster/down.sh DIR.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
[[ $# -eq 1 ]] || { echo "usage: $0 DIR" >&2; exit 2; }
DIR=$1
"$HERE/down.sh" "$DIR" 2>/dev/null || true
rm -rf "$DIR"
"$HERE/up.sh" "$DIR"
DIR=$(cd "$DIR" && pwd)
set -a; . "$DIR/env"; set +a
kubectl() { "$TENSORFLEET_K8S_BIN/kubectl" "$@"; }
cd "$ROOT"
kubectl create configmap corpus --from-file=corpus.txt=examples/local/data/corpus.txt >/dev/null
kubectl apply -f e2e/cluster/prepare-data.yaml >/dev/null
kubectl wait --for=jsonpath='{.status.phase}'=Succeeded pod/prepare-data --timeout=180s >/dev/null
kubectl apply -f examples/cpu-quickstart.yaml
cat <<EOT

The local cluster runs in $DIR; the CPU quickstart is training on it. Try:

  export KUBECONFIG=$DIR/kubeconfig PATH=$TENSORFLEET_K8S_BIN:\$PATH
  kubectl get trainingjobs -w              # phase, workers, progress
  kubectl get nodes,pods -A -o wide
  kubectl describe trainingjob cpu-quickstart
  kubectl logs cpu-quickstart-launcher     # the training log
  ls $DIR/volumes/                         # the claims: checkpoints, events, model.onnx

Stop it with: make demo-cluster-down   (or e2e/cluster/down.sh $DIR)
EOT
