#!/usr/bin/env bash
# Starts a real control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler) on
# 127.0.0.1 with free ports; state, certificates and logs live under DIR.
#
#   e2e/control-plane/up.sh DIR      # then: KUBECONFIG=DIR/kubeconfig kubectl get ns
#   e2e/control-plane/down.sh DIR
#
# Writes DIR/kubeconfig (admin, certs embedded), DIR/env (KEY=value lines: KUBECONFIG, ports,
# pids, bin dir; `set -a; . DIR/env; set +a`), DIR/pids (one pid per line), DIR/logs/*.log.
# Binaries: $TENSORFLEET_K8S_BIN, else the output of build.sh next to this script.
# Env: UP_TIMEOUT (seconds to wait for readiness, default 180). CP_REAL_NODES=1 readies it for
# real kubelets (e2e/nodes/): the API server binds and advertises CP_ADDRESS (default: the
# host's address of its default route), which pods reach through the `kubernetes` Service;
# the controller-manager hands each node a /24 of 10.244.0.0/16; the API server checks the
# kubelets' serving certificates against the CA and authorizes them as nodes.
# The processes run in their own session and outlive this script; stop them with down.sh.
# On failure the processes started so far are stopped and the failing component's log is shown.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[[ $# -eq 1 ]] || { echo "usage: $0 DIR" >&2; exit 2; }
mkdir -p "$1"
DIR=$(cd "$1" && pwd)
TIMEOUT=${UP_TIMEOUT:-180}
REAL_NODES=${CP_REAL_NODES:-0}
if (( REAL_NODES )); then
    ADDRESS=${CP_ADDRESS:-$(ip -4 route get 1.1.1.1 | sed -n 's/.* src \([0-9.]*\).*/\1/p')}
else
    ADDRESS=${CP_ADDRESS:-127.0.0.1}
fi
CLUSTER_CIDR=10.244.0.0/16
SERVICE_CIDR=10.0.0.0/24

log() { echo "[up.sh $(date +%H:%M:%S)] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

if [[ -n ${TENSORFLEET_K8S_BIN:-} ]]; then
    BIN=$TENSORFLEET_K8S_BIN
else
    BIN=$("$HERE/build.sh" | tail -1)
fi
for b in etcd kube-apiserver kube-controller-manager kube-scheduler kubectl; do
    [[ -x $BIN/$b ]] || die "$BIN/$b missing (set TENSORFLEET_K8S_BIN or run build.sh)"
done

# Refuse to start over a control plane that is still running in DIR.
if [[ -f $DIR/pids ]]; then
    while read -r pid; do
        [[ -n $pid && -r /proc/$pid/cmdline ]] || continue
        if tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$DIR/"; then
            die "a control plane is already running in $DIR (pid $pid); run down.sh $DIR first"
        fi
    done <"$DIR/pids"
fi
rm -rf "$DIR/etcd" "$DIR/pki" "$DIR/logs" "$DIR/pids" "$DIR/env" "$DIR"/*.kubeconfig "$DIR/kubeconfig"
mkdir -p "$DIR/etcd" "$DIR/pki" "$DIR/logs"
chmod 0700 "$DIR/etcd" "$DIR/pki"

# ---- ports -----------------------------------------------------------------------------------
# Five free ports below the ephemeral range (so outgoing connections cannot take them between
# the probe and the bind). A registry under a lock keeps ports handed out in the last few minutes
# from being handed out again, so parallel up.sh runs do not collide.
read -r ETCD_PORT ETCD_PEER_PORT APISERVER_PORT KCM_PORT SCHEDULER_PORT < <(python3 - <<'EOF'
import fcntl, json, os, random, socket, time
tmp = os.environ.get("TMPDIR", "/tmp")
lock = open(os.path.join(tmp, "tensorfleet-ports.lock"), "a+")
fcntl.flock(lock, fcntl.LOCK_EX)
reg_path = os.path.join(tmp, "tensorfleet-ports.json")
try:
    reg = {int(k): v for k, v in json.load(open(reg_path)).items()}
except Exception:
    reg = {}
now = time.time()
reg = {p: t for p, t in reg.items() if now - t < 600}
try:
    lo = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
except Exception:
    lo = 32768
lo = min(lo, 32768)
picked = []
while len(picked) < 5:
    p = random.randint(10000, lo - 1)
    if p in reg or p in picked:
        continue
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", p))
    except OSError:
        continue
    finally:
        s.close()
    picked.append(p)
for p in picked:
    reg[p] = now
tmp_path = reg_path + ".%d" % os.getpid()
json.dump({str(k): v for k, v in reg.items()}, open(tmp_path, "w"))
os.replace(tmp_path, reg_path)
print(*picked)
EOF
) || true
[[ -n ${SCHEDULER_PORT:-} ]] || die "could not pick free ports"

# ---- certificates ----------------------------------------------------------------------------
PKI=$DIR/pki  # the service-account key is RSA; the TLS keys pki.sh makes
log "certificates in $PKI"
SERVER=https://$ADDRESS:$APISERVER_PORT
# shellcheck source=e2e/control-plane/pki.sh
. "$HERE/pki.sh"
ossl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -sha256 -days 3650 -keyout "$PKI/ca.key" -out "$PKI/ca.crt" \
    -subj "/CN=tensorfleet-e2e-ca" -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature"
CLIENT_EXT=$'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth'
sign apiserver "/CN=kube-apiserver" "$(printf '%s\n' 'basicConstraints=CA:FALSE' \
    'keyUsage=critical,digitalSignature' 'extendedKeyUsage=serverAuth' \
    "subjectAltName=IP:127.0.0.1,IP:$ADDRESS,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local")"
sign admin "/O=system:masters/CN=tensorfleet-admin" "$CLIENT_EXT"
sign kube-controller-manager "/CN=system:kube-controller-manager" "$CLIENT_EXT"
sign kube-scheduler "/CN=system:kube-scheduler" "$CLIENT_EXT"
# The API server's client certificate towards the kubelets (logs, exec, port-forward).
sign apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "$CLIENT_EXT"
ossl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$PKI/sa.key"
ossl pkey -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub"
chmod 0600 "$PKI"/*.key

# ---- kubeconfigs -----------------------------------------------------------------------------
kubeconfig "$DIR/kubeconfig" admin
kubeconfig "$DIR/kube-controller-manager.kubeconfig" kube-controller-manager
kubeconfig "$DIR/kube-scheduler.kubeconfig" kube-scheduler

# ---- processes -------------------------------------------------------------------------------
declare -A PID=()
ORDER=()
start() { # NAME ARGS...
    local name=$1; shift
    # setsid: own session, so the process outlives this script and its terminal.
    # (A background job of a non-interactive shell is not a group leader: setsid does not fork,
    # so $! is the component's own pid.)
    setsid "$@" >"$DIR/logs/$name.log" 2>&1 </dev/null &
    PID[$name]=$!
    ORDER+=("$name")
    echo "${PID[$name]}" >>"$DIR/pids"
}
failed=1
cleanup_on_failure() {
    if (( failed )); then
        log "stopping what was started (state and logs stay in $DIR)"
        "$HERE/down.sh" "$DIR" >&2 || true
    fi
}
trap cleanup_on_failure EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

show_log() { # NAME
    log "last lines of $DIR/logs/$1.log:"
    tail -n 40 "$DIR/logs/$1.log" | sed 's/^/    /' >&2 || true
}
check_alive() {
    local n
    for n in "${ORDER[@]}"; do
        if ! kill -0 "${PID[$n]}" 2>/dev/null; then
            show_log "$n"
            die "$n (pid ${PID[$n]}) exited during startup"
        fi
    done
}
# wait_for NAME DESCRIPTION CMD...: poll CMD until it succeeds; blame NAME on timeout.
DEADLINE=$((SECONDS + TIMEOUT))
wait_for() {
    local name=$1 what=$2; shift 2
    until "$@" >/dev/null 2>&1; do
        check_alive
        if (( SECONDS >= DEADLINE )); then
            show_log "$name"
            if [[ $name == kube-apiserver ]]; then
                log "failing /readyz checks:"
                "${CURL_ADMIN[@]/-fsS/-sS}" "$SERVER/readyz?verbose" 2>&1 | grep -v '^\[+\]' | sed 's/^/    /' >&2 || true
            fi
            die "timed out after ${TIMEOUT}s waiting for $what"
        fi
        sleep 0.3
    done
}
T0=$SECONDS

log "etcd on 127.0.0.1:$ETCD_PORT (peer $ETCD_PEER_PORT)"
start etcd "$BIN/etcd" \
    --name=default --data-dir="$DIR/etcd" \
    --listen-client-urls="http://127.0.0.1:$ETCD_PORT" --advertise-client-urls="http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster="default=http://127.0.0.1:$ETCD_PEER_PORT" \
    --unsafe-no-fsync=true --quota-backend-bytes=$((1024 * 1024 * 1024)) --snapshot-count=5000 \
    --log-level=warn
wait_for etcd "etcd /health" curl -fsS "http://127.0.0.1:$ETCD_PORT/health"

# Towards real kubelets: their serving certificates are checked, and they are authorized as nodes.
NODE_ARGS=()
if (( REAL_NODES )); then
    NODE_ARGS=(--authorization-mode=Node,RBAC --kubelet-certificate-authority="$PKI/ca.crt"
        --kubelet-preferred-address-types=InternalIP)
else
    NODE_ARGS=(--authorization-mode=RBAC)
fi
log "kube-apiserver on $SERVER"
start kube-apiserver "$BIN/kube-apiserver" \
    --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
    --bind-address="$ADDRESS" --advertise-address="$ADDRESS" --secure-port="$APISERVER_PORT" \
    --cert-dir="$PKI/apiserver" \
    --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
    --client-ca-file="$PKI/ca.crt" "${NODE_ARGS[@]}" \
    --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" \
    --kubelet-client-key="$PKI/apiserver-kubelet-client.key" \
    --service-account-issuer="$SERVER/" \
    --service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
    --service-cluster-ip-range="$SERVICE_CIDR" --allow-privileged=true \
    --profiling=false
CURL_ADMIN=(curl -fsS --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key")
wait_for kube-apiserver "kube-apiserver /readyz" "${CURL_ADMIN[@]}" "$SERVER/readyz"

log "kube-controller-manager on 127.0.0.1:$KCM_PORT, kube-scheduler on 127.0.0.1:$SCHEDULER_PORT"
KCM_KC=$DIR/kube-controller-manager.kubeconfig
KCM_ARGS=()
# A node whose kubelet is silent for 20 s is not Ready (Unknown); 50 s by default, shorter here
# so that the node-loss scenario takes less time (kubelets renew their Lease every 10 s).
(( REAL_NODES )) && KCM_ARGS=(--allocate-node-cidrs --cluster-cidr="$CLUSTER_CIDR" --node-cidr-mask-size=24
    --node-monitor-grace-period=20s)
start kube-controller-manager "$BIN/kube-controller-manager" "${KCM_ARGS[@]}" \
    --flex-volume-plugin-dir="$DIR/flexvolume" \
    --kubeconfig="$KCM_KC" --authentication-kubeconfig="$KCM_KC" --authorization-kubeconfig="$KCM_KC" \
    --bind-address=127.0.0.1 --secure-port="$KCM_PORT" --cert-dir="$PKI/kube-controller-manager" \
    --leader-elect=false \
    --root-ca-file="$PKI/ca.crt" --service-account-private-key-file="$PKI/sa.key" \
    --use-service-account-credentials=true \
    --cluster-signing-cert-file="$PKI/ca.crt" --cluster-signing-key-file="$PKI/ca.key" \
    --profiling=false
SCHED_KC=$DIR/kube-scheduler.kubeconfig
start kube-scheduler "$BIN/kube-scheduler" \
    --kubeconfig="$SCHED_KC" --authentication-kubeconfig="$SCHED_KC" --authorization-kubeconfig="$SCHED_KC" \
    --bind-address=127.0.0.1 --secure-port="$SCHEDULER_PORT" --cert-dir="$PKI/kube-scheduler" \
    --leader-elect=false --profiling=false

wait_for kube-controller-manager "kube-controller-manager /healthz" curl -fsSk "https://127.0.0.1:$KCM_PORT/healthz"
wait_for kube-scheduler "kube-scheduler /healthz" curl -fsSk "https://127.0.0.1:$SCHEDULER_PORT/healthz"
# The default ServiceAccount is made by the controller-manager: proof that its controllers run.
wait_for kube-controller-manager "ServiceAccount default/default" \
    "${CURL_ADMIN[@]}" "$SERVER/api/v1/namespaces/default/serviceaccounts/default"

{
    printf '%s=%q\n' \
        TENSORFLEET_CP_DIR "$DIR" \
        KUBECONFIG "$DIR/kubeconfig" \
        TENSORFLEET_K8S_BIN "$BIN" \
        APISERVER_URL "$SERVER" \
        APISERVER_ADDRESS "$ADDRESS" \
        CLUSTER_CIDR "$CLUSTER_CIDR" SERVICE_CIDR "$SERVICE_CIDR" \
        APISERVER_PORT "$APISERVER_PORT" \
        ETCD_PORT "$ETCD_PORT" \
        ETCD_PEER_PORT "$ETCD_PEER_PORT" \
        KCM_PORT "$KCM_PORT" \
        SCHEDULER_PORT "$SCHEDULER_PORT" \
        ETCD_PID "${PID[etcd]}" \
        APISERVER_PID "${PID[kube-apiserver]}" \
        KCM_PID "${PID[kube-controller-manager]}" \
        SCHEDULER_PID "${PID[kube-scheduler]}"
} >"$DIR/env.tmp"
mv -f "$DIR/env.tmp" "$DIR/env"
failed=0
log "ready in $((SECONDS - T0))s: KUBECONFIG=$DIR/kubeconfig"
