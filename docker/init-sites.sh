#!/bin/sh
# One-shot set-up of the compose demo (the `init` service): for every hospital, in that
# hospital's own volume, its share of the scenario's data as a model, a DP-SGD pool, a public
# probe set and site.toml (`privfusion demo site`), and its identity (`privfusion peer init`:
# key + self-signed certificate). Only the certificates are copied to the shared volume, with a
# roster of everyone; then every hospital pins the others' certificates. Keys never leave their
# site's volume. Running it again changes nothing.
#
# Paths and names come from the environment (defaults for the compose file):
#   SITES="hospital-a hospital-b hospital-c"  SITES_DIR=/sites  CERTS_DIR=/certs
#   SCENARIO=/config/scenario.toml  PORT=50051
set -eu
SITES="${SITES:-hospital-a hospital-b hospital-c}"
SITES_DIR="${SITES_DIR:-/sites}"
CERTS_DIR="${CERTS_DIR:-/certs}"
SCENARIO="${SCENARIO:-/config/scenario.toml}"
PORT="${PORT:-50051}"
ROSTER="$CERTS_DIR/roster.toml"

for site in $SITES; do
  dir="$SITES_DIR/$site"
  privfusion demo site "$SCENARIO" --site "$site" --dir "$dir" --listen "0.0.0.0:$PORT" --roster "$ROSTER"
  if [ ! -f "$dir/identity/site.key" ]; then
    # the compose service name is the host name the others dial
    privfusion peer init --name "$site" --dir "$dir/identity" --address "$site"
  fi
  cp "$dir/identity/site.crt" "$CERTS_DIR/$site.crt"
done

{
  echo "# Written by init-sites.sh: every hospital, its address on the compose network, its certificate."
  for site in $SITES; do
    printf '\n[sites."%s"]\naddress = "%s:%s"\ncertificate = "%s.crt"\n' "$site" "$site" "$PORT" "$site"
  done
} > "$ROSTER.tmp"
mv "$ROSTER.tmp" "$ROSTER"

for site in $SITES; do
  privfusion roster pin --roster "$ROSTER" --dir "$SITES_DIR/$site/identity"
done
echo "init: $(echo $SITES | wc -w) sites ready; certificates and roster in $CERTS_DIR"
