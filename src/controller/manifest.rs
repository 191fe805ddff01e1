//! Manifests on disk -> [`Snapshot`]: what `trellis controller render --manifests DIR` reads.
//!
//! Every `*.yaml`, `*.yml` and `*.json` file in a directory (not its subdirectories), each
//! YAML file with any number of documents, `kind: List` (as `kubectl get -o yaml` writes)
//! unpacked. Objects of the kinds translation reads are projected; everything else is
//! skipped. A field of an unexpected type reads as absent: these are the API server's
//! objects, not trellis' own files, so nothing here rejects them; a network written with
//! host bits set is read with them cleared, and kept in the projection
//! ([`HostBits`]) for translation to report.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;
use thiserror::Error;

use super::model::{
    BackendRef, Cluster, Destination, DestinationRule, Endpoint, EndpointSlice, EnvoyFilter,
    Gateway, HostBits, Meta, Namespace, Object, PeerEntry, Permission, Principal, Rbac, RbacAt,
    RbacPolicy, Secret, SecretBytes, SecretContent, Server, Service, ServicePort, Snapshot,
    TUNNEL_PEERS_LABEL, TlsRoute, TlsRouteObject, VirtualService,
};
use crate::route::{Net, NetError};

/// Why a manifest directory could not be read.
#[derive(Debug, Error)]
pub enum ManifestError {
    /// The directory or a file in it could not be read.
    #[error("{}: {source}", path.display())]
    Read {
        /// The directory or file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A file is not valid YAML or JSON.
    #[error("{}: {message}", file.display())]
    Parse {
        /// The file.
        file: PathBuf,
        /// The parser's message.
        message: String,
    },
}

/// Reads every manifest file in `dir` (sorted by name) into one snapshot.
pub fn read_dir(dir: &Path) -> Result<Snapshot, ManifestError> {
    let read_err = |path: &Path| {
        let path = path.to_owned();
        move |source| ManifestError::Read { path, source }
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(read_err(dir))? {
        let path = entry.map_err(read_err(dir))?.path();
        let manifest = matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml" | "json")
        );
        if manifest && path.is_file() {
            files.push(path);
        }
    }
    files.sort();
    let mut snapshot = Snapshot::default();
    for file in files {
        let bytes = crate::config::read_file(&file).map_err(|e| ManifestError::Parse {
            file: file.clone(),
            message: e.to_string(),
        })?;
        for doc in documents(&file, &bytes)? {
            add(&mut snapshot, &doc);
        }
    }
    Ok(snapshot)
}

/// YAML documents one manifest file may hold: a seed's objects, one per document, are tens
/// of thousands; a stream of empty documents (`---` lines) stays bounded in memory.
pub const MAX_DOCUMENTS: usize = 1_000_000;

/// The documents of one file: a JSON document, or every document of a YAML stream (at most
/// [`MAX_DOCUMENTS`]).
pub fn documents(file: &Path, bytes: &[u8]) -> Result<Vec<Value>, ManifestError> {
    let parse_err = |message: String| ManifestError::Parse {
        file: file.to_owned(),
        message,
    };
    let text = std::str::from_utf8(bytes).map_err(|_| parse_err("not UTF-8 text".into()))?;
    if text.trim_start().starts_with('{') {
        return serde_json::from_str(text)
            .map(|v| vec![v])
            .map_err(|e| parse_err(e.to_string()));
    }
    let options = crate::config::yaml_options_with(MAX_DOCUMENTS);
    serde_saphyr::from_multiple_with_options::<Value>(text, options).map_err(|e| match e {
        serde_saphyr::Error::Budget {
            breach: serde_saphyr::budget::BudgetBreach::Documents { .. },
            location,
        } => parse_err(format!(
            "more than {MAX_DOCUMENTS} YAML documents (at line {}): split the file",
            location.line()
        )),
        e => parse_err(e.to_string()),
    })
}

/// Adds one document (an object or a `List` of them) to the snapshot.
pub fn add(snapshot: &mut Snapshot, doc: &Value) {
    if let Some(items) = doc.get("items").and_then(Value::as_array)
        && text(doc, "/kind").ends_with("List")
    {
        for item in items {
            add(snapshot, item);
        }
        return;
    }
    if let Some(object) = project(doc) {
        snapshot.push(object);
    }
}

/// The projection of one object (not a `List`), or `None` for a kind or version translation
/// does not read. The watch path projects what the API server sends through this same
/// function, so a live table and `render`'s agree on the same objects.
pub fn project(doc: &Value) -> Option<Object> {
    let api_version = text(doc, "/apiVersion");
    let kind = text(doc, "/kind");
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    Some(match (group, kind) {
        ("networking.istio.io", "Gateway") if istio_version(version) => {
            Object::Gateway(gateway(doc))
        }
        ("networking.istio.io", "VirtualService") if istio_version(version) => {
            Object::VirtualService(virtual_service(doc))
        }
        ("networking.istio.io", "DestinationRule") if istio_version(version) => {
            Object::DestinationRule(destination_rule(doc))
        }
        ("networking.istio.io", "EnvoyFilter") if istio_version(version) => {
            Object::EnvoyFilter(envoy_filter(doc))
        }
        ("", "Service") if version == "v1" => Object::Service(service(doc)),
        ("", "Namespace") if version == "v1" => Object::Namespace(Namespace {
            meta: meta(doc),
            deleting: doc
                .pointer("/metadata/deletionTimestamp")
                .is_some_and(|v| !v.is_null()),
        }),
        ("discovery.k8s.io", "EndpointSlice") if version == "v1" => {
            Object::EndpointSlice(endpoint_slice(doc))
        }
        ("gateway.networking.k8s.io", "TLSRoute")
            if matches!(version, "v1" | "v1alpha2" | "v1alpha3") =>
        {
            Object::TlsRoute(tls_route(doc))
        }
        ("extensions.gardener.cloud", "Cluster") if version == "v1alpha1" => {
            Object::Cluster(cluster(doc))
        }
        ("", "Secret") if version == "v1" => Object::Secret(secret(doc)?),
        _ => return None,
    })
}

fn istio_version(version: &str) -> bool {
    matches!(version, "v1" | "v1beta1" | "v1alpha3")
}

fn text<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

fn array<'a>(v: &'a Value, pointer: &str) -> &'a [Value] {
    v.pointer(pointer)
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

fn strings(v: &Value, pointer: &str) -> Vec<String> {
    array(v, pointer)
        .iter()
        .filter_map(|s| s.as_str().map(str::to_owned))
        .collect()
}

fn number(v: &Value, pointer: &str) -> Option<u64> {
    v.pointer(pointer).and_then(Value::as_u64)
}

fn labels(v: &Value, pointer: &str) -> BTreeMap<String, String> {
    v.pointer(pointer)
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                .collect()
        })
        .unwrap_or_default()
}

fn meta(doc: &Value) -> Meta {
    Meta {
        name: text(doc, "/metadata/name").to_owned(),
        namespace: text(doc, "/metadata/namespace").to_owned(),
        uid: text(doc, "/metadata/uid").to_owned(),
        created: doc
            .pointer("/metadata/creationTimestamp")
            .and_then(Value::as_str)
            .map(str::to_owned),
    }
}

fn gateway(doc: &Value) -> Gateway {
    Gateway {
        meta: meta(doc),
        selector: labels(doc, "/spec/selector"),
        servers: array(doc, "/spec/servers")
            .iter()
            .map(|s| Server {
                port: number(s, "/port/number")
                    .and_then(|n| u32::try_from(n).ok())
                    .unwrap_or(0),
                protocol: text(s, "/port/protocol").to_ascii_uppercase(),
                tls_mode: s
                    .pointer("/tls/mode")
                    .and_then(Value::as_str)
                    .map(str::to_ascii_uppercase),
                // Istio allows `namespace/host` (which VirtualServices may bind to it).
                hosts: array(s, "/hosts")
                    .iter()
                    .filter_map(Value::as_str)
                    .map(|h| {
                        let h = h.rsplit_once('/').map_or(h, |(_, h)| h);
                        h.trim_end_matches('.').to_ascii_lowercase()
                    })
                    .collect(),
            })
            .collect(),
    }
}

fn destination(route: &Value) -> Option<Destination> {
    let host = route.pointer("/destination/host")?.as_str()?.to_owned();
    let port = number(route, "/destination/port/number").and_then(|n| u32::try_from(n).ok());
    Some(Destination { host, port })
}

fn virtual_service(doc: &Value) -> VirtualService {
    VirtualService {
        meta: meta(doc),
        gateways: strings(doc, "/spec/gateways"),
        tls: array(doc, "/spec/tls")
            .iter()
            .map(|t| TlsRoute {
                sni_hosts: array(t, "/match")
                    .iter()
                    .flat_map(|m| strings(m, "/sniHosts"))
                    .collect(),
                destinations: array(t, "/route").iter().filter_map(destination).collect(),
            })
            .collect(),
        http_destinations: array(doc, "/spec/http")
            .iter()
            .flat_map(|h| array(h, "/route").iter().filter_map(destination))
            .collect(),
    }
}

fn destination_rule(doc: &Value) -> DestinationRule {
    DestinationRule {
        meta: meta(doc),
        host: text(doc, "/spec/host").to_owned(),
        max_connection_duration: doc
            .pointer("/spec/trafficPolicy/connectionPool/tcp/maxConnectionDuration")
            .and_then(Value::as_str)
            .and_then(|d| crate::config::parse_duration(d).ok())
            .filter(|d| !d.is_zero()),
    }
}

/// A field under its proto name or its JSON (camelCase) name: Istio accepts both.
fn field<'a>(v: &'a Value, snake: &str) -> Option<&'a Value> {
    v.get(snake).or_else(|| {
        let mut camel = String::with_capacity(snake.len());
        let mut upper = false;
        for c in snake.chars() {
            if c == '_' {
                upper = true;
            } else if upper {
                camel.push(c.to_ascii_uppercase());
                upper = false;
            } else {
                camel.push(c);
            }
        }
        v.get(camel)
    })
}

fn envoy_filter(doc: &Value) -> EnvoyFilter {
    let mut host_bits = Vec::new();
    let rbac = array(doc, "/spec/configPatches")
        .iter()
        .enumerate()
        .filter_map(|(i, patch)| {
            let at = format!("spec.configPatches[{i}].patch.value.typed_config.rules.policies");
            rbac(patch, &at, &mut host_bits)
        })
        .collect();
    EnvoyFilter {
        meta: meta(doc),
        workload_selector: doc
            .pointer("/spec/workloadSelector")
            .map(|w| labels(w, "/labels")),
        rbac,
        host_bits,
    }
}

/// The network `text` (`IP/prefix` or a bare IP) with any host bits cleared, which are
/// recorded in `host_bits` at `field`; `None` when it is no network.
fn network(
    text: &str,
    field: impl FnOnce() -> String,
    host_bits: &mut Vec<HostBits>,
) -> Option<Net> {
    cleared(Net::parse(text), field, host_bits)
}

/// The network of `result`, one with host bits set cleared and recorded in `host_bits` at
/// `field`.
fn cleared(
    result: Result<Net, NetError>,
    field: impl FnOnce() -> String,
    host_bits: &mut Vec<HostBits>,
) -> Option<Net> {
    match result {
        Ok(net) => Some(net),
        Err(NetError::HostBits { given, network, .. }) => {
            host_bits.push(HostBits {
                field: field(),
                given,
                used: network,
            });
            Some(network)
        }
        Err(_) => None,
    }
}

/// The RBAC filter a patch inserts, if it inserts one that enforces rules; its principals'
/// networks with host bits set recorded in `host_bits` (`policies_at`: the path of its
/// policies).
fn rbac(patch: &Value, policies_at: &str, host_bits: &mut Vec<HostBits>) -> Option<Rbac> {
    let value = patch.pointer("/patch/value")?;
    let config = field(value, "typed_config")?;
    let kind = config.get("@type")?.as_str()?;
    if !matches!(
        kind,
        "type.googleapis.com/envoy.extensions.filters.network.rbac.v3.RBAC"
            | "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC"
    ) {
        return None;
    }
    // Without `rules` the filter enforces nothing (`shadow_rules` only log).
    let rules = field(config, "rules")?;
    let listener = patch.pointer("/match/listener");
    let sni = listener
        .and_then(|l| field(l, "filter_chain"))
        .and_then(|c| c.get("sni"))
        .and_then(Value::as_str);
    let name = listener.and_then(|l| l.get("name")).and_then(Value::as_str);
    let applies_to = text(patch, "/applyTo");
    let at = match (applies_to, sni, name) {
        ("NETWORK_FILTER", Some(sni), _) => RbacAt::Sni(sni.to_owned()),
        ("HTTP_FILTER", None, Some(name)) => RbacAt::Listener(name.to_owned()),
        _ => RbacAt::Other,
    };
    let mut policies: Vec<RbacPolicy> = rules
        .get("policies")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(name, p)| RbacPolicy {
                    name: name.clone(),
                    permissions: array(p, "/permissions").iter().map(permission).collect(),
                    principals: array(p, "/principals")
                        .iter()
                        .enumerate()
                        .map(|(j, principal_value)| {
                            let field = format!("{policies_at}.{name}.principals[{j}]");
                            principal(principal_value, &field, host_bits)
                        })
                        .collect(),
                })
                .collect()
        })
        .unwrap_or_default();
    policies.sort_by(|a, b| a.name.cmp(&b.name));
    Some(Rbac {
        at,
        action: rules
            .get("action")
            .and_then(Value::as_str)
            .unwrap_or("ALLOW")
            .to_ascii_uppercase(),
        policies,
    })
}

fn permission(p: &Value) -> Permission {
    let (inner, negated) = match field(p, "not_rule") {
        Some(inner) => (inner, true),
        None => (p, false),
    };
    if !negated && p.get("any").and_then(Value::as_bool) == Some(true) {
        return Permission::Any;
    }
    let header = inner.get("header");
    let contains = header
        .and_then(|h| field(h, "string_match"))
        .and_then(|m| m.get("contains"))
        .and_then(Value::as_str);
    match (
        header.and_then(|h| h.get("name")).and_then(Value::as_str),
        contains,
    ) {
        // Any other field of the matcher (`ignore_case`, `invert_match`, …) makes it another
        // matcher than "contains".
        (Some(name), Some(value))
            if header.and_then(Value::as_object).map(|o| o.len()) == Some(2)
                && header
                    .and_then(|h| field(h, "string_match"))
                    .and_then(Value::as_object)
                    .map(|o| o.len())
                    == Some(1) =>
        {
            Permission::HeaderContains {
                header: name.to_ascii_lowercase(),
                value: value.to_owned(),
                negated,
            }
        }
        _ => Permission::Other,
    }
}

/// One principal (`field`: its path, for `host_bits`).
fn principal(p: &Value, field_path: &str, host_bits: &mut Vec<HostBits>) -> Principal {
    let Some(obj) = p.as_object().filter(|o| o.len() == 1) else {
        return Principal::Other;
    };
    let (key, v) = obj.iter().next().map_or(("", p), |(k, v)| (k.as_str(), v));
    // Envoy clears host bits of a CidrRange: so does the projection, and says so.
    let mut cidr = |v: &Value| -> Option<Net> {
        let addr = field(v, "address_prefix")?.as_str()?.parse().ok()?;
        // `prefix_len` is a UInt32Value: absent means 0.
        let prefix = match field(v, "prefix_len") {
            None => 0,
            Some(n) => u8::try_from(n.as_u64()?).ok()?,
        };
        cleared(
            Net::new(addr, prefix),
            || format!("{field_path}.{key}"),
            host_bits,
        )
    };
    match key {
        "remote_ip" | "remoteIp" | "source_ip" | "sourceIp" => {
            cidr(v).map_or(Principal::Other, Principal::Client)
        }
        "direct_remote_ip" | "directRemoteIp" => cidr(v).map_or(Principal::Other, Principal::Peer),
        _ => Principal::Other,
    }
}

fn service(doc: &Value) -> Service {
    let mut cluster_ips = strings(doc, "/spec/clusterIPs");
    if cluster_ips.is_empty() {
        cluster_ips = doc
            .pointer("/spec/clusterIP")
            .and_then(Value::as_str)
            .map(|ip| vec![ip.to_owned()])
            .unwrap_or_default();
    }
    cluster_ips.retain(|ip| ip != "None" && !ip.is_empty());
    Service {
        meta: meta(doc),
        cluster_ips,
        ports: array(doc, "/spec/ports")
            .iter()
            .filter_map(|p| {
                Some(ServicePort {
                    name: text(p, "/name").to_owned(),
                    port: u16::try_from(number(p, "/port")?).ok()?,
                })
            })
            .collect(),
    }
}

fn endpoint_slice(doc: &Value) -> EndpointSlice {
    EndpointSlice {
        meta: meta(doc),
        service: text(doc, "/metadata/labels/kubernetes.io~1service-name").to_owned(),
        address_type: text(doc, "/addressType").to_owned(),
        ports: array(doc, "/ports")
            .iter()
            .map(|p| {
                (
                    text(p, "/name").to_owned(),
                    number(p, "/port").and_then(|n| u16::try_from(n).ok()),
                )
            })
            .collect(),
        endpoints: array(doc, "/endpoints")
            .iter()
            .map(|e| Endpoint {
                address: e
                    .pointer("/addresses/0")
                    .and_then(Value::as_str)
                    .and_then(|a| a.parse().ok()),
                ready: e.pointer("/conditions/ready").and_then(Value::as_bool),
                terminating: e
                    .pointer("/conditions/terminating")
                    .and_then(Value::as_bool),
                zone: e
                    .pointer("/zone")
                    .and_then(Value::as_str)
                    .map(str::to_owned),
            })
            .collect(),
    }
}

fn tls_route(doc: &Value) -> TlsRouteObject {
    let meta = meta(doc);
    let parents = array(doc, "/spec/parentRefs")
        .iter()
        .filter(|p| {
            matches!(text(p, "/group"), "" | "gateway.networking.k8s.io")
                && matches!(text(p, "/kind"), "" | "Gateway")
        })
        .map(|p| {
            let ns = match text(p, "/namespace") {
                "" => meta.namespace.clone(),
                ns => ns.to_owned(),
            };
            (ns, text(p, "/name").to_owned())
        })
        .collect();
    let backends = array(doc, "/spec/rules")
        .iter()
        .flat_map(|r| array(r, "/backendRefs"))
        .map(|b| {
            let group = text(b, "/group");
            let kind = text(b, "/kind");
            BackendRef {
                other_kind: if group.is_empty() && matches!(kind, "" | "Service") {
                    String::new()
                } else {
                    format!("{group}/{kind}")
                },
                name: text(b, "/name").to_owned(),
                namespace: match text(b, "/namespace") {
                    "" => meta.namespace.clone(),
                    ns => ns.to_owned(),
                },
                port: number(b, "/port").and_then(|n| u32::try_from(n).ok()),
            }
        })
        .collect();
    TlsRouteObject {
        hostnames: strings(doc, "/spec/hostnames"),
        parents,
        backends,
        meta,
    }
}

/// The Shoot's networks a Cluster embeds: `spec.networking` (one per kind) and
/// `status.networking` (lists, every family), as Gardener itself unites them.
fn cluster(doc: &Value) -> Cluster {
    let shoot = doc.pointer("/spec/shoot").unwrap_or(&Value::Null);
    let mut networks = std::collections::BTreeSet::new();
    let mut host_bits = Vec::new();
    for kind in ["nodes", "pods", "services"] {
        if let Some(text) = shoot
            .pointer(&format!("/spec/networking/{kind}"))
            .and_then(Value::as_str)
        {
            let field = || format!("spec.shoot.spec.networking.{kind}");
            networks.extend(network(text, field, &mut host_bits));
        }
        // Indexed as the object lists them (an entry that is not text too).
        for (i, text) in array(shoot, &format!("/status/networking/{kind}"))
            .iter()
            .enumerate()
            .filter_map(|(i, v)| Some((i, v.as_str()?)))
        {
            let field = || format!("spec.shoot.status.networking.{kind}[{i}]");
            networks.extend(network(text, field, &mut host_bits));
        }
    }
    Cluster {
        meta: meta(doc),
        networks: networks.into_iter().collect(),
        host_bits,
    }
}

/// The projection of a Secret of a kind translation reads, by its labels; `None` for any
/// other Secret. Values come from `data` (base64) and, as the API server merges them on a
/// write, `stringData`; a value that is not valid base64 is absent.
fn secret(doc: &Value) -> Option<Secret> {
    let labels = labels(doc, "/metadata/labels");
    let label = |k: &str| labels.get(k).map(String::as_str);
    let mut data: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    if let Some(map) = doc.get("data").and_then(Value::as_object) {
        use base64::Engine;
        for (k, v) in map {
            let decoded = v
                .as_str()
                .and_then(|v| base64::engine::general_purpose::STANDARD.decode(v).ok());
            if let Some(bytes) = decoded {
                data.insert(k.clone(), bytes);
            }
        }
    }
    if let Some(map) = doc.get("stringData").and_then(Value::as_object) {
        for (k, v) in map {
            if let Some(text) = v.as_str() {
                data.insert(k.clone(), text.as_bytes().to_vec());
            }
        }
    }
    let issued_at = label("issued-at-time").and_then(|t| t.parse().ok());
    let mut bytes = |k: &str| SecretBytes::from(data.remove(k).unwrap_or_default());
    let gardenlet = label("managed-by") == Some("secrets-manager")
        && label("manager-identity") == Some("gardenlet");
    let content = if label(TUNNEL_PEERS_LABEL.0) == Some(TUNNEL_PEERS_LABEL.1) {
        SecretContent::TunnelPeers(peers(&data))
    } else if gardenlet && label("name") == Some("vpn-seed-server") {
        SecretContent::EgressCertificate {
            issued_at,
            certificate: bytes("tls.crt"),
            key: bytes("tls.key"),
        }
    } else if gardenlet && label("name") == Some("ca-vpn-bundle") {
        SecretContent::EgressClientCa {
            issued_at,
            bundle: bytes("bundle.crt"),
        }
    } else {
        return None;
    };
    Some(Secret {
        meta: meta(doc),
        content,
    })
}

/// The peers of a tunnel peers Secret's data (`<peer>.publicKey`, `<peer>.addresses`), by
/// name; other keys are ignored.
fn peers(data: &BTreeMap<String, Vec<u8>>) -> Vec<PeerEntry> {
    let mut peers: BTreeMap<&str, PeerEntry> = BTreeMap::new();
    for (key, value) in data {
        let (name, field) = match key.rsplit_once('.') {
            Some((name, field @ ("publicKey" | "addresses"))) if !name.is_empty() => (name, field),
            _ => continue,
        };
        let entry = peers.entry(name).or_insert_with(|| PeerEntry {
            name: name.to_owned(),
            ..PeerEntry::default()
        });
        let text = String::from_utf8(value.clone()).ok();
        match field {
            "publicKey" => entry.public_key = text,
            _ => entry.addresses = text,
        }
    }
    peers.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A manifest holds a document per object: thousands render (the YAML parser's own
    /// default stopped at 1,024), and past [`MAX_DOCUMENTS`] the error says so in words.
    #[test]
    fn a_manifest_takes_thousands_of_documents_and_says_its_limit_in_words() {
        let file = Path::new("seed.yaml");
        let many = "kind: Namespace\nmetadata: {name: x}\n---\n".repeat(5_000);
        assert_eq!(documents(file, many.as_bytes()).unwrap().len(), 5_000);
        let storm = "---\n".repeat(MAX_DOCUMENTS + 2);
        let err = documents(file, storm.as_bytes()).unwrap_err().to_string();
        assert!(
            err.contains("more than 1000000 YAML documents (at line")
                && err.contains("split the file"),
            "{err}"
        );
    }

    #[test]
    fn lists_and_document_streams_are_unpacked() {
        let yaml = "apiVersion: v1
kind: List
items:
- {apiVersion: v1, kind: Namespace, metadata: {name: a, deletionTimestamp: '2024-01-01T00:00:00Z'}}
- {apiVersion: v1, kind: ConfigMap, metadata: {name: ignored}}
---
---
apiVersion: v1
kind: Namespace
metadata: {name: b}
";
        let mut s = Snapshot::default();
        for doc in documents(Path::new("x.yaml"), yaml.as_bytes()).unwrap() {
            add(&mut s, &doc);
        }
        let names: Vec<_> = s
            .namespaces
            .iter()
            .map(|n| (n.meta.name.as_str(), n.deleting))
            .collect();
        assert_eq!(names, [("a", true), ("b", false)]);
        assert_eq!(s.counts().iter().map(|c| c.1).sum::<usize>(), 2);
    }

    #[test]
    fn an_endpoint_keeps_its_first_address_when_it_is_an_ip_address() {
        let endpoints = serde_json::json!([
            {"addresses": ["100.64.0.1", "100.64.0.2"]},
            {"addresses": ["fd00::1"]},
            {"addresses": ["api.example.com", "100.64.0.3"]},
            {"addresses": []},
        ]);
        let doc = serde_json::json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "x"}, "endpoints": endpoints});
        let Some(Object::EndpointSlice(slice)) = project(&doc) else {
            panic!("{doc}")
        };
        let addresses: Vec<_> = slice.endpoints.iter().map(|e| e.address).collect();
        let ip = |a: &str| a.parse().ok();
        assert_eq!(addresses, [ip("100.64.0.1"), ip("fd00::1"), None, None]);
    }

    #[test]
    fn unknown_versions_are_not_read() {
        let mut s = Snapshot::default();
        for v in ["networking.istio.io/v2", "discovery.k8s.io/v1beta1"] {
            for kind in ["Gateway", "EndpointSlice"] {
                add(
                    &mut s,
                    &serde_json::json!({"apiVersion": v, "kind": kind, "metadata": {"name": "x"}}),
                );
            }
        }
        assert_eq!(s, Snapshot::default());
    }

    #[test]
    fn envoy_filters_keep_their_rbac_keys_and_networks() {
        let yaml = "apiVersion: networking.istio.io/v1alpha3
kind: EnvoyFilter
metadata: {name: acl-vpn-shoot--a--b, namespace: istio-ingress}
spec:
  workloadSelector: {labels: {istio: ingressgateway}}
  configPatches:
  - applyTo: HTTP_FILTER
    match: {context: GATEWAY, listener: {name: 0.0.0.0_8132}}
    patch:
      operation: INSERT_FIRST
      value:
        name: acl-tls-tunnel
        typedConfig:
          '@type': type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC
          rules:
            policies:
              b:
                permissions:
                - header: {name: Reversed-VPN, stringMatch: {contains: .shoot--a--b.}}
                - header: {name: reversed-vpn, string_match: {contains: x, ignore_case: true}}
                - any: true
                principals:
                - remoteIp: {addressPrefix: 10.1.2.3, prefixLen: 16}
                - source_ip: {address_prefix: '::ffff:192.0.2.0', prefix_len: 120}
                - direct_remote_ip: {address_prefix: 0.0.0.0}
                - remote_ip: {address_prefix: 10.0.0.0, prefix_len: 33}
                - and_ids: {ids: []}
              a-inverse:
                permissions:
                - not_rule: {header: {name: reversed-vpn, string_match: {contains: .shoot--a--b.}}}
  - applyTo: NETWORK_FILTER
    match: {listener: {filterChain: {sni: api.b.example.com}}}
    patch:
      value:
        typed_config:
          '@type': type.googleapis.com/envoy.extensions.filters.network.rbac.v3.RBAC
          rules: {action: deny}
  - applyTo: NETWORK_FILTER
    patch: {value: {typed_config: {'@type': type.googleapis.com/envoy.extensions.filters.network.rbac.v3.RBAC, shadow_rules: {}}}}
  - applyTo: NETWORK_FILTER
    patch: {value: {typed_config: {'@type': type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy}}}
";
        let mut s = Snapshot::default();
        for doc in documents(Path::new("x.yaml"), yaml.as_bytes()).unwrap() {
            add(&mut s, &doc);
        }
        let [f] = s.envoy_filters.as_slice() else {
            panic!("{s:?}")
        };
        // Envoy clears a CidrRange's host bits: so does the projection, and keeps a note.
        assert_eq!(
            f.host_bits,
            [HostBits {
                field: "spec.configPatches[0].patch.value.typed_config.rules.policies.b.principals[0].remoteIp".into(),
                given: "10.1.2.3/16".into(),
                used: Net::parse("10.1.0.0/16").unwrap(),
            }]
        );
        let selector = f.workload_selector.as_ref().unwrap();
        assert_eq!(
            selector.get("istio").map(String::as_str),
            Some("ingressgateway")
        );
        let net = |a: &str, p| Net::new(a.parse().unwrap(), p).unwrap();
        let header = |value: &str, negated| Permission::HeaderContains {
            header: "reversed-vpn".into(),
            value: value.into(),
            negated,
        };
        assert_eq!(
            f.rbac,
            [
                Rbac {
                    at: RbacAt::Listener("0.0.0.0_8132".into()),
                    // Envoy's default.
                    action: "ALLOW".into(),
                    // Ordered by name.
                    policies: vec![
                        RbacPolicy {
                            name: "a-inverse".into(),
                            permissions: vec![header(".shoot--a--b.", true)],
                            principals: vec![],
                        },
                        RbacPolicy {
                            name: "b".into(),
                            permissions: vec![
                                header(".shoot--a--b.", false),
                                Permission::Other,
                                Permission::Any
                            ],
                            principals: vec![
                                Principal::Client(net("10.1.0.0", 16)),
                                Principal::Client(net("192.0.2.0", 24)),
                                Principal::Peer(net("0.0.0.0", 0)),
                                Principal::Other,
                                Principal::Other,
                            ],
                        },
                    ],
                },
                Rbac {
                    at: RbacAt::Sni("api.b.example.com".into()),
                    action: "DENY".into(),
                    policies: vec![],
                },
            ]
        );
    }

    /// A Cluster's network with host bits set is the network, not a reason to drop it (the
    /// shoot would lose a network), and is kept with its field for the report; one that is
    /// no network at all is left out, as before.
    #[test]
    fn a_cluster_network_with_host_bits_is_cleared_and_recorded() {
        let yaml = "apiVersion: extensions.gardener.cloud/v1alpha1
kind: Cluster
metadata: {name: shoot--a--b}
spec:
  shoot:
    spec:
      networking: {nodes: 10.250.0.1/16, pods: 100.96.0.0/11, services: nope}
    status:
      networking:
        nodes: [10.250.0.0/16, 7, '2001:db8:180::1/64']
        pods: ['::ffff:100.96.0.5/11']
";
        let mut s = Snapshot::default();
        for doc in documents(Path::new("x.yaml"), yaml.as_bytes()).unwrap() {
            add(&mut s, &doc);
        }
        let [c] = s.clusters.as_slice() else {
            panic!("{s:?}")
        };
        let nets: Vec<String> = c.networks.iter().map(Net::to_string).collect();
        assert_eq!(
            nets,
            ["10.250.0.0/16", "100.96.0.0/11", "2001:db8:180::/64"]
        );
        let host_bits: Vec<(&str, &str, String)> = c
            .host_bits
            .iter()
            .map(|h| (h.field.as_str(), h.given.as_str(), h.used.to_string()))
            .collect();
        assert_eq!(
            host_bits,
            [
                (
                    "spec.shoot.spec.networking.nodes",
                    "10.250.0.1/16",
                    "10.250.0.0/16".to_owned()
                ),
                (
                    "spec.shoot.status.networking.nodes[2]",
                    "2001:db8:180::1/64",
                    "2001:db8:180::/64".to_owned()
                ),
                (
                    "spec.shoot.status.networking.pods[0]",
                    "::ffff:100.96.0.5/11",
                    "100.96.0.0/11".to_owned()
                ),
            ]
        );
    }

    #[test]
    fn a_bad_file_is_named() {
        let err = documents(Path::new("bad.yaml"), b"a: [").unwrap_err();
        assert!(err.to_string().starts_with("bad.yaml: "), "{err}");
    }
}
