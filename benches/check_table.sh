#!/usr/bin/env bash
# `trellis check` on a 100,000-route routing table, two builds side by side in one run:
# this build (target/release/trellis) and BASE (another build, e.g. the previous commit's),
# each timed by hyperfine over the same YAML and JSON files; prints both and the ratio.
#
#   cargo build --release && benches/check_table.sh /path/to/base/trellis [ROUTES]
#
# The table has the controller's shape: per route a server name, a CONNECT destination, a
# PROXY destination and two backends in two zones.
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:?usage: benches/check_table.sh BASE_TRELLIS [ROUTES]}
routes=${2:-100000}
this=target/release/trellis
command -v hyperfine >/dev/null || { apt-get update -qq && apt-get install -y -qq hyperfine; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
python3 - "$dir" "$routes" <<'PY'
import json, sys
d, n = sys.argv[1], int(sys.argv[2])
routes = []
for i in range(n):
    ns = f"shoot--p{i % 997}--s{i}"
    routes.append({
        "name": ns,
        "sni": [f"api.s{i}.p{i % 997}.internal.example.com"],
        "destinations": [f"outbound|443||kube-apiserver.{ns}.svc.cluster.local"],
        "proxyDestinations": [f"240.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}:443"],
        "backends": [
            {"address": f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}:443", "zone": "eu-1a"},
            {"address": f"kube-apiserver.{ns}.svc.cluster.local:443", "zone": "eu-1b"},
        ],
    })
head = {"apiVersion": "trellis.gardener.cloud/v1alpha1", "kind": "RoutingTable"}
json.dump({**head, "routes": routes}, open(f"{d}/routes.json", "w"))
with open(f"{d}/routes.yaml", "w") as f:
    f.write("apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes:\n")
    for r in routes:
        b = r["backends"]
        f.write(f"- name: {r['name']}\n  sni: [{r['sni'][0]}]\n"
                f"  destinations: [\"{r['destinations'][0]}\"]\n"
                f"  proxyDestinations: [\"{r['proxyDestinations'][0]}\"]\n"
                f"  backends:\n  - {{address: \"{b[0]['address']}\", zone: eu-1a}}\n"
                f"  - {{address: \"{b[1]['address']}\", zone: eu-1b}}\n")
PY
for format in yaml json; do
  file="$dir/routes.$format"
  "$this" check "$file" >/dev/null
  "$base" check "$file" >/dev/null
  hyperfine --warmup 1 --runs "${RUNS:-10}" --export-json "$dir/$format.json" \
    -n this "$this check $file" -n base "$base check $file" >/dev/null
  python3 - "$dir/$format.json" "$format" "$routes" <<'PY'
import json, sys
r = {x["command"]: x for x in json.load(open(sys.argv[1]))["results"]}
t, b = r["this"], r["base"]
print(f"check, {sys.argv[3]} routes, {sys.argv[2]}: this {t['mean']*1000:.0f} ms "
      f"(±{t['stddev']*1000:.0f}), base {b['mean']*1000:.0f} ms (±{b['stddev']*1000:.0f}), "
      f"this / base = {t['mean']/b['mean']:.3f}")
PY
done
