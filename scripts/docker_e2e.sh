#!/usr/bin/env bash
# The image and the compose demo, end to end, as an operator does it on a fresh Debian machine
# (bookworm, as root): install the engine if missing, configure dockerd before its first start,
# start it by hand if it is not running, make a local base image where the official one cannot be
# pulled, build, `compose up`, wait for health, run the documented round, check every ledger
# against the receipts, `compose down -v`, and stop what this script started. Every wait is
# bounded; every failure says what failed and exits non-zero; the time of each phase is printed.
#
# No traffic leaves this machine from a container: dockerd's bridge and address pools are inside
# 10.232.0.0/16 (never Docker's 172.17/16, 172.16/12 or 192.168/16 defaults); the build reads its
# Python packages from a wheel directory served on 127.0.0.1 (the build runs with --network host);
# the compose network is checked to lie in 10.232.0.0/16 before anything runs on it. The host
# fills that wheel directory with its own pip (its configured index and find-links; torch's CPU
# wheel from TORCH_FIND_LINKS or the host's pip configuration) and the base image with
# debootstrap from DEBIAN_MIRROR, both once: they are cached in CACHE_DIR, outside the repository.
#
# Environment (all optional):
#   CACHE_DIR=/var/cache/privfusion   base-bookworm.tar and wheels/ (kept between runs)
#   DEBIAN_MIRROR=http://deb.debian.org/debian
#   TORCH_FIND_LINKS=DIR|URL          where the host's pip finds torch-X+cpu (default: its config)
#   BASE_IMAGE=python:3.11-slim-bookworm   the official base, tried first (bounded pull)
#   PULL_TIMEOUT_S=60  BUILD_TIMEOUT_S=2400  HEALTH_TIMEOUT_S=600  ROUND_TIMEOUT_S=900
#   KEEP_IMAGE=1                      keep privfusion:latest afterwards (default: kept; 0 removes it)
#   OFFLINE=1                         never try to pull the official base (a machine that must send
#                                     nothing to a registry: CI here); make or reuse the local one
#   WHEELS_PORT=47231                 the wheel server's port on 127.0.0.1
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

CACHE_DIR="${CACHE_DIR:-/var/cache/privfusion}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
OFFICIAL_BASE="${BASE_IMAGE:-python:3.11-slim-bookworm}"
LOCAL_BASE="privfusion-base:bookworm"
IMAGE="privfusion:latest"
PROJECT="privfusion-e2e"
PULL_TIMEOUT_S="${PULL_TIMEOUT_S:-60}"
BUILD_TIMEOUT_S="${BUILD_TIMEOUT_S:-2400}"
HEALTH_TIMEOUT_S="${HEALTH_TIMEOUT_S:-600}"
ROUND_TIMEOUT_S="${ROUND_TIMEOUT_S:-900}"
KEEP_IMAGE="${KEEP_IMAGE:-1}"
WHEELS_PORT="${WHEELS_PORT:-47231}"
BRIDGE_IP="10.232.0.1/24"
POOL_BASE="10.232.128.0/17"
HOSPITALS="hospital-a hospital-b hospital-c"

STARTED_DOCKERD=""
HTTP_PID=""
COMPOSE_UP=""
PHASES=()
T_ALL=$SECONDS
T_PHASE=$SECONDS
PHASE="start"

say() { echo "docker_e2e: $*"; }
fail() {
    echo "docker_e2e: FAILED in phase '$PHASE': $*" >&2
    exit 1
}
phase() {
    PHASES+=("$(printf '%-12s %5ds' "$PHASE" $((SECONDS - T_PHASE)))")
    PHASE="$1"
    T_PHASE=$SECONDS
    say "== $PHASE"
}
compose() { (cd "$ROOT/docker" && "${COMPOSE[@]}" -p "$PROJECT" "$@"); }

cleanup() {
    local rc=$?
    set +e
    if [ -n "$COMPOSE_UP" ]; then
        if [ "$rc" != 0 ]; then
            say "logs of the compose services (last 40 lines each):"
            compose logs --no-color --tail 40 >&2
        fi
        say "compose down -v"
        timeout 180 bash -c "cd '$ROOT/docker' && ${COMPOSE[*]} -p $PROJECT down -v --remove-orphans" > /dev/null 2>&1 ||
            say "compose down did not finish in 180 s"
    fi
    if [ -n "$HTTP_PID" ]; then
        kill "$HTTP_PID" 2> /dev/null
        wait "$HTTP_PID" 2> /dev/null
    fi
    if [ "$KEEP_IMAGE" = 0 ] && command -v docker > /dev/null; then
        docker image rm "$IMAGE" > /dev/null 2>&1
    fi
    if [ -n "$STARTED_DOCKERD" ]; then
        say "stopping the dockerd this script started (pid $STARTED_DOCKERD)"
        kill "$STARTED_DOCKERD" 2> /dev/null
        for _ in $(seq 60); do kill -0 "$STARTED_DOCKERD" 2> /dev/null || break; sleep 1; done
        kill -0 "$STARTED_DOCKERD" 2> /dev/null && { say "dockerd still running after 60 s: SIGKILL"; kill -9 "$STARTED_DOCKERD"; }
    fi
    PHASES+=("$(printf '%-12s %5ds' "$PHASE" $((SECONDS - T_PHASE)))")
    say "timings per phase:"
    printf '  %s\n' "${PHASES[@]}"
    printf '  %-12s %5ds\n' total $((SECONDS - T_ALL))
    if [ "$rc" = 0 ]; then say "PASSED"; else say "FAILED (exit $rc)"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'fail "interrupted"' INT TERM

# ---------------------------------------------------------------- engine
phase engine
[ "$(id -u)" = 0 ] || fail "run as root (it installs packages and starts dockerd)"
# dockerd reads this at its first start; the Debian package starts it on install where a
# service manager runs, so it is written before the install.
DAEMON_JSON=/etc/docker/daemon.json
WANT_JSON='{
  "bip": "'"$BRIDGE_IP"'",
  "default-address-pools": [{"base": "'"$POOL_BASE"'", "size": 24}]
}'
daemon_json_ok() {
    python3 - "$DAEMON_JSON" "$BRIDGE_IP" "$POOL_BASE" << 'EOF'
import ipaddress, json, sys
path, bip, pool = sys.argv[1:]
try:
    d = json.load(open(path))
except (OSError, ValueError) as e:
    sys.exit(f"{path}: {e}")
inside = ipaddress.ip_network("10.232.0.0/16")
pools = d.get("default-address-pools") or []
if d.get("bip") != bip:
    sys.exit(f"{path}: bip is {d.get('bip')!r}, must be {bip!r} (the bridge inside 10.232.0.0/16)")
if not pools or any(not ipaddress.ip_network(p["base"]).subnet_of(inside) for p in pools):
    sys.exit(f"{path}: default-address-pools {pools} must all lie inside 10.232.0.0/16")
EOF
}
if ! command -v dockerd > /dev/null || ! command -v debootstrap > /dev/null ||
    ! { command -v docker-compose > /dev/null || docker compose version > /dev/null 2>&1; }; then
    if [ -f "$DAEMON_JSON" ]; then
        daemon_json_ok || fail "refusing to install the engine over this daemon.json"
    else
        mkdir -p /etc/docker && echo "$WANT_JSON" > "$DAEMON_JSON"
        say "wrote $DAEMON_JSON (bridge $BRIDGE_IP, pools $POOL_BASE) before the engine's first start"
    fi
    command -v apt-get > /dev/null || fail "no dockerd, and no apt-get to install docker.io with"
    say "installing docker.io docker-compose debootstrap (apt-get)"
    timeout 600 apt-get update -qq || fail "apt-get update failed or took over 600 s"
    DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq docker.io docker-compose debootstrap > /dev/null ||
        fail "apt-get install docker.io docker-compose debootstrap failed or took over 900 s"
fi
if docker compose version > /dev/null 2>&1; then COMPOSE=(docker compose); else COMPOSE=(docker-compose); fi
say "compose: ${COMPOSE[*]} ($("${COMPOSE[@]}" version 2>/dev/null | head -1))"

if timeout 20 docker info > /dev/null 2>&1; then
    # already running: it must be configured as we would have, or nothing is started on it
    daemon_json_ok || fail "dockerd is already running with another configuration; refusing to use it"
    subnet=$(docker network inspect bridge -f '{{range .IPAM.Config}}{{.Subnet}}{{end}}')
    python3 -c 'import ipaddress,sys; sys.exit(not ipaddress.ip_network(sys.argv[1]).subnet_of(ipaddress.ip_network("10.232.0.0/16")))' "$subnet" ||
        fail "the running dockerd's bridge is $subnet, outside 10.232.0.0/16; refusing to use it"
    say "dockerd already running (bridge $subnet)"
else
    if [ -f "$DAEMON_JSON" ]; then
        daemon_json_ok || fail "refusing to start dockerd with this daemon.json"
    else
        mkdir -p /etc/docker && echo "$WANT_JSON" > "$DAEMON_JSON"
        say "wrote $DAEMON_JSON before dockerd's first start"
    fi
    log=/var/log/privfusion-e2e-dockerd.log
    say "starting dockerd by hand (log: $log)"
    setsid dockerd > "$log" 2>&1 < /dev/null &
    STARTED_DOCKERD=$!
    for _ in $(seq 60); do
        timeout 5 docker info > /dev/null 2>&1 && break
        kill -0 "$STARTED_DOCKERD" 2> /dev/null || { tail -20 "$log" >&2; STARTED_DOCKERD=""; fail "dockerd exited"; }
        sleep 1
    done
    timeout 5 docker info > /dev/null 2>&1 || { tail -20 "$log" >&2; fail "dockerd not answering after 60 s"; }
fi

# ---------------------------------------------------------------- base image
phase base
mkdir -p "$CACHE_DIR"
BASE_TAR="$CACHE_DIR/base-bookworm.tar"
if docker image inspect "$OFFICIAL_BASE" > /dev/null 2>&1; then
    BASE="$OFFICIAL_BASE"
    say "base: $BASE (present)"
elif docker image inspect "$LOCAL_BASE" > /dev/null 2>&1; then
    BASE="$LOCAL_BASE"
    say "base: $BASE (present)"
elif [ -s "$BASE_TAR" ]; then
    docker import "$BASE_TAR" "$LOCAL_BASE" > /dev/null || fail "docker import $BASE_TAR failed"
    BASE="$LOCAL_BASE"
    say "base: $BASE imported from the cached $BASE_TAR"
elif [ "${OFFLINE:-0}" != 1 ] && timeout "$PULL_TIMEOUT_S" docker pull -q "$OFFICIAL_BASE" > /dev/null 2>&1; then
    BASE="$OFFICIAL_BASE"
    say "base: $BASE (pulled)"
else
    if [ "${OFFLINE:-0}" = 1 ]; then
        say "base: OFFLINE=1, $OFFICIAL_BASE not pulled; making $LOCAL_BASE by debootstrap from $DEBIAN_MIRROR"
    else
        say "base: $OFFICIAL_BASE cannot be pulled (within ${PULL_TIMEOUT_S} s); making $LOCAL_BASE by debootstrap from $DEBIAN_MIRROR"
    fi
    rootfs=$(mktemp -d /var/tmp/privfusion-rootfs.XXXXXX)
    timeout 1200 debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        bookworm "$rootfs" "$DEBIAN_MIRROR" > "$CACHE_DIR/debootstrap.log" 2>&1 || {
        tail -20 "$CACHE_DIR/debootstrap.log" >&2
        rm -rf "$rootfs"
        fail "debootstrap failed or took over 1200 s (log: $CACHE_DIR/debootstrap.log)"
    }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . > "$BASE_TAR.tmp" && mv "$BASE_TAR.tmp" "$BASE_TAR"
    rm -rf "$rootfs"
    docker import "$BASE_TAR" "$LOCAL_BASE" > /dev/null || fail "docker import $BASE_TAR failed"
    BASE="$LOCAL_BASE"
    say "base: $BASE made; cached as $BASE_TAR ($(du -h "$BASE_TAR" | cut -f1)) for the next run"
fi

# ---------------------------------------------------------------- wheels
phase wheels
# Every pinned dependency, torch's CPU build and the build backend, as wheels for CPython 3.11
# (the base images' Python), fetched once by the host's pip and kept in the cache.
WHEELS="$CACHE_DIR/wheels"
reqs=$(mktemp)
python3 docker/pinned-requirements.py pyproject.toml --torch > "$reqs" || fail "pyproject.toml: torch pin"
python3 docker/pinned-requirements.py pyproject.toml | grep -v '^torch==' >> "$reqs"
python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml","rb"))["build-system"]["requires"]))' >> "$reqs"
stamp="$WHEELS/.complete-$(sha256sum "$reqs" | cut -c1-16)"
if [ -f "$stamp" ]; then
    say "wheels: cached in $WHEELS"
else
    python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' ||
        fail "the host's python3 is not 3.11: it cannot fetch the images' (CPython 3.11) wheels"
    mkdir -p "$WHEELS"
    say "wheels: fetching $(wc -l < "$reqs") requirements into $WHEELS with the host's pip"
    timeout 1200 python3 -m pip download --disable-pip-version-check --quiet --only-binary=:all: \
        ${TORCH_FIND_LINKS:+--find-links "$TORCH_FIND_LINKS"} -d "$WHEELS" -r "$reqs" ||
        fail "pip download failed or took over 1200 s (torch's CPU wheel: set TORCH_FIND_LINKS to its directory)"
    ls "$WHEELS"/torch-*+cpu-*.whl > /dev/null 2>&1 || fail "no torch +cpu wheel in $WHEELS"
    touch "$stamp"
fi
rm -f "$reqs"
# a fixed port: the URL is a build argument, and a new one would rebuild the dependency layer
port="$WHEELS_PORT"
python3 -c 'import socket, sys; socket.create_server(("127.0.0.1", int(sys.argv[1])))' "$port" 2> /dev/null ||
    fail "port $port on 127.0.0.1 is taken (set WHEELS_PORT to a free one)"
python3 -m http.server --bind 127.0.0.1 --directory "$WHEELS" "$port" > /dev/null 2>&1 &
HTTP_PID=$!
WHEELS_URL="http://127.0.0.1:$port/"
for _ in $(seq 50); do
    python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$WHEELS_URL" 2> /dev/null && break
    sleep 0.2
done
python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$WHEELS_URL" ||
    fail "the wheel server on $WHEELS_URL does not answer"
say "wheels served on $WHEELS_URL (loopback only)"

# ---------------------------------------------------------------- build
phase build
timeout "$BUILD_TIMEOUT_S" docker build --network host -f docker/Dockerfile -t "$IMAGE" \
    --build-arg BASE_IMAGE="$BASE" \
    --build-arg TORCH_FIND_LINKS="$WHEELS_URL" \
    --build-arg PIP_FIND_LINKS="$WHEELS_URL" \
    --build-arg PIP_NO_INDEX=1 \
    . > "$CACHE_DIR/build.log" 2>&1 || {
    tail -30 "$CACHE_DIR/build.log" >&2
    fail "docker build failed or took over $BUILD_TIMEOUT_S s (log: $CACHE_DIR/build.log)"
}
kill "$HTTP_PID" 2> /dev/null
wait "$HTTP_PID" 2> /dev/null || true
HTTP_PID=""
say "built $IMAGE on $BASE: $(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1 / 1e9}')"

# ---------------------------------------------------------------- up
phase up
compose down -v --remove-orphans > /dev/null 2>&1 || true # what an earlier, interrupted run left
COMPOSE_UP=1
timeout 300 bash -c "cd '$ROOT/docker' && ${COMPOSE[*]} -p $PROJECT up -d --no-build" || fail "compose up failed or took over 300 s"
for net in $(docker network ls -q --filter "label=com.docker.compose.project=$PROJECT"); do
    subnet=$(docker network inspect "$net" -f '{{range .IPAM.Config}}{{.Subnet}}{{end}}')
    python3 -c 'import ipaddress,sys; sys.exit(not ipaddress.ip_network(sys.argv[1]).subnet_of(ipaddress.ip_network("10.232.0.0/16")))' "$subnet" ||
        fail "compose network $net has subnet $subnet, outside 10.232.0.0/16"
    say "compose network $(docker network inspect "$net" -f '{{.Name}}'): $subnet"
done

# ---------------------------------------------------------------- health
phase health
container_of() { compose ps -a -q "$1"; }
deadline=$((SECONDS + HEALTH_TIMEOUT_S))
while :; do
    states=""
    healthy=0
    for h in $HOSPITALS; do
        c=$(container_of "$h")
        s=$( [ -n "$c" ] && docker inspect -f '{{.State.Status}}/{{if .State.Health}}{{.State.Health.Status}}{{end}}' "$c" || echo missing)
        states="$states $h=$s"
        [ "$s" = "running/healthy" ] && healthy=$((healthy + 1))
    done
    init=$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}}' "$(container_of init)" 2> /dev/null || echo missing)
    case "$init" in "exited 0" | running*) ;; *) fail "init is '$init' (it must exit 0)" ;; esac
    [ "$healthy" = 3 ] && break
    [ $SECONDS -ge $deadline ] && fail "not all healthy after ${HEALTH_TIMEOUT_S} s:$states"
    sleep 5
done
say "healthy:$states"
for h in $HOSPITALS; do
    compose exec -T "$h" privfusion peer health --config /site/site.toml || fail "$h: peer health"
done

# ---------------------------------------------------------------- round
phase round
# the documented round (docker/compose.yaml, docs/deployment.md section 4)
timeout "$ROUND_TIMEOUT_S" bash -c "cd '$ROOT/docker' && ${COMPOSE[*]} -p $PROJECT exec -T hospital-a privfusion round --config /site/site.toml" ||
    fail "hospital-a's round failed or took over $ROUND_TIMEOUT_S s"
compose exec -T hospital-b privfusion ledger show --db /site/ledger.sqlite || fail "hospital-b: ledger show"

# ---------------------------------------------------------------- ledgers
phase ledgers
# Every ledger against the receipts the others hold, in a container with every site's volume.
mounts=()
for h in $HOSPITALS; do mounts+=(-v "${PROJECT}_$h:/sites/$h"); done
timeout 300 docker run --rm --network none "${mounts[@]}" -v "${PROJECT}_certs:/certs:ro" \
    -v "$ROOT/docker/check-ledgers.py:/opt/check-ledgers.py:ro" --entrypoint python3 "$IMAGE" \
    /opt/check-ledgers.py --sites /sites --certs /certs || fail "a ledger does not match the receipts"

# ---------------------------------------------------------------- down
phase down
timeout 180 bash -c "cd '$ROOT/docker' && ${COMPOSE[*]} -p $PROJECT down -v --remove-orphans" || fail "compose down -v failed or took over 180 s"
COMPOSE_UP=""
left=$(docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT")
[ -z "$left" ] || fail "volumes left after down -v: $left"
