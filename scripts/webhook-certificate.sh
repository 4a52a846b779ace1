#!/usr/bin/env bash
# The webhook's serving certificate without cert-manager: a private CA and a certificate for
# the webhook Service's DNS names (openssl), stored in the Secret gpupool-webhook-tls, and the
# CA put into the MutatingWebhookConfiguration's caBundle. Run after
#   kubectl apply -k deploy/webhook/base
# and again before the certificate expires (DAYS, default 365); the webhook reloads the
# renewed files by itself.
#   scripts/webhook-certificate.sh [NAMESPACE] [DAYS]
set -euo pipefail
namespace="${1:-gpupool-system}"
days="${2:-365}"
service="gpupool-webhook"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days "$days" \
  -subj "/CN=gpupool webhook CA" -keyout "$work/ca.key" -out "$work/ca.crt" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -subj "/CN=$service.$namespace.svc" -keyout "$work/tls.key" -out "$work/tls.csr" 2>/dev/null
printf 'subjectAltName=DNS:%s.%s.svc,DNS:%s.%s.svc.cluster.local\nextendedKeyUsage=serverAuth\n' \
  "$service" "$namespace" "$service" "$namespace" > "$work/ext.cnf"
openssl x509 -req -in "$work/tls.csr" -CA "$work/ca.crt" -CAkey "$work/ca.key" \
  -CAcreateserial -days "$days" -extfile "$work/ext.cnf" -out "$work/tls.crt" 2>/dev/null
if [ "${GPUPOOL_CERT_DIR:-}" != "" ]; then  # only write the files (tests, other tooling)
  cp "$work/ca.crt" "$work/tls.crt" "$work/tls.key" "$GPUPOOL_CERT_DIR/"
  exit 0
fi
kubectl -n "$namespace" create secret tls "$service-tls" --cert="$work/tls.crt" \
  --key="$work/tls.key" --dry-run=client -o yaml | kubectl apply -f -
bundle="$(base64 -w0 < "$work/ca.crt")"
kubectl patch mutatingwebhookconfiguration "$service" --type=json \
  -p "[{\"op\":\"add\",\"path\":\"/webhooks/0/clientConfig/caBundle\",\"value\":\"$bundle\"}]"
echo "webhook-certificate: Secret $namespace/$service-tls and the caBundle are set" >&2
