# The cluster's certificates and kubeconfigs, for e2e/control-plane/up.sh and e2e/nodes/up.sh
# (sourced). The caller sets DIR (logs in DIR/logs), PKI (the CA's directory) and SERVER (the
# API server's URL), and defines die. TLS keys are ECDSA P-256: quick to make.

ossl() { openssl "$@" 2>>"$DIR/logs/openssl.log" >&2 || die "openssl $1 failed (see $DIR/logs/openssl.log)"; }

# sign NAME SUBJECT EXTFILE-CONTENT: PKI/NAME.{key,crt}, signed by the cluster's CA.
sign() {
    local name=$1 subj=$2 ext=$3
    ossl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$PKI/$name.key" -out "$PKI/$name.csr" -subj "$subj"
    printf '%s\n' "$ext" >"$PKI/$name.ext"
    ossl x509 -req -sha256 -days 3650 -in "$PKI/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" \
        -CAcreateserial -out "$PKI/$name.crt" -extfile "$PKI/$name.ext"
    rm -f "$PKI/$name.csr" "$PKI/$name.ext" "$PKI/ca.srl"
    chmod 0600 "$PKI/$name.key"
}

# kubeconfig FILE USER: USER's credentials (PKI/USER.{crt,key}) for SERVER, embedded.
kubeconfig() {
    local b64ca b64crt b64key
    b64ca=$(base64 -w0 <"$PKI/ca.crt") || die "no $PKI/ca.crt"
    b64crt=$(base64 -w0 <"$PKI/$2.crt") || die "no $PKI/$2.crt"
    b64key=$(base64 -w0 <"$PKI/$2.key") || die "no $PKI/$2.key"
    cat >"$1.tmp" <<KUBECONFIG
apiVersion: v1
kind: Config
clusters:
- name: tensorfleet-e2e
  cluster:
    server: $SERVER
    certificate-authority-data: $b64ca
users:
- name: $2
  user:
    client-certificate-data: $b64crt
    client-key-data: $b64key
contexts:
- name: tensorfleet-e2e
  context:
    cluster: tensorfleet-e2e
    user: $2
current-context: tensorfleet-e2e
KUBECONFIG
    chmod 0600 "$1.tmp"
    mv -f "$1.tmp" "$1"
}
