//! What the routing benches share: a seed-sized routing table.

/// Routes in a seed-sized table.
pub const ROUTES: usize = 10_000;

/// A routing table in YAML with `n` routes, each with 2 SNI names (one wildcard),
/// 2 CONNECT destinations, 1 PROXY destination and 2 backends (an IP and a DNS name);
/// `generation` varies one backend address so successive tables differ.
pub fn table_yaml(n: usize, generation: usize) -> String {
    let mut out =
        String::from("apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes:\n");
    for i in 0..n {
        out += &format!(
            "- name: shoot--p{i}--s{i}\n  sni: [api.s{i}.p{i}.internal.example.com, \"*.s{i}.p{i}.example.com\"]\n  destinations: [\"outbound|443||kube-apiserver.shoot--p{i}--s{i}.svc.cluster.local\", \"outbound|1194||vpn-seed-server.shoot--p{i}--s{i}.svc.cluster.local\"]\n  proxyDestinations: [\"240.{}.{}.{}:443\"]\n  backends:\n  - {{address: \"10.{}.{}.{}:443\", zone: eu-1a}}\n  - {{address: \"kube-apiserver.shoot--p{i}--s{i}.svc.cluster.local:443\"}}\n",
            (i >> 16) & 255,
            (i >> 8) & 255,
            i & 255,
            (i >> 16) & 255,
            (i >> 8) & 255,
            (i + generation) & 255,
        );
    }
    out
}

/// The same table as JSON (what a controller writes; JSON is YAML too).
pub fn table_json(n: usize, generation: usize) -> String {
    let v: serde_json::Value = serde_saphyr::from_str(&table_yaml(n, generation)).unwrap();
    serde_json::to_string(&v).unwrap()
}
