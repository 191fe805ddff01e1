//! Shoots' tunnel and egress routes: per shoot namespace, its `Cluster` (the shoot's
//! networks), its tunnel peers Secret (the agents' public keys and tunnel addresses), the
//! `vpn-seed-server` certificate and `ca-vpn` bundle gardenlet's secrets manager writes, and
//! the `kube-apiserver` EndpointSlices become one route, [`route_name`], with
//! `tunnel.wireguard` and `egress`; the egress TLS material becomes files beside the table
//! ([`Files`]), which the route names by relative paths and never holds itself.
//!
//! - **Peers**: every Secret labelled [`TUNNEL_PEERS_LABEL`] in the namespace (oldest first),
//!   per peer `<peer>.publicKey` (as `wg pubkey` prints it) and, optionally,
//!   `<peer>.addresses` (the agent's tunnel addresses, comma or space separated, one per
//!   family). A peer's `allowedIPs` are its addresses (`/32`, `/128`) and the shoot's
//!   networks. A peer whose key or addresses are invalid is left out (`invalid_peer`); a key
//!   an older shoot (or peer) has is left out (`conflict`): a key is one peer in a table.
//! - **Local addresses**: the target's ([`Target::tunnel_local_addresses`]), the same in
//!   every shoot (their stacks are isolated); a shoot whose networks or an agent whose
//!   addresses hold one cannot be served (the gateway would answer for the shoot's own
//!   address): `unsupported` / `invalid_peer`.
//! - **Egress**, for a shoot with a tunnel only (the egress dials through it, and no private
//!   key is copied for a shoot that does not use trellis): `clientSources` are every address
//!   of the `kube-apiserver` EndpointSlices, ready or not, terminating or not (`/32`,
//!   `/128`; one held by an older shoot is left out, `conflict`): a source address is the
//!   shoot's identity here, not a backend to balance over, and Gardener's kube-apiserver
//!   keeps serving, and calling out, for 15 s after it is marked terminating
//!   (`--shutdown-delay-duration`), and before it is ready, `clientIdentities` the CN of Gardener's egress client
//!   certificate ([`EGRESS_IDENTITIES`]), `tls` the newest `vpn-seed-server` certificate and
//!   the newest `ca-vpn` bundle ([`newest`]), `allowedNetworks` the shoot's networks.
//!   Without both TLS Secrets: `no_egress_tls`; without any endpoint address (a hibernated
//!   shoot): `no_endpoints`; with addresses that older shoots hold, every one: `conflict`.
//! - A shoot without peers gets neither (`no_tunnel_peers`).
//! - A network the Cluster writes with host bits set (`10.250.0.1/16`) is used with them
//!   cleared (`10.250.0.0/16`), as gardenlet would not fail the shoot for it either, and the
//!   report names it (`normalised`: the Cluster, the field, the text and the network used).
//!
//! Shoots are settled oldest Cluster first (creation time, then name), so a contested key
//! or source stays where it was. Pure: no I/O, no runtime; the files are returned as bytes
//! for the writer ([`super::output`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use super::model::{
    Cluster, Meta, PeerEntry, Secret, SecretBytes, SecretContent, Snapshot, TUNNEL_PEERS_LABEL,
};
use super::report::{Reason, Report};
use super::target::Target;
use crate::config::routes::{RawEgress, RawRoute, RawTunnel, RawTunnelPeer, RawWireGuardRoute};
use crate::config::tls::RawTls;
use crate::route::{Net, WgKey};

/// The CNs of the client certificate Gardener issues every kube-apiserver for its egress,
/// signed by the shoot's `ca-vpn`: `kube-apiserver-http-proxy` before Gardener 1.124,
/// `kube-apiserver-http-proxy-client` since. An egress route requires one of them, so no
/// other certificate of that CA (the VPN's own) is taken for the kube-apiserver.
pub const EGRESS_IDENTITIES: [&str; 2] = [
    "kube-apiserver-http-proxy",
    "kube-apiserver-http-proxy-client",
];

/// The Service whose endpoints are a shoot's egress clients.
const KUBE_APISERVER: &str = "kube-apiserver";

/// Files a table names, to be written beside it: name (relative to the table's directory)
/// -> contents.
pub type Files = BTreeMap<String, SecretBytes>;

/// The route of shoot namespace `ns`'s tunnel and egress: `<ns>.tunnel`. Namespace and
/// Service names have no `.`, so no other route can have it (nor a reserved name).
pub fn route_name(ns: &str) -> String {
    format!("{ns}.tunnel")
}

/// What an egress TLS file of a shoot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EgressFile {
    /// The server certificate chain (`vpn-seed-server`'s `tls.crt`).
    Certificate,
    /// Its private key (`tls.key`).
    Key,
    /// The client CA bundle (`ca-vpn`'s `bundle.crt`).
    ClientCa,
}

impl EgressFile {
    /// The name's suffix after `egress.<ns>`.
    fn suffix(self) -> &'static str {
        match self {
            EgressFile::Certificate => ".crt",
            EgressFile::Key => ".key",
            EgressFile::ClientCa => ".ca.crt",
        }
    }

    /// The file of shoot namespace `ns`: `egress.<ns>.crt`, `.key`, `.ca.crt`.
    pub fn name(self, ns: &str) -> String {
        format!("egress.{ns}{}", self.suffix())
    }

    /// What the file `name` holds, when it is an egress file of some namespace (the writer
    /// removes those the table no longer names).
    pub fn of(name: &str) -> Option<EgressFile> {
        let rest = name.strip_prefix("egress.")?;
        // `.ca.crt` before `.crt`, which it ends with.
        let (ns, file) = [
            EgressFile::ClientCa,
            EgressFile::Certificate,
            EgressFile::Key,
        ]
        .into_iter()
        .find_map(|f| Some((rest.strip_suffix(f.suffix())?, f)))?;
        let label = !ns.is_empty()
            && ns
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        label.then_some(file)
    }

    /// Whether the file holds a private key (written readable by its owner only).
    pub fn is_private(self) -> bool {
        self == EgressFile::Key
    }
}

/// Of several secrets-manager Secrets of one name (a rotation in progress, or the old one not
/// yet cleaned up), the one in use: the newest by creation time, then by its
/// `issued-at-time` label, then by name — the rule gardenlet's secrets manager itself uses
/// to find the current Secret of a name. Gardener signs a new server certificate and a new
/// bundle into new Secrets (their names carry a hash of their content) and deletes the old
/// ones once the shoot is reconciled, so the newest is what its kube-apiservers are rolled
/// to: during a CA rotation the new bundle holds the old and the new CA.
pub fn newest<'a>(secrets: impl IntoIterator<Item = (&'a Meta, Option<u64>)>) -> Option<&'a Meta> {
    secrets
        .into_iter()
        .max_by(|(a, ia), (b, ib)| {
            (a.created.is_some(), &a.created, ia, &a.name).cmp(&(
                b.created.is_some(),
                &b.created,
                ib,
                &b.name,
            ))
        })
        .map(|(m, _)| m)
}

/// The Secrets of one namespace that translation reads.
#[derive(Default)]
struct Shoot<'a> {
    /// Tunnel peers Secrets, oldest first.
    peers: Vec<(&'a Meta, &'a [PeerEntry])>,
    /// `vpn-seed-server` certificates.
    certificates: Vec<(&'a Meta, Option<u64>, &'a SecretBytes, &'a SecretBytes)>,
    /// `ca-vpn` bundles.
    bundles: Vec<(&'a Meta, Option<u64>, &'a SecretBytes)>,
}

/// The tunnel routes of `clusters` (the shoots whose namespaces are not being deleted),
/// unordered, and the files they name.
pub(super) fn routes(
    snapshot: &Snapshot,
    target: &Target,
    clusters: &[&Cluster],
    report: &mut Report,
) -> (Vec<RawRoute>, Files) {
    let mut routes = Vec::new();
    let mut files = Files::new();
    let local = &target.tunnel_local_addresses;
    if local.is_empty() {
        return (routes, files);
    }
    let mut shoots: HashMap<&str, Shoot<'_>> = HashMap::new();
    for Secret { meta, content } in &snapshot.secrets {
        let shoot = shoots.entry(meta.namespace.as_str()).or_default();
        match content {
            SecretContent::TunnelPeers(peers) => shoot.peers.push((meta, peers)),
            SecretContent::EgressCertificate {
                issued_at,
                certificate,
                key,
            } => shoot
                .certificates
                .push((meta, *issued_at, certificate, key)),
            SecretContent::EgressClientCa { issued_at, bundle } => {
                shoot.bundles.push((meta, *issued_at, bundle))
            }
            SecretContent::Other => {}
        }
    }
    for shoot in shoots.values_mut() {
        shoot.peers.sort_by(|a, b| a.0.age().cmp(&b.0.age()));
    }
    let sources = kube_apiserver_addresses(snapshot);
    let mut clusters = clusters.to_vec();
    clusters.sort_by(|a, b| a.meta.age().cmp(&b.meta.age()));
    let named: BTreeSet<&str> = clusters.iter().map(|c| c.meta.name.as_str()).collect();
    // Keys and sources held, and by whom (`Secret ns/name` or the namespace).
    let mut keys: HashMap<WgKey, String> = HashMap::new();
    let mut held: HashMap<IpAddr, &str> = HashMap::new();
    for cluster in clusters {
        let ns = cluster.meta.name.as_str();
        let object = || format!("Cluster {ns}");
        report.normalised(&object(), &cluster.host_bits);
        let shoot = shoots.get(ns);
        let peer_secrets = shoot.map_or(&[][..], |s| &s.peers[..]);
        if peer_secrets.is_empty() {
            report.skip(
                Reason::NoTunnelPeers,
                object(),
                format!(
                    "no Secret labelled {}={}: no tunnel, no egress",
                    TUNNEL_PEERS_LABEL.0, TUNNEL_PEERS_LABEL.1
                ),
            );
            continue;
        }
        if let Some((ip, net)) = local
            .iter()
            .find_map(|ip| Some((ip, cluster.networks.iter().find(|n| n.contains(*ip))?)))
        {
            report.skip(
                Reason::Unsupported,
                object(),
                format!(
                    "the gateway's tunnel address {ip} is inside the shoot's network {net}: no tunnel, no egress"
                ),
            );
            continue;
        }
        let mut peers = Vec::new();
        for (meta, entries) in peer_secrets {
            for entry in entries.iter() {
                let secret = format!("Secret {}", meta.key());
                match peer(entry, cluster, local) {
                    Err(why) => report.skip(
                        Reason::InvalidPeer,
                        secret,
                        format!("peer {:?}: {why}", entry.name),
                    ),
                    Ok((key, allowed)) => {
                        if let Some(holder) = keys.get(&key) {
                            report.skip(
                                Reason::Conflict,
                                secret,
                                format!(
                                    "peer {:?}: its public key is a peer of the older {holder}",
                                    entry.name
                                ),
                            );
                            continue;
                        }
                        keys.insert(key, format!("{secret} (peer {:?})", entry.name));
                        peers.push(RawTunnelPeer {
                            public_key: key.to_base64(),
                            allowed_ips: allowed.iter().map(Net::to_string).collect(),
                            state: None,
                        });
                    }
                }
            }
        }
        if peers.is_empty() {
            report.skip(
                Reason::NoTunnelPeers,
                object(),
                "no usable tunnel peer: no tunnel, no egress",
            );
            continue;
        }
        let egress = shoot.and_then(|shoot| {
            egress(
                ns,
                cluster,
                shoot,
                sources.get(ns),
                &mut held,
                &mut files,
                report,
            )
        });
        routes.push(RawRoute {
            name: route_name(ns),
            egress,
            tunnel: Some(RawTunnel {
                wireguard: RawWireGuardRoute {
                    peers,
                    local_addresses: local.iter().map(IpAddr::to_string).collect(),
                },
            }),
            ..RawRoute::default()
        });
    }
    // Peers for a namespace without a Cluster reach no network.
    let mut orphans: Vec<&(&Meta, &[PeerEntry])> = shoots
        .iter()
        .filter(|(ns, _)| !named.contains(*ns))
        .flat_map(|(_, s)| &s.peers)
        .collect();
    orphans.sort_by_key(|(meta, _)| meta.key());
    for (meta, _) in orphans {
        if snapshot
            .clusters
            .iter()
            .any(|c| c.meta.name == meta.namespace)
        {
            // A Cluster whose namespace is being deleted: reported with the namespace.
            continue;
        }
        report.skip(
            Reason::Unsupported,
            format!("Secret {}", meta.key()),
            "no Cluster named like its namespace: the shoot's networks are unknown",
        );
    }
    (routes, files)
}

/// A peer's key and `allowedIPs` (its own addresses, then the shoot's networks), or why it
/// cannot be one.
fn peer(
    entry: &PeerEntry,
    cluster: &Cluster,
    local: &[IpAddr],
) -> Result<(WgKey, Vec<Net>), String> {
    let key = entry
        .public_key
        .as_deref()
        .ok_or("no publicKey")
        .and_then(|k| WgKey::from_base64(k).map_err(|_| "publicKey is not a WireGuard key"))?;
    let mut allowed: Vec<Net> = Vec::new();
    let texts = entry.addresses.as_deref().unwrap_or("");
    for text in texts
        .split([',', ' ', '\n', '\t'])
        .filter(|t| !t.is_empty())
    {
        let ip: IpAddr = text
            .parse::<IpAddr>()
            .map(|ip| ip.to_canonical())
            .map_err(|_| format!("address {text:?} is not an IP address"))?;
        if local.contains(&ip) {
            return Err(format!("address {ip} is the gateway's own in the tunnel"));
        }
        if allowed.iter().any(|n| n.is_ipv4() == ip.is_ipv4()) {
            return Err(format!("a second address of {ip}'s family"));
        }
        allowed.push(Net::host(ip));
    }
    for net in &cluster.networks {
        if !allowed.contains(net) {
            allowed.push(*net);
        }
    }
    if allowed.is_empty() {
        return Err("no addresses, and the shoot has no networks".into());
    }
    Ok((key, allowed))
}

/// The egress of shoot `ns`, its files added to `files`, or `None` (reported).
fn egress<'a>(
    ns: &'a str,
    cluster: &Cluster,
    shoot: &Shoot<'_>,
    sources: Option<&BTreeSet<IpAddr>>,
    held: &mut HashMap<IpAddr, &'a str>,
    files: &mut Files,
    report: &mut Report,
) -> Option<RawEgress> {
    let object = || format!("Cluster {ns}");
    let certificate = newest(shoot.certificates.iter().map(|c| (c.0, c.1)))
        .and_then(|m| shoot.certificates.iter().find(|c| std::ptr::eq(c.0, m)));
    let bundle = newest(shoot.bundles.iter().map(|b| (b.0, b.1)))
        .and_then(|m| shoot.bundles.iter().find(|b| std::ptr::eq(b.0, m)));
    let (Some(&(_, _, certificate, key)), Some(&(_, _, bundle))) = (certificate, bundle) else {
        report.skip(
            Reason::NoEgressTls,
            object(),
            "no vpn-seed-server certificate or no ca-vpn bundle Secret (secrets manager): no egress",
        );
        return None;
    };
    let pem = |b: &SecretBytes| b.as_bytes().windows(11).any(|w| w == b"-----BEGIN ");
    if !(pem(certificate) && pem(key) && pem(bundle)) {
        report.skip(
            Reason::NoEgressTls,
            object(),
            "the vpn-seed-server certificate, its key or the ca-vpn bundle is not PEM: no egress",
        );
        return None;
    }
    let mut client_sources = Vec::new();
    // Addresses older shoots hold, and which.
    let mut taken: Vec<(IpAddr, &str)> = Vec::new();
    for &ip in sources.into_iter().flatten() {
        match held.get(&ip) {
            Some(older) => taken.push((ip, older)),
            None => {
                held.insert(ip, ns);
                client_sources.push(Net::host(ip).to_string());
            }
        }
    }
    if client_sources.is_empty() && taken.is_empty() {
        report.skip(
            Reason::NoEndpoints,
            object(),
            "no kube-apiserver endpoint address: no egress",
        );
        return None;
    }
    if client_sources.is_empty() {
        // Addresses there are, but every one is another shoot's: one conflict, the shoot's.
        let list: Vec<String> = taken
            .iter()
            .map(|(ip, older)| format!("{ip} of {older}"))
            .collect();
        report.skip(
            Reason::Conflict,
            object(),
            format!(
                "every kube-apiserver address is an egress client of an older shoot ({}): no egress",
                list.join(", ")
            ),
        );
        return None;
    }
    for (ip, older) in taken {
        report.skip(
            Reason::Conflict,
            object(),
            format!("kube-apiserver address {ip} is an egress client of the older {older}"),
        );
    }
    let mut name = |file: EgressFile, bytes: &SecretBytes| {
        let name = file.name(ns);
        files.insert(name.clone(), bytes.clone());
        name
    };
    Some(RawEgress {
        client_identities: EGRESS_IDENTITIES.iter().map(|s| s.to_string()).collect(),
        client_sources,
        tls: Some(RawTls {
            certificate_file: name(EgressFile::Certificate, certificate),
            key_file: name(EgressFile::Key, key),
            client_ca_file: name(EgressFile::ClientCa, bundle),
        }),
        allowed_networks: cluster.networks.iter().map(Net::to_string).collect(),
        ..RawEgress::default()
    })
}

/// Every address of every namespace's `kube-apiserver` EndpointSlices (ready, not ready and
/// terminating alike: the pods that may call out), sorted.
fn kube_apiserver_addresses(snapshot: &Snapshot) -> HashMap<&str, BTreeSet<IpAddr>> {
    let mut out: HashMap<&str, BTreeSet<IpAddr>> = HashMap::new();
    for slice in &snapshot.endpoint_slices {
        if slice.service != KUBE_APISERVER
            || !matches!(slice.address_type.as_str(), "IPv4" | "IPv6")
        {
            continue;
        }
        let addresses = slice
            .endpoints
            .iter()
            .filter_map(|e| e.address)
            .map(|ip| ip.to_canonical());
        out.entry(slice.meta.namespace.as_str())
            .or_default()
            .extend(addresses);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(ns: &str, name: &str, created: Option<&str>) -> Meta {
        Meta {
            name: name.into(),
            namespace: ns.into(),
            uid: String::new(),
            created: created.map(str::to_owned),
        }
    }

    #[test]
    fn egress_files_are_named_per_namespace_and_recognised() {
        let ns = "shoot--dev--a1";
        for (file, name) in [
            (EgressFile::Certificate, "egress.shoot--dev--a1.crt"),
            (EgressFile::Key, "egress.shoot--dev--a1.key"),
            (EgressFile::ClientCa, "egress.shoot--dev--a1.ca.crt"),
        ] {
            assert_eq!(file.name(ns), name);
            assert_eq!(EgressFile::of(name), Some(file), "{name}");
        }
        for other in [
            "routes.json",
            "egress..crt",
            "egress.a.pem",
            ".egress.a.crt.tmp-7",
            "egress.A.crt",
            "egress.a.b.key",
            "xegress.a.crt",
        ] {
            assert_eq!(EgressFile::of(other), None, "{other}");
        }
        assert!(EgressFile::Key.is_private());
        assert!(!EgressFile::ClientCa.is_private());
    }

    fn cluster(ns: &str, created: &str, networks: &[&str]) -> Cluster {
        Cluster {
            meta: meta("", ns, Some(created)),
            networks: networks.iter().map(|n| Net::parse(n).unwrap()).collect(),
            host_bits: Vec::new(),
        }
    }

    fn pem(what: &str) -> SecretBytes {
        SecretBytes::from(format!("-----BEGIN {what}-----\n...\n").into_bytes())
    }

    /// A shoot with a peer (key byte `key`), its egress Secrets and one (ready) kube-apiserver
    /// endpoint at `source`.
    fn shoot(s: &mut Snapshot, ns: &str, created: &str, key: u8, source: &str) {
        s.clusters.push(cluster(ns, created, &["10.250.0.0/16"]));
        let secret = |name: &str, content| Secret {
            meta: meta(ns, name, Some(created)),
            content,
        };
        s.secrets.push(secret(
            "trellis-tunnel-peers",
            SecretContent::TunnelPeers(vec![PeerEntry {
                name: "agent-0".into(),
                public_key: Some(WgKey([key; 32]).to_base64()),
                addresses: Some("192.168.128.5".into()),
            }]),
        ));
        s.secrets.push(secret(
            "vpn-seed-server-1",
            SecretContent::EgressCertificate {
                issued_at: None,
                certificate: pem("CERTIFICATE"),
                key: pem("PRIVATE KEY"),
            },
        ));
        s.secrets.push(secret(
            "ca-vpn-bundle-1",
            SecretContent::EgressClientCa {
                issued_at: None,
                bundle: pem("CERTIFICATE"),
            },
        ));
        s.endpoint_slices
            .push(crate::controller::model::EndpointSlice {
                meta: meta(ns, "kube-apiserver", Some(created)),
                service: KUBE_APISERVER.into(),
                address_type: "IPv4".into(),
                ports: vec![("kube-apiserver".into(), Some(443))],
                endpoints: vec![crate::controller::model::Endpoint {
                    address: source.parse().ok(),
                    ..Default::default()
                }],
            });
    }

    fn target() -> Target {
        Target {
            tunnel_local_addresses: vec!["192.168.128.1".parse().unwrap()],
            ..Target::default()
        }
    }

    fn run(s: &Snapshot, target: &Target) -> (Vec<RawRoute>, Files, Report) {
        let clusters: Vec<&Cluster> = s.clusters.iter().collect();
        let mut report = Report::default();
        let (mut routes, files) = routes(s, target, &clusters, &mut report);
        routes.sort_by(|a, b| a.name.cmp(&b.name));
        (routes, files, report)
    }

    /// The table the tunnel routes make loads in the gateway (keys and sources unique, local
    /// addresses outside every peer's networks).
    fn loads(routes: Vec<RawRoute>) {
        let json =
            serde_json::to_string(&crate::config::routes::RawRoutingTable::new(routes)).unwrap();
        crate::config::routes::parse(
            std::path::Path::new("/nonexistent/routes.json"),
            json.as_bytes(),
            &crate::route::BackendRegistry::default(),
        )
        .unwrap_or_else(|e| panic!("{e}\n{json}"));
    }

    #[test]
    fn a_key_or_source_two_shoots_claim_stays_with_the_older() {
        for reversed in [false, true] {
            let mut s = Snapshot::default();
            shoot(
                &mut s,
                "shoot--a--new",
                "2024-02-01T00:00:00Z",
                1,
                "100.96.0.10",
            );
            shoot(
                &mut s,
                "shoot--a--old",
                "2024-01-01T00:00:00Z",
                1,
                "100.96.0.10",
            );
            if reversed {
                s.clusters.reverse();
                s.secrets.reverse();
            }
            let (routes, files, report) = run(&s, &target());
            let names: Vec<&str> = routes.iter().map(|r| r.name.as_str()).collect();
            assert_eq!(
                names,
                ["shoot--a--old.tunnel"],
                "the younger has no peer left"
            );
            assert!(routes[0].egress.is_some());
            assert_eq!(
                report.skipped,
                BTreeMap::from([(Reason::Conflict, 1), (Reason::NoTunnelPeers, 1)])
            );
            assert!(
                files.keys().all(|f| f.contains("shoot--a--old")),
                "{files:?}"
            );
            loads(routes);
        }
        // Another key for the younger: its tunnel, but its egress client stays the older's.
        let mut s = Snapshot::default();
        shoot(
            &mut s,
            "shoot--a--old",
            "2024-01-01T00:00:00Z",
            1,
            "100.96.0.10",
        );
        shoot(
            &mut s,
            "shoot--a--new",
            "2024-02-01T00:00:00Z",
            2,
            "100.96.0.10",
        );
        let (routes, files, report) = run(&s, &target());
        assert_eq!(routes.len(), 2);
        let new = routes
            .iter()
            .find(|r| r.name == "shoot--a--new.tunnel")
            .unwrap();
        assert!(new.tunnel.is_some() && new.egress.is_none());
        // One conflict, the younger shoot's: it has an address, but not one of its own.
        assert_eq!(report.skipped, BTreeMap::from([(Reason::Conflict, 1)]));
        assert_eq!(report.skips[0].object, "Cluster shoot--a--new");
        assert_eq!(
            report.skips[0].detail,
            "every kube-apiserver address is an egress client of an older shoot \
             (100.96.0.10 of shoot--a--old): no egress"
        );
        assert_eq!(files.len(), 3);
        loads(routes.clone());
        // An address of its own besides: its egress, from that one, and the other counted.
        s.endpoint_slices[1]
            .endpoints
            .push(crate::controller::model::Endpoint {
                address: "100.96.0.11".parse().ok(),
                ..Default::default()
            });
        let (routes, files, report) = run(&s, &target());
        let new = routes
            .iter()
            .find(|r| r.name == "shoot--a--new.tunnel")
            .unwrap();
        assert_eq!(
            new.egress.as_ref().unwrap().client_sources,
            ["100.96.0.11/32"]
        );
        assert_eq!(report.skipped, BTreeMap::from([(Reason::Conflict, 1)]));
        assert_eq!(
            report.skips[0].detail,
            "kube-apiserver address 100.96.0.10 is an egress client of the older shoot--a--old"
        );
        assert_eq!(files.len(), 6);
        loads(routes);
    }

    #[test]
    fn the_gateways_tunnel_address_inside_a_shoot_network_leaves_the_shoot_without_tunnel() {
        let mut s = Snapshot::default();
        shoot(
            &mut s,
            "shoot--a--b",
            "2024-01-01T00:00:00Z",
            1,
            "100.96.0.10",
        );
        s.clusters[0]
            .networks
            .push(Net::parse("192.168.0.0/16").unwrap());
        let (routes, files, report) = run(&s, &target());
        assert!(routes.is_empty() && files.is_empty());
        assert_eq!(report.skipped, BTreeMap::from([(Reason::Unsupported, 1)]));
        // Elsewhere, it is served.
        let other = Target {
            tunnel_local_addresses: vec!["10.99.0.1".parse().unwrap()],
            ..Target::default()
        };
        let (routes, _, report) = run(&s, &other);
        assert_eq!(routes.len(), 1, "{report:?}");
        loads(routes);
        // Without local addresses, no tunnel is rendered at all.
        let (routes, _, report) = run(&s, &Target::default());
        assert!(routes.is_empty() && report.skips.is_empty());
    }

    /// Every kube-apiserver address is an egress client: one not ready yet and one
    /// terminating (it keeps serving, and calling out, through its shutdown delay) as much
    /// as a ready one. Without any address there is no egress.
    #[test]
    fn every_kube_apiserver_address_ready_or_not_is_an_egress_client() {
        let mut s = Snapshot::default();
        shoot(
            &mut s,
            "shoot--a--b",
            "2024-01-01T00:00:00Z",
            1,
            "100.96.0.10",
        );
        let endpoint = |ip: &str, ready, terminating| crate::controller::model::Endpoint {
            address: ip.parse().ok(),
            ready,
            terminating,
            zone: None,
        };
        s.endpoint_slices[0].endpoints = vec![
            endpoint("100.96.0.10", Some(true), Some(false)),
            endpoint("100.96.0.11", Some(false), Some(false)),
            endpoint("100.96.0.12", Some(false), Some(true)),
        ];
        let (routes, files, report) = run(&s, &target());
        assert_eq!(
            routes[0].egress.as_ref().unwrap().client_sources,
            ["100.96.0.10/32", "100.96.0.11/32", "100.96.0.12/32"]
        );
        assert_eq!(files.len(), 3);
        assert!(report.skipped.is_empty(), "{report:?}");
        s.endpoint_slices[0].endpoints.clear();
        let (routes, files, report) = run(&s, &target());
        assert!(routes[0].egress.is_none() && files.is_empty());
        assert_eq!(report.skipped, BTreeMap::from([(Reason::NoEndpoints, 1)]));
        assert_eq!(
            report.skips[0].detail,
            "no kube-apiserver endpoint address: no egress"
        );
    }

    #[test]
    fn egress_needs_pem() {
        let mut s = Snapshot::default();
        shoot(
            &mut s,
            "shoot--a--b",
            "2024-01-01T00:00:00Z",
            1,
            "100.96.0.10",
        );
        s.secrets[1].content = SecretContent::EgressCertificate {
            issued_at: None,
            certificate: pem("CERTIFICATE"),
            key: SecretBytes::from(b"not pem".to_vec()),
        };
        let (routes, _, report) = run(&s, &target());
        assert!(routes[0].egress.is_none());
        assert_eq!(report.skipped, BTreeMap::from([(Reason::NoEgressTls, 1)]));
    }

    #[test]
    fn the_newest_secret_of_a_name_is_the_one_in_use() {
        let old = meta("ns", "vpn-seed-server-aaaa", Some("2024-01-01T00:00:00Z"));
        let new = meta("ns", "vpn-seed-server-bbbb", Some("2024-02-01T00:00:00Z"));
        let same_time = meta("ns", "vpn-seed-server-0000", Some("2024-02-01T00:00:00Z"));
        let undated = meta("ns", "vpn-seed-server-zzzz", None);
        for order in [[&old, &new], [&new, &old]] {
            let picked = newest(order.iter().map(|m| (*m, None)));
            assert_eq!(
                picked.map(|m| m.name.as_str()),
                Some("vpn-seed-server-bbbb")
            );
        }
        // Created in the same second: the later issue time, then the name, decides.
        let picked = newest([(&same_time, Some(20)), (&new, Some(10))]);
        assert_eq!(
            picked.map(|m| m.name.as_str()),
            Some("vpn-seed-server-0000")
        );
        let picked = newest([(&same_time, None), (&new, None)]);
        assert_eq!(
            picked.map(|m| m.name.as_str()),
            Some("vpn-seed-server-bbbb")
        );
        // One without a creation time is never taken over one with.
        let picked = newest([(&undated, Some(99)), (&old, None)]);
        assert_eq!(
            picked.map(|m| m.name.as_str()),
            Some("vpn-seed-server-aaaa")
        );
        assert_eq!(newest([]), None);
    }
}
