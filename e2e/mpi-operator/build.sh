#!/usr/bin/env bash
# Builds Kubeflow's MPI Operator (the peer of the operator benchmark) from its Go module source,
# and caches the binary next to the MPIJob CRD that ships in the same module.
#
#   DIR=$(e2e/mpi-operator/build.sh | tail -1)   # DIR/mpi-operator, DIR/kubeflow.org_mpijobs.yaml
#
# The last line of stdout is the cache dir; progress goes to stderr. Returns at once when cached.
# Cache root: $TENSORFLEET_CACHE, else ${XDG_CACHE_HOME:-$HOME/.cache}/tensorfleet.
set -euo pipefail

# Pinned: the newest v0.x tag of github.com/kubeflow/mpi-operator when this was written. To move
# it, `go list -m -versions github.com/kubeflow/mpi-operator` (where the proxy answers /@v/list),
# or the repository's tags.
MPI_OPERATOR_VERSION=v0.8.0
MODULE=github.com/kubeflow/mpi-operator
CRD_IN_MODULE=manifests/base/kubeflow.org_mpijobs.yaml

CACHE_ROOT=${TENSORFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tensorfleet}
OUT=$CACHE_ROOT/mpi-operator/$MPI_OPERATOR_VERSION

# The stamp is written only after the binary and the CRD are in place.
cached() {
    local line=
    [[ -x $OUT/mpi-operator && -f $OUT/kubeflow.org_mpijobs.yaml && -f $OUT/.stamp ]] &&
        read -r line <"$OUT/.stamp" && [[ $line == "$MPI_OPERATOR_VERSION" ]]
}
if cached; then
    echo "$OUT"
    exit 0
fi

log() { echo "[mpi-operator/build.sh $(date +%H:%M:%S)] $*" >&2; }
command -v go >/dev/null || { log "go not found in PATH"; exit 1; }
mkdir -p "$OUT"

# One build at a time per cache.
exec 9>"$OUT/.build.lock"
if ! flock -n 9; then
    log "another build holds $OUT/.build.lock; waiting"
    flock 9
fi
if cached; then
    echo "$OUT"
    exit 0
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/tensorfleet-mpi-operator-build.XXXXXX")
trap 'rm -rf "$WORK"; rm -f "$OUT"/.*.tmp.$$' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
export CGO_ENABLED=0 GOWORK=off
T0=$SECONDS

# A wrapper module requiring the operator's module, instead of `go install module/cmd@version`:
# that one also fetches the module's version list (for deprecation notices), which some proxies
# refuse. The module has no replace directives, so minimal version selection picks exactly the
# dependency versions of its go.mod; its `go` line is copied too (it sets the GODEBUG defaults).
log "$MODULE@$MPI_OPERATOR_VERSION: downloading the module"
mkdir -p "$WORK/mod"
cd "$WORK/mod"
info=$(go mod download -json "$MODULE@$MPI_OPERATOR_VERSION")
field() { sed -n "s/^[[:space:]]*\"$1\": \"\(.*\)\",\{0,1\}\$/\1/p" <<<"$info" | head -n 1; }
dir=$(field Dir)
[[ -f $dir/$CRD_IN_MODULE ]] || { log "no $CRD_IN_MODULE in the module (got dir '$dir')"; exit 1; }
if grep -q '^replace' "$dir/go.mod"; then
    log "WARNING: $MODULE@$MPI_OPERATOR_VERSION has replace directives; the wrapper ignores them"
fi
go mod init tensorfleet.local/mpi-operator-build >/dev/null 2>&1
go mod edit -require="$MODULE@$MPI_OPERATOR_VERSION" -go="$(awk '$1 == "go" {print $2; exit}' "$dir/go.mod")"

log "compiling cmd/mpi-operator"
ld=(
    "-X $MODULE/pkg/version.Version=$MPI_OPERATOR_VERSION"
    "-X $MODULE/pkg/version.GitSHA=$(field Hash)"
)
GOFLAGS=-mod=mod go build -trimpath -ldflags "-s -w ${ld[*]}" -o "$WORK/mpi-operator" \
    "$MODULE/cmd/mpi-operator" 2>&1 |
    { grep -v '^go: \(downloading\|added\|upgraded\|finding\|found\)' || true; } >&2
[[ -x $WORK/mpi-operator ]] || { log "go build left no binary"; exit 1; }

install_file() { # SRC NAME MODE: copy under a temp name, then rename
    local tmp=$OUT/.$2.tmp.$$
    cp "$1" "$tmp"
    chmod "$3" "$tmp"
    mv -f "$tmp" "$OUT/$2"
}
install_file "$WORK/mpi-operator" mpi-operator 0755
install_file "$dir/$CRD_IN_MODULE" kubeflow.org_mpijobs.yaml 0644
echo "$MPI_OPERATOR_VERSION" >"$OUT/.stamp.tmp.$$"
mv -f "$OUT/.stamp.tmp.$$" "$OUT/.stamp"
log "done in $((SECONDS - T0))s: $OUT"
echo "$OUT"
