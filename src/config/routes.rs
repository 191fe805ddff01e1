//! `kind: RoutingTable` files: a list of routes in the routing table's schema
//! ([`super::table`]) and the indexed [`RoutingTable`] validation builds from them, with the
//! hash of the file's bytes.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::decode::Recovery;
use super::error::{ConfigError, Errors};
use super::load::{ConfigKind, Source, parse_with, read_file};
use super::table::table_of;
pub use super::table::{
    RawBackend, RawEgress, RawRoute, RawRouteTimeouts, RawTunnel, RawTunnelPeer, RawWireGuardRoute,
};
use super::value::ApiVersion;
use crate::route::{BackendRegistry, RoutingTable};

mapping_only!(RawRoutingTable);
serialize_derived!(RawRoutingTable);

/// A routing table file as written.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawRoutingTable {
    /// Always `trellis.gardener.cloud/v1alpha1`.
    pub api_version: ApiVersion,
    /// Always `RoutingTable`.
    pub kind: String,
    /// The routes; names and keys must be unique.
    #[serde(default)]
    pub routes: Vec<RawRoute>,
}

impl RawRoutingTable {
    /// A table of `routes` with this file kind's `apiVersion` and `kind`.
    pub fn new(routes: Vec<RawRoute>) -> RawRoutingTable {
        RawRoutingTable {
            api_version: ApiVersion::default(),
            kind: LoadedTable::KIND.to_owned(),
            routes,
        }
    }
}

/// A validated table and the hash of the file it was built from.
#[derive(Debug)]
pub struct LoadedTable {
    /// The indexed table (also what `/routes` shows: no second copy of the file is kept).
    pub table: RoutingTable,
    /// FNV-1a 64 hash of the file bytes, hex.
    pub hash: String,
}

/// FNV-1a, 64 bit: a stable content hash for "has the table changed" and `/routes`.
pub fn content_hash(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// Reads, parses and validates a routing table file.
pub fn load(file: &Path, registry: &BackendRegistry) -> Result<LoadedTable, ConfigError> {
    let bytes = read_file(file)?;
    parse(file, &bytes, registry)
}

/// Parses and validates routing table bytes read from `file`.
pub fn parse(
    file: &Path,
    bytes: &[u8],
    registry: &BackendRegistry,
) -> Result<LoadedTable, ConfigError> {
    parse_with(
        file,
        bytes,
        Tables {
            registry,
            hash: None,
        },
        Recovery::All,
    )
}

/// [`parse`] for a running gateway's reload, which has already hashed the bytes with
/// [`content_hash`]: decoding stops at the first type error (each further decode of a large
/// table would hold up the gateway's control thread); unknown fields and validation errors
/// are all reported as in [`parse`].
pub fn parse_hashed(
    file: &Path,
    bytes: &[u8],
    hash: String,
    registry: &BackendRegistry,
) -> Result<LoadedTable, ConfigError> {
    parse_with(
        file,
        bytes,
        Tables {
            registry,
            hash: Some(&hash),
        },
        Recovery::First,
    )
}

/// What validating a table needs besides the file.
#[derive(Debug, Clone, Copy)]
pub struct Tables<'a> {
    /// Where the backends' states live across reloads.
    pub registry: &'a BackendRegistry,
    /// The hash of the file's bytes, when the caller has it ([`content_hash`]).
    pub hash: Option<&'a str>,
}

impl ConfigKind for LoadedTable {
    const KIND: &'static str = "RoutingTable";
    const READ_BY: &'static str = "routes.file of 'trellis gateway'";
    type File = RawRoutingTable;
    type Context<'a> = Tables<'a>;

    fn validate(
        raw: RawRoutingTable,
        source: &Source<'_>,
        cx: Tables<'_>,
        errors: &mut Errors,
    ) -> Self {
        // The routes copy what they keep, and the decoded file is freed only after the last
        // one is built: the table's allocations then sit together instead of in the holes
        // each freed raw route would leave, so the previous generation's memory can be given
        // back whole after a reload.
        raw.api_version.check(errors);
        let table = table_of("routes", &raw.routes, source.dir(), cx.registry, errors);
        let hash = cx
            .hash
            .map_or_else(|| content_hash(source.bytes), str::to_owned);
        LoadedTable { table, hash }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route::{Net, ProxyVersion, WgKey};
    use std::net::IpAddr;

    fn check(yaml: &str) -> Result<LoadedTable, String> {
        parse(
            Path::new("routes.yaml"),
            yaml.as_bytes(),
            &BackendRegistry::default(),
        )
        .map_err(|e| e.to_string())
    }

    const HEAD: &str = "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\n";

    #[test]
    fn accepts_spec_example() {
        let t = check(&format!(
            "{HEAD}routes:
- name: shoot--dev--alpha
  sni: [api.alpha.dev.internal.example.com, \"*.alpha.example.com\"]
  destinations: [\"outbound|443||kube-apiserver.shoot--dev--alpha.svc.cluster.local\"]
  proxyDestinations: [\"240.168.102.23:443\"]
  backends:
  - {{address: \"10.1.2.3:443\", zone: eu-1a}}
  - address: \"kube-apiserver.shoot--dev--alpha.svc.cluster.local:443\"
  timeouts: {{connect: 5s, idle: 1h}}
  maxConnectionDuration: 24h
"
        ))
        .unwrap();
        assert_eq!(t.table.routes().len(), 1);
        assert!(t.table.by_sni("x.alpha.example.com").is_some());
    }

    #[test]
    fn reports_every_error_with_path() {
        let err = check(&format!(
            "{HEAD}routes:
- name: a
  sni: [\"bad name\"]
  backends: [{{address: nope}}]
  timeouts: {{connect: 5x}}
- name: b
  backends: []
"
        ))
        .unwrap_err();
        for needle in [
            "routes.yaml:5:9: routes[0].sni[0]: invalid server name",
            "routes.yaml:6:24: routes[0].backends[0].address: expected HOST:PORT",
            "routes.yaml:7:23: routes[0].timeouts.connect: invalid duration",
            "routes.yaml:9:13: routes[1].backends: at least one backend",
        ] {
            assert!(err.contains(needle), "{needle} not in {err}");
        }
    }

    #[test]
    fn unknown_field_has_path() {
        let err = check(&format!(
            "{HEAD}routes:\n- name: a\n  backends: [{{address: \"1.2.3.4:1\", weight: 3}}]\n"
        ))
        .unwrap_err();
        assert!(
            err.contains("routes[0].backends[0].weight: unknown field `weight`"),
            "{err}"
        );
    }

    /// `trellis check` (and a start) reports every type error; a running gateway's reload
    /// stops at the first and says where the rest are found.
    #[test]
    fn a_reload_stops_at_the_first_type_error() {
        let text = format!(
            "{HEAD}routes:
- {{name: a, sni: [a.example.com], backends: [{{address: \"1.2.3.4:1\", zone: [x]}}]}}
- {{name: b, sni: [b.example.com], backends: [{{address: \"1.2.3.4:2\", zone: [y]}}]}}
"
        );
        let file = Path::new("t.yaml");
        let registry = BackendRegistry::default();
        let all = parse(file, text.as_bytes(), &registry)
            .unwrap_err()
            .to_string();
        assert!(
            all.contains("routes[0].backends[0].zone")
                && all.contains("routes[1].backends[0].zone"),
            "{all}"
        );
        let hash = content_hash(text.as_bytes());
        let first = parse_hashed(file, text.as_bytes(), hash, &registry)
            .unwrap_err()
            .to_string();
        assert!(first.contains("routes[0].backends[0].zone"), "{first}");
        assert!(!first.contains("routes[1]"), "{first}");
        assert!(
            first.contains("`trellis check` lists every problem"),
            "{first}"
        );
    }

    #[test]
    fn duplicate_keys_name_both_routes() {
        let err = check(&format!(
            "{HEAD}routes:
- {{name: a, sni: [x.example.com], backends: [{{address: \"1.2.3.4:1\"}}]}}
- {{name: b, sni: [X.example.com.], backends: [{{address: \"1.2.3.4:2\"}}]}}
"
        ))
        .unwrap_err();
        assert!(
            err.contains(
                "routes[1]: sni \"x.example.com\" of route \"b\" is already claimed by route \"a\""
            ),
            "{err}"
        );
    }

    #[test]
    fn the_yaml_parser_takes_large_commented_tables() {
        // The YAML parser's defaults refuse more than 32 comment lines before a value and
        // more than 250,000 nodes (~10,400 routes of the benches' shape; here 12 nodes a
        // route); an anchor and its aliases are read too.
        let mut doc = format!("{HEAD}routes:\n");
        doc += &"# a retired route\n".repeat(40);
        for i in 0..21_000 {
            let zone = match i {
                0 => "&z eu-1a",
                1 => "*z",
                _ => "eu-1a",
            };
            doc += &format!(
                "- name: r{i}\n  sni: [r{i}.example.com]\n  backends: [{{address: \"10.0.0.1:443\", zone: {zone}}}]\n"
            );
        }
        assert_eq!(check(&doc).unwrap().table.routes().len(), 21_000);
    }

    #[test]
    fn allowed_source_ranges() {
        let t = check(&format!(
            "{HEAD}routes:
- name: a
  backends: [{{address: \"1.2.3.4:1\"}}]
  allowedSourceRanges: [\"203.0.113.0/24\", 198.51.100.7, \"2001:db8::/32\"]
- name: b
  backends: [{{address: \"1.2.3.4:1\"}}]
"
        ))
        .unwrap();
        let (a, b) = (&t.table.routes()[0], &t.table.routes()[1]);
        let ip = |s: &str| s.parse().unwrap();
        assert!(a.admits(ip("203.0.113.200")));
        assert!(a.admits(ip("198.51.100.7")));
        assert!(!a.admits(ip("198.51.100.8")));
        assert!(a.admits(ip("2001:db8::5")));
        assert!(!a.admits(ip("127.0.0.1")));
        // Left out: every client.
        assert!(b.allowed_sources.is_none());
        assert!(b.admits(ip("127.0.0.1")) && b.admits(ip("::1")));

        let err = check(&format!(
            "{HEAD}routes:
- {{name: a, backends: [{{address: \"1.2.3.4:1\"}}], allowedSourceRanges: []}}
- {{name: b, backends: [{{address: \"1.2.3.4:1\"}}], allowedSourceRanges: [\"10.0.0.0/33\", nope, \"::/0\"]}}
"
        ))
        .unwrap_err();
        for needle in [
            "routes[0].allowedSourceRanges: an empty list would admit no client",
            "routes[1].allowedSourceRanges[0]: invalid prefix length",
            "routes[1].allowedSourceRanges[1]: invalid IP address",
        ] {
            assert!(err.contains(needle), "{needle} not in {err}");
        }
        assert!(!err.contains("allowedSourceRanges[2]"), "{err}");
    }

    #[test]
    fn send_proxy_protocol_and_forward_connect() {
        let t = check(&format!(
            "{HEAD}routes:
- {{name: a, backends: [{{address: \"1.2.3.4:1\"}}], sendProxyProtocol: v1}}
- {{name: b, backends: [{{address: \"1.2.3.4:1\"}}], sendProxyProtocol: v2, forwardConnect: true}}
- {{name: c, backends: [{{address: \"1.2.3.4:1\"}}]}}
"
        ))
        .unwrap();
        let r = t.table.routes();
        assert_eq!(
            r.iter()
                .map(|r| (r.send_proxy_protocol, r.forward_connect))
                .collect::<Vec<_>>(),
            [
                (Some(ProxyVersion::V1), false),
                (Some(ProxyVersion::V2), true),
                (None, false)
            ]
        );
        let err = check(&format!(
            "{HEAD}routes:
- {{name: a, backends: [{{address: \"1.2.3.4:1\"}}], sendProxyProtocol: v3}}
- {{name: b, backends: [{{address: \"1.2.3.4:1\"}}], sendProxyProtocol: \"\"}}
"
        ))
        .unwrap_err();
        for needle in [
            "routes[0].sendProxyProtocol: expected v1 or v2, got \"v3\"",
            "routes[1].sendProxyProtocol: expected v1 or v2, got \"\"",
        ] {
            assert!(err.contains(needle), "{needle} not in {err}");
        }
        let err = check(&format!(
            "{HEAD}routes:\n- {{name: c, backends: [{{address: \"1.2.3.4:1\"}}], forwardConnect: yes-please}}\n"
        ))
        .unwrap_err();
        assert!(
            err.contains("routes[0].forwardConnect: invalid boolean"),
            "{err}"
        );
    }

    /// A key as `wg pubkey` prints it.
    fn key(b: u8) -> String {
        WgKey([b; 32]).to_base64()
    }

    /// A table of one tunnel route with these peers (flow YAML) and local addresses.
    fn tunnel_table(peers: &str, local: &str) -> String {
        format!(
            "{HEAD}routes:\n- name: t\n  tunnel:\n    wireguard:\n      peers: {peers}\n      localAddresses: {local}\n"
        )
    }

    #[test]
    fn a_tunnel_route_needs_no_backends() {
        let t = check(&format!(
            "{HEAD}routes:
- name: shoot--dev--alpha
  tunnel:
    wireguard:
      peers:
      - publicKey: \"{}\"
        allowedIPs: [\"192.168.128.5/32\", \"10.250.0.0/16\"]
      - publicKey: \"{}\"
        allowedIPs: [192.168.128.6, \"10.250.0.0/16\", \"fd8f:6d53:b97a:1::6/128\"]
      localAddresses: [192.168.128.1, \"fd8f:6d53:b97a:1::1\"]
  egress:
    clientIdentities: [shoot--dev--alpha]
    allowedNetworks: [\"10.250.0.0/16\"]
    via: tunnel
- name: no-tunnel-yet
  egress: {{clientIdentities: [beta], allowedNetworks: [\"10.0.0.0/8\"]}}
",
            key(1),
            key(2)
        ))
        .unwrap();
        let r = t.table.by_name("shoot--dev--alpha").unwrap();
        let tunnel = r.tunnel.as_deref().unwrap();
        assert!(r.backends.is_empty());
        assert_eq!(tunnel.peers.len(), 2);
        assert_eq!(tunnel.peers[1].public_key, WgKey([2; 32]));
        assert_eq!(
            tunnel.peers[1].allowed_ips[0],
            Net::parse("192.168.128.6/32").unwrap()
        );
        assert_eq!(
            tunnel.local_addresses[..],
            [
                "192.168.128.1".parse::<IpAddr>().unwrap(),
                "fd8f:6d53:b97a:1::1".parse().unwrap()
            ]
        );
        assert_eq!(
            t.table
                .by_public_key(&WgKey([2; 32]))
                .map(|(r, p)| (r.name(), p)),
            Some(("shoot--dev--alpha", 1))
        );
        // Egress via the tunnel with no tunnel is valid: the gateway answers 504.
        assert!(t.table.by_name("no-tunnel-yet").unwrap().tunnel.is_none());
    }

    /// Each rule of `tunnel.wireguard`, broken once, is reported at its path; the same table
    /// with the rule kept is valid (so each assertion fails when its rule goes).
    #[test]
    fn tunnel_rules_each_have_an_error() {
        let ok_peer = format!(
            "[{{publicKey: \"{}\", allowedIPs: [\"10.250.0.0/16\"]}}]",
            key(1)
        );
        let ok_local = "[10.251.0.1, \"fd00::1\"]";
        check(&tunnel_table(&ok_peer, ok_local)).unwrap();
        let base64_31 =
            base64::Engine::encode(&base64::engine::general_purpose::STANDARD, [7u8; 31]);
        let cases = [
            (
                tunnel_table(
                    "[{publicKey: \"not a key!\", allowedIPs: [10.0.0.1]}]",
                    ok_local,
                ),
                "routes[0].tunnel.wireguard.peers[0].publicKey: not base64",
            ),
            (
                tunnel_table(
                    &format!("[{{publicKey: \"{base64_31}\", allowedIPs: [10.0.0.1]}}]"),
                    ok_local,
                ),
                "routes[0].tunnel.wireguard.peers[0].publicKey: a WireGuard key is 32 bytes, this is 31",
            ),
            (
                tunnel_table("[]", ok_local),
                "routes[0].tunnel.wireguard.peers: at least one peer is required",
            ),
            (
                tunnel_table(
                    &format!(
                        "[{{publicKey: \"{}\", allowedIPs: [\"10.250.0.0/16\"]}}, {{publicKey: \"{}\", allowedIPs: [10.0.0.1]}}]",
                        key(1),
                        key(1)
                    ),
                    ok_local,
                ),
                "routes[0].tunnel.wireguard.peers[1].publicKey: the key of peers[0] again",
            ),
            (
                tunnel_table(&format!("[{{publicKey: \"{}\"}}]", key(1)), ok_local),
                "routes[0].tunnel.wireguard.peers[0].allowedIPs: at least one network is required",
            ),
            (
                tunnel_table(
                    &format!(
                        "[{{publicKey: \"{}\", allowedIPs: [\"10.0.0.0/33\"]}}]",
                        key(1)
                    ),
                    ok_local,
                ),
                "routes[0].tunnel.wireguard.peers[0].allowedIPs[0]: invalid prefix length",
            ),
            (
                tunnel_table(&ok_peer, "[\"10.250.3.1\"]"),
                "routes[0].tunnel.wireguard.localAddresses[0]: 10.250.3.1 is inside 10.250.0.0/16, an allowedIPs network of peers[0]",
            ),
            (
                tunnel_table(&ok_peer, "[10.251.0.1, 10.251.0.2]"),
                "routes[0].tunnel.wireguard.localAddresses[1]: a second IPv4 address (localAddresses[0])",
            ),
            (
                tunnel_table(&ok_peer, "[\"fd00::1\", \"fd00::2\"]"),
                "routes[0].tunnel.wireguard.localAddresses[1]: a second IPv6 address (localAddresses[0])",
            ),
            (
                tunnel_table(&ok_peer, "[]"),
                "routes[0].tunnel.wireguard.localAddresses: one or two addresses are required (at most one per family), got 0",
            ),
            (
                tunnel_table(&ok_peer, "[10.251.0.1, \"fd00::1\", 10.251.0.2]"),
                "routes[0].tunnel.wireguard.localAddresses: one or two addresses are required (at most one per family), got 3",
            ),
            (
                tunnel_table(&ok_peer, "[gateway]"),
                "routes[0].tunnel.wireguard.localAddresses[0]: expected an IP address, got \"gateway\"",
            ),
            (
                tunnel_table(&ok_peer, "[0.0.0.0]"),
                "routes[0].tunnel.wireguard.localAddresses[0]: 0.0.0.0 is not a unicast address",
            ),
            (
                tunnel_table(
                    &format!(
                        "[{{publicKey: \"{}\", allowedIPs: [10.0.0.1], endpoint: \"1.2.3.4:51820\"}}]",
                        key(1)
                    ),
                    ok_local,
                ),
                "routes[0].tunnel.wireguard.peers[0].endpoint: unknown field `endpoint`",
            ),
        ];
        for (table, needle) in cases {
            let err = check(&table)
                .err()
                .unwrap_or_else(|| panic!("accepted:\n{table}"));
            assert!(err.contains(needle), "{needle}\nnot in:\n{err}");
        }
        // A key in two routes is refused, naming both.
        let err = check(&format!(
            "{HEAD}routes:
- {{name: a, tunnel: {{wireguard: {{peers: [{{publicKey: \"{k}\", allowedIPs: [10.0.0.1]}}], localAddresses: [10.9.0.1]}}}}}}
- {{name: b, tunnel: {{wireguard: {{peers: [{{publicKey: \"{k2}\", allowedIPs: [10.0.0.2]}}, {{publicKey: \"{k}\", allowedIPs: [10.0.0.1]}}], localAddresses: [10.9.0.1]}}}}}}
",
            k = key(1),
            k2 = key(2),
        ))
        .unwrap_err();
        assert_eq!(
            err,
            format!(
                "routes.yaml:5:3: routes[1]: tunnel.wireguard.publicKey \"{}\" of route \"b\" is already claimed by route \"a\" (routes[0])",
                key(1)
            )
        );
        // Found also when the first route's tunnel has another problem.
        let err = check(&format!(
            "{HEAD}routes:
- {{name: a, tunnel: {{wireguard: {{peers: [{{publicKey: \"{k}\", allowedIPs: [10.0.0.1]}}], localAddresses: [10.0.0.1]}}}}}}
- {{name: b, tunnel: {{wireguard: {{peers: [{{publicKey: \"{k}\", allowedIPs: [10.0.0.1]}}], localAddresses: [10.9.0.1]}}}}}}
",
            k = key(1),
        ))
        .unwrap_err();
        assert!(
            err.contains("routes[0].tunnel.wireguard.localAddresses[0]: 10.0.0.1 is inside"),
            "{err}"
        );
        assert!(
            err.contains("routes[1]: tunnel.wireguard.publicKey"),
            "{err}"
        );
        // Without backends, egress or tunnel, a route leads nowhere.
        let err = check(&format!("{HEAD}routes:\n- name: x\n")).unwrap_err();
        assert!(err.contains("routes[0].backends: at least one backend is required (a route without backends needs egress or tunnel)"), "{err}");
    }

    /// A validated route in the schema ([`RawRoute::from`], what `/routes` shows) reads back
    /// as the same route, every field included; the schema is also what is written.
    #[test]
    fn a_route_shown_in_the_schema_reads_back() {
        let dir = std::env::temp_dir().join(format!("trellis-schema-{}", std::process::id()));
        let file = dir.join("routes.yaml");
        let table = format!(
            "{HEAD}routes:
- name: all
  sni: [\"*.a.example.com\", API.a.example.com.]
  destinations: [\"outbound|443||kube-apiserver.a.svc.cluster.local\"]
  proxyDestinations: [\"240.0.0.1:443\"]
  backends: [{{address: \"10.1.2.3:443\", zone: eu-1a}}, {{address: \"kube-apiserver.a:443\"}}]
  timeouts: {{connect: 5000ms, idle: 1h}}
  maxConnectionDuration: 24h
  allowedSourceRanges: [\"203.0.113.0/24\", \"2001:db8::/32\"]
  sendProxyProtocol: v2
  forwardConnect: true
  egress:
    clientIdentities: [kube-apiserver-http-proxy]
    serverNames: [vpn.a.example.com]
    clientSources: [10.64.1.10]
    tls: {{certificateFile: a.crt, keyFile: a.key, clientCAFile: a-ca.crt}}
    allowedNetworks: [\"10.250.0.0/16\"]
    directNetworks: [\"10.1.0.0/16\"]
  tunnel:
    wireguard:
      peers: [{{publicKey: \"{}\", allowedIPs: [192.168.128.5, \"fd00:1::/64\"]}}]
      localAddresses: [\"fd00:2::1\", 192.168.128.1]
- name: plain
  backends: [{{address: \"10.1.2.4:443\"}}]
",
            key(1)
        );
        let first = parse(&file, table.as_bytes(), &BackendRegistry::default()).unwrap();
        let shown: Vec<RawRoute> = first
            .table
            .routes()
            .iter()
            .map(|r| RawRoute::from(&**r))
            .collect();
        let json = serde_json::to_string(&RawRoutingTable::new(shown.clone())).unwrap();
        let again = parse(&file, json.as_bytes(), &BackendRegistry::default())
            .unwrap_or_else(|e| panic!("{e}\n{json}"));
        let shown_again: Vec<RawRoute> = again
            .table
            .routes()
            .iter()
            .map(|r| RawRoute::from(&**r))
            .collect();
        assert_eq!(shown, shown_again);
        let all = &shown[0];
        assert_eq!(all.sni, ["*.a.example.com", "api.a.example.com"]);
        assert_eq!(
            all.timeouts.as_ref().and_then(|t| t.connect.as_deref()),
            Some("5s")
        );
        assert_eq!(
            all.allowed_source_ranges.as_deref(),
            Some(&["203.0.113.0/24".to_owned(), "2001:db8::/32".to_owned()][..])
        );
        let egress = all.egress.as_ref().unwrap();
        assert_eq!(egress.client_sources, ["10.64.1.10/32"]);
        assert_eq!(egress.via.as_deref(), Some("tunnel"));
        assert_eq!(
            egress.tls.as_ref().map(|t| t.key_file.as_str()),
            Some(dir.join("a.key").to_str().unwrap())
        );
        assert_eq!(
            again.table.routes()[0].tunnel,
            first.table.routes()[0].tunnel
        );
        // Left out when empty: a plain route is its name and backends.
        let plain = serde_json::to_value(&shown[1]).unwrap();
        assert_eq!(
            plain,
            serde_json::json!({"name": "plain", "backends": [{"address": "10.1.2.4:443"}]})
        );
    }

    /// A peer's live `state` is shown by `/routes` only: a file cannot set it.
    #[test]
    fn a_peer_state_is_not_read_from_a_file() {
        let err = check(&tunnel_table(
            &format!(
                "[{{publicKey: \"{}\", allowedIPs: [10.0.0.1], state: {{endpoint: \"1.2.3.4:5\"}}}}]",
                key(1)
            ),
            "[10.9.0.1]",
        ))
        .unwrap_err();
        assert!(
            err.contains("routes[0].tunnel.wireguard.peers[0].state: unknown field `state`"),
            "{err}"
        );
    }

    #[test]
    fn rejects_wrong_header() {
        let err = check("apiVersion: v1\nkind: RoutingTable\n").unwrap_err();
        assert!(err.contains("apiVersion: unsupported"), "{err}");
    }
}
