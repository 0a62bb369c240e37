#!/usr/bin/env bash
# Blob fetches between volunteers behind home routers, in network namespaces (the
# NAT lab of node/tests/nat_cli.rs): an "internet" bridge with a seed (p1) and a
# public node (p2), both relays; router r1 and r2 masquerade like most home routers
# (endpoint-independent: one public port per socket), r3 is a symmetric NAT
# (`masquerade fully-random`: a random port per destination). Worker B behind r2
# serves a SIZE_MB blob; worker A behind r1 fetches it over a hole-punched direct
# connection, worker C behind r3 through a relay. Each router's uplink can be shaped
# (tc tbf RATE, netem DELAY each way) like a home line. Needs root, iproute2, nftables
# and tc (DELAY: the sch_netem module). No GPU.
#
#   bench/nat_lab.sh                              # unshaped, 50 MB, 3 rounds
#   RATE=100mbit DELAY=20ms bench/nat_lab.sh
#   SIZE_MB=200 REPEAT=5 PCP_NODE=target/debug/pcp-node bench/nat_lab.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=$(realpath "${PCP_NODE:-target/release/pcp-node}")
[ -x "$BIN" ] || { echo "bench/nat_lab.sh: build first: cargo build --release -p pcp-node" >&2; exit 1; }
for tool in ip nft tc; do
  command -v "$tool" >/dev/null || { echo "bench/nat_lab.sh: no \`$tool\` (install iproute2 and nftables)" >&2; exit 1; }
done
RATE=${RATE:-}
DELAY=${DELAY:-}
SIZE_MB=${SIZE_MB:-50}
REPEAT=${REPEAT:-3}
P=pcnb$$
WORK=$(mktemp -d)
NAMESPACES=()
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for ((i = ${#NAMESPACES[@]} - 1; i >= 0; i--)); do ip netns del "${NAMESPACES[i]}" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
ns() { ip netns add "$1"; NAMESPACES+=("$1"); ip -n "$1" link set lo up; }
# plug AT OUTER NS INNER: a veth pair, OUTER in namespace AT (on its br0), INNER in NS
plug() {
  ip link add "$4" netns "$3" type veth peer name "$2" netns "$1"
  ip -n "$1" link set "$2" master br0 up
  ip -n "$3" link set "$4" up
}

ns "$P-inet"
ip -n "$P-inet" link add br0 type bridge forward_delay 0
ip -n "$P-inet" link set br0 up
if [ -n "$DELAY" ] && ! tc -n "$P-inet" qdisc add dev br0 root netem delay 1ms 2>/dev/null; then
  echo "bench/nat_lab.sh: DELAY needs the sch_netem qdisc (CONFIG_NET_SCH_NETEM), which this kernel lacks" >&2
  exit 1
fi
[ -z "$DELAY" ] || tc -n "$P-inet" qdisc del dev br0 root
for i in 1 2; do
  ns "$P-p$i"
  plug "$P-inet" "p$i" "$P-p$i" eth0
  ip -n "$P-p$i" addr add "198.18.0.$i/24" dev eth0
done
# router R (1-3) with one host behind it; MASQ is the masquerade statement
router() {
  local r=$1 masq=$2
  ns "$P-r$r"
  plug "$P-inet" "r$r" "$P-r$r" wan0
  ip -n "$P-r$r" addr add "198.18.0.$((100 + r))/24" dev wan0
  ip -n "$P-r$r" link add br0 type bridge forward_delay 0
  ip -n "$P-r$r" link set br0 up
  ip -n "$P-r$r" addr add "192.168.$r.1/24" dev br0
  ns "$P-h$r"
  plug "$P-r$r" h1 "$P-h$r" eth0
  ip -n "$P-h$r" addr add "192.168.$r.11/24" dev eth0
  ip -n "$P-h$r" route add default via "192.168.$r.1"
  ip netns exec "$P-r$r" sh -c 'echo 1 > /proc/sys/net/ipv4/ip_forward'
  ip netns exec "$P-r$r" nft "table ip home {
    chain nat { type nat hook postrouting priority srcnat; oifname \"wan0\" $masq; }
    chain input { type filter hook input priority filter;
      iifname \"wan0\" ct state established,related accept; iifname \"wan0\" drop; }
    chain forward { type filter hook forward priority filter;
      iifname \"wan0\" ct state established,related accept; iifname \"wan0\" drop; }
  }"
  # the home line: both directions of the router's uplink
  for dev in "$P-r$r:wan0" "$P-inet:r$r"; do
    local n=${dev%%:*} d=${dev##*:}
    if [ -n "$DELAY" ]; then
      tc -n "$n" qdisc add dev "$d" root handle 1: netem delay "$DELAY" limit 100000
      [ -n "$RATE" ] && tc -n "$n" qdisc add dev "$d" parent 1:1 handle 10: tbf rate "$RATE" burst 256kb latency 100ms
    elif [ -n "$RATE" ]; then
      tc -n "$n" qdisc add dev "$d" root tbf rate "$RATE" burst 256kb latency 100ms
    fi
  done
}
router 1 masquerade
router 2 masquerade
router 3 "masquerade fully-random"

# node NAMESPACE NAME ARGS…: pcp-node in the background, with its own data and events
node() {
  local where=$1 name=$2
  shift 2
  RUST_LOG=warn ip netns exec "$where" "$BIN" "$@" --data-dir "$WORK/$name" --events "$WORK/$name.jsonl" \
    >"$WORK/$name.out" 2>"$WORK/$name.log" &
  PIDS+=($!)
}
# waits until NAME's events hold EVENT (at most 120 s)
wait_event() {
  for _ in $(seq 600); do
    grep -q "\"event\":\"$2\"" "$WORK/$1.jsonl" 2>/dev/null && return 0
    sleep 0.2
  done
  echo "bench/nat_lab.sh: no $2 from $1 within 120 s; its log:" >&2
  tail -5 "$WORK/$1.log" >&2
  exit 1
}
field() { sed -n "s/.*\"$2\":\\([^,}]*\\).*/\\1/p" <<<"$1" | tr -d '"'; }
moved() { # bytes through the public hosts' interfaces
  local total=0
  for i in 1 2; do
    for dir in rx tx; do
      total=$((total + $(ip netns exec "$P-p$i" cat "/sys/class/net/eth0/statistics/${dir}_bytes")))
    done
  done
  echo "$total"
}

node "$P-p1" seed --no-train --listen /ip4/198.18.0.1/udp/4001/quic-v1 --listen /ip4/198.18.0.1/tcp/4001
wait_event seed listening
SEED_ID=$(sed -n 's/.*"peer":"\([^"]*\)".*/\1/p' "$WORK/seed.jsonl" | head -1)
SEED=/ip4/198.18.0.1/udp/4001/quic-v1/p2p/$SEED_ID
node "$P-p2" p2 --no-train --bootstrap "$SEED"
head -c $((SIZE_MB * 1000000)) /dev/urandom >"$WORK/blob"
HASH=$("$BIN" blob put "$WORK/blob" --data-dir "$WORK/b" 2>/dev/null)
node "$P-h2" b --no-train --bootstrap "$SEED"
wait_event b relay_reserved
sleep 6 # B announces its blob again with its relay address (rescan every 5 s)

echo "NAT lab: ${SIZE_MB} MB from B (endpoint-independent NAT), uplinks ${RATE:-unshaped}${DELAY:+, +$DELAY each way}, $(basename "$BIN")"
printf '%-34s %8s %9s %14s %16s\n' "fetch" "seconds" "MB/s" "chunks relayed" "relays moved MB"
for who in "A hole-punched (r1 -> r2):1" "C relayed (r3 symmetric -> r2):3"; do
  label=${who%%:*} r=${who##*:}
  for k in $(seq "$REPEAT"); do
    name=get$r-$k
    before=$(moved)
    RUST_LOG=warn ip netns exec "$P-h$r" "$BIN" blob get "$HASH" -o "$WORK/$name.bin" --bootstrap "$SEED" \
      --data-dir "$WORK/$name" --events "$WORK/$name.jsonl" --timeout 600 >"$WORK/$name.out" 2>"$WORK/$name.log" ||
      { echo "bench/nat_lab.sh: $label failed:" >&2; tail -3 "$WORK/$name.log" >&2; exit 1; }
    cmp -s "$WORK/blob" "$WORK/$name.bin" || { echo "bench/nat_lab.sh: $label: the blob differs" >&2; exit 1; }
    after=$(moved)
    line=$(grep '"event":"blob_fetched"' "$WORK/$name.jsonl" | tail -1)
    secs=$(field "$line" seconds)
    awk -v l="$label" -v s="$secs" -v mb="$SIZE_MB" -v c="$(field "$line" chunks_relayed)/$(field "$line" chunks)" \
      -v m="$((after - before))" 'BEGIN { printf "%-34s %8.2f %9.1f %14s %16.1f\n", l, s, mb / s, c, m / 1e6 }'
  done
done
