#!/usr/bin/env bash
# Blob fetch over a shaped link, as between two machines rather than on loopback:
# two network namespaces joined by a veth pair, each direction limited by tc
# (tbf RATE, and netem DELAY when given), a `pcp-node --no-train` serving a blob in
# one and `pcp-node blob get` in the other, and raw TCP over the same link for the
# ceiling. Needs root (CAP_NET_ADMIN) and tc; DELAY needs the sch_netem module. No GPU.
#
#   bench/link.sh                                   # 1gbit, 300 MB, 3 rounds
#   RATE=100mbit DELAY=40ms SIZE_MB=100 bench/link.sh
#   TRANSPORTS="tcp quic" REPEAT=5 bench/link.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=$(realpath "${PCP_NODE:-target/release/pcp-node}")
[ -x "$BIN" ] || { echo "bench/link.sh: build first: cargo build --release -p pcp-node" >&2; exit 1; }
RATE=${RATE:-1gbit}
DELAY=${DELAY:-}
SIZE_MB=${SIZE_MB:-300}
REPEAT=${REPEAT:-3}
TRANSPORTS=${TRANSPORTS:-"tcp quic"}
PY=${PYTHON:-python3}
A=pcpbenchA$$ B=pcpbenchB$$
WORK=$(mktemp -d)
cleanup() {
  [ -f "$WORK/provider.pid" ] && kill "$(cat "$WORK/provider.pid")" 2>/dev/null || true
  ip netns del "$A" 2>/dev/null || true
  ip netns del "$B" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

ip netns add "$A"
ip netns add "$B"
ip link add vA netns "$A" type veth peer name vB netns "$B"
ip -n "$A" addr add 10.77.0.1/24 dev vA
ip -n "$B" addr add 10.77.0.2/24 dev vB
for ns in "$A" "$B"; do
  dev=$([ "$ns" = "$A" ] && echo vA || echo vB)
  ip -n "$ns" link set lo up
  ip -n "$ns" link set "$dev" up
  if [ -n "$DELAY" ]; then
    # the delay first, then the rate limit: a path of RATE with a 2×DELAY round trip
    tc -n "$ns" qdisc add dev "$dev" root handle 1: netem delay "$DELAY" limit 100000
    tc -n "$ns" qdisc add dev "$dev" parent 1:1 handle 10: tbf rate "$RATE" burst 256kb latency 100ms
  else
    tc -n "$ns" qdisc add dev "$dev" root tbf rate "$RATE" burst 256kb latency 100ms
  fi
done

head -c $((SIZE_MB * 1000000)) /dev/urandom > "$WORK/blob"
HASH=$("$BIN" blob put "$WORK/blob" --data-dir "$WORK/a" 2>/dev/null)

# raw TCP: one connection, SIZE_MB from A to B, timed at the receiver
raw() {
  ip netns exec "$A" "$PY" - "$WORK/blob" <<'EOF' &
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("10.77.0.1", 4800)); s.listen(1)
c, _ = s.accept()
with open(sys.argv[1], "rb") as f:
    c.sendfile(f)
c.close()
EOF
  local server=$!
  sleep 0.5
  ip netns exec "$B" "$PY" - <<'EOF'
import socket, time
s = socket.create_connection(("10.77.0.1", 4800))
t0, n = time.perf_counter(), 0
buf = bytearray(1 << 20)
while True:
    k = s.recv_into(buf)
    if not k:
        break
    n += k
print(f"{n / (time.perf_counter() - t0) / 1e6:.1f}")
EOF
  wait "$server"
}

# the provider: serves every blob in its store
start_provider() {
  local listen=$1
  rm -f "$WORK/a/events.jsonl"
  ip netns exec "$A" "$BIN" --no-train --listen "$listen" --data-dir "$WORK/a" \
    --events "$WORK/a/events.jsonl" >"$WORK/provider.out" 2>"$WORK/provider.log" &
  echo $! > "$WORK/provider.pid"
  for _ in $(seq 100); do
    grep -q '"listening"' "$WORK/a/events.jsonl" 2>/dev/null && break
    sleep 0.1
  done
  PEER=$(grep -m1 -o '"peer":"[^"]*"' "$WORK/a/events.jsonl" | cut -d'"' -f4)
}

stop_provider() {
  kill "$(cat "$WORK/provider.pid")" 2>/dev/null || true
  wait "$(cat "$WORK/provider.pid")" 2>/dev/null || true
  rm -f "$WORK/provider.pid"
}

# one fetch: MB/s of the transfer as pcp reports it (providers found to last chunk
# verified and written) and of the whole command (start, join, lookup, fetch)
fetch() {
  local addr=$1
  rm -rf "$WORK/b"
  local t0 t1 line
  t0=$(date +%s.%N)
  line=$(ip netns exec "$B" "$BIN" blob get "$HASH" -o "$WORK/out" --bootstrap "$addr" \
    --listen /ip4/10.77.0.2/tcp/0 --listen /ip4/10.77.0.2/udp/0/quic-v1 --data-dir "$WORK/b" 2>"$WORK/fetch.log")
  t1=$(date +%s.%N)
  cmp -s "$WORK/blob" "$WORK/out" || { echo "bench/link.sh: the fetched blob differs" >&2; exit 1; }
  local secs
  secs=$(echo "$line" | grep -o 'in [0-9.]* s' | grep -o '[0-9.]*')
  echo "$(echo "$SIZE_MB / $secs" | bc -l | xargs printf '%.1f') $(echo "$SIZE_MB / ($t1 - $t0)" | bc -l | xargs printf '%.1f')"
}

median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

echo "link: $RATE, ${DELAY:-no added delay} each way, blob $SIZE_MB MB, $REPEAT rounds, $(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
declare -A got
for round in $(seq "$REPEAT"); do
  got[raw]+="$(raw) "
  for t in $TRANSPORTS; do
    case $t in
      tcp) listen=/ip4/10.77.0.1/tcp/4701 ;;
      quic) listen=/ip4/10.77.0.1/udp/4701/quic-v1 ;;
      *) echo "bench/link.sh: unknown transport $t" >&2; exit 2 ;;
    esac
    start_provider "$listen"
    read -r transfer whole < <(fetch "$listen/p2p/$PEER")
    got[$t]+="$transfer "
    got[$t-whole]+="$whole "
    stop_provider
  done
done
printf '| path | MB/s, median of %s (all) |\n| --- | --- |\n' "$REPEAT"
printf '| raw TCP, one connection | %s (%s) |\n' "$(tr ' ' '\n' <<< "${got[raw]}" | grep . | median)" "${got[raw]% }"
for t in $TRANSPORTS; do
  printf '| pcp fetch over %s, transfer | %s (%s) |\n' "$t" "$(tr ' ' '\n' <<< "${got[$t]}" | grep . | median)" "${got[$t]% }"
  printf '| pcp fetch over %s, whole command | %s (%s) |\n' "$t" "$(tr ' ' '\n' <<< "${got[$t-whole]}" | grep . | median)" "${got[$t-whole]% }"
done
