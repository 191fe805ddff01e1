//! `trellis node`: the shoot node daemon that is `kubernetes.default` on every node.
//!
//! Listens on the kube-apiserver advertise address and forwards every connection to the
//! seed gateway: either as an HTTP CONNECT tunnel with the destination header (current
//! Gardener) or behind a PROXY v2 header whose destination is the address the client dialled
//! (GEP-08). The client's TLS passes through untouched. With `interface` configured it also
//! keeps the advertise address on its link ([`link`]). Readiness reflects local state only:
//! listeners bound and address in place, never the gateway's health.

pub(crate) mod link;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use thiserror::Error;
use tokio::net::{TcpListener, TcpStream};

use crate::admin::{AdminState, Metrics};
use crate::config::node::{NodeConfig, UpstreamProtocol};
use crate::net::dial::{Dest, Direct, Hello, Tunneled};
use crate::net::fds;
use crate::net::relay::Limits;
use crate::net::resolve::Resolver;
use crate::net::socket::{self, ListenOptions, normalize};
use crate::route::{BackendAddress, Route};
use crate::serve::accept::{Accepted, Admission, accept_loop};
use crate::serve::drain::{Drain, DrainTimes};
use crate::serve::forward::{Linked, Reply, Routed, link};
use crate::serve::process::{self, Context, Role, Spec, StartError};

/// Listener name in metrics and logs.
pub const LISTENER: &str = "apiserver-proxy";
/// Route name in metrics and logs (the node has one upstream).
pub const ROUTE: &str = "upstream";

/// Why the node could not start.
#[derive(Debug, Error)]
pub enum NodeError {
    /// A failure every role shares: the listener or the admin endpoint cannot be bound (the
    /// node's listeners do not use `SO_REUSEPORT`, so the kernel refuses a second listener
    /// itself), signal handling.
    #[error(transparent)]
    Start(#[from] StartError),
    /// Netlink could not be opened or the address could not be managed.
    #[error("link management: {0}")]
    Link(String),
    /// The resolver (for a gateway named by DNS) could not be set up.
    #[error("resolver: {0}")]
    Resolver(String),
}

/// Local readiness: listeners bound, address in place (when managed), not draining.
#[derive(Default)]
struct Readiness {
    bound: AtomicBool,
    address: AtomicBool,
    draining: AtomicBool,
    /// What was last published, to log changes only.
    published: AtomicBool,
}

impl Readiness {
    /// Sets `/ready` from the local state and logs when it changes.
    fn publish(&self, admin: &AdminState) {
        let (bound, address, draining) = (
            self.bound.load(Ordering::SeqCst),
            self.address.load(Ordering::SeqCst),
            self.draining.load(Ordering::SeqCst),
        );
        let ready = bound && address && !draining;
        admin.set_ready(ready);
        if self.published.swap(ready, Ordering::SeqCst) != ready {
            if ready {
                tracing::info!("node ready");
            } else if !draining {
                tracing::warn!(
                    listeners_bound = bound,
                    address_in_place = address,
                    "node not ready"
                );
            }
        }
    }
}

/// Removes the managed address (`trellis node --cleanup`).
pub async fn cleanup(config: &NodeConfig) -> Result<(), NodeError> {
    let Some(iface) = &config.interface else {
        tracing::info!("no interface configured; nothing to clean up");
        return Ok(());
    };
    let address = iface_address(iface)?;
    let handle = link::connect().map_err(|e| NodeError::Link(e.to_string()))?;
    let manager = link::LinkManager::new(handle, &iface.name, address);
    let n = manager
        .remove()
        .await
        .map_err(|e| NodeError::Link(e.to_string()))?;
    tracing::info!(%address, removed = n, "address removed");
    Ok(())
}

/// The managed address: the file's or `--advertise-address`'s (`NodeConfig::with_advertise_address`).
fn iface_address(iface: &crate::config::node::Interface) -> Result<std::net::IpAddr, NodeError> {
    iface
        .address
        .ok_or_else(|| NodeError::Link("interface.address: none (give --advertise-address)".into()))
}

/// Runs the node daemon until SIGTERM/SIGINT and a completed drain.
pub async fn run(config: NodeConfig) -> Result<(), NodeError> {
    let config = Arc::new(config);
    let metrics = Arc::new(Metrics::node());
    // The process's one resolver (the gateway's name, cached for its TTL), read before
    // anything is bound or said to have started.
    let resolver = Resolver::start(
        &crate::net::resolve::ResolverSettings::default(),
        fds::lookup_budget(),
    )
    .map_err(|e| NodeError::Resolver(e.to_string()))?;
    // No drain delay: the node's clients are local and its address is not behind a load
    // balancer that needs time to notice.
    let drain = DrainTimes {
        delay: Duration::ZERO,
        timeout: config.timeouts.drain,
    };
    let spec = Spec::new(metrics.clone(), config.admin.address.0, drain);
    process::run(spec, move || Starting::bind(config, metrics, resolver)).await
}

/// The node with its listeners bound and netlink open, before the admin endpoint is.
struct Starting {
    config: Arc<NodeConfig>,
    metrics: Arc<Metrics>,
    resolver: Resolver,
    /// The managed address's link and its change events, when `interface` is configured.
    link: Option<(link::LinkManager, tokio::sync::mpsc::Receiver<()>)>,
    /// One listener per `listen` address.
    listeners: Vec<(SocketAddr, std::net::TcpListener)>,
}

impl Starting {
    /// Opens netlink (with `interface`) and binds every listener: a start that cannot have
    /// them fails before the admin endpoint answers or anything is said to have started.
    fn bind(
        config: Arc<NodeConfig>,
        metrics: Arc<Metrics>,
        resolver: Resolver,
    ) -> Result<Self, NodeError> {
        let link = match &config.interface {
            None => None,
            Some(iface) => {
                let address = iface_address(iface)?;
                let handle = link::connect().map_err(|e| NodeError::Link(e.to_string()))?;
                let events = link::subscribe().map_err(|e| NodeError::Link(e.to_string()))?;
                Some((link::LinkManager::new(handle, &iface.name, address), events))
            }
        };
        let keepalive = (
            config.keepalive.downstream.idle,
            config.keepalive.downstream.interval,
        );
        let options = ListenOptions {
            backlog: socket::LISTEN_BACKLOG,
            reuse_port: false,
            // The advertise address may appear on its link only after the bind.
            freebind: true,
            // Inherited by every accepted socket.
            keepalive: Some(keepalive),
        };
        let mut listeners = Vec::new();
        for &addr in &config.listen {
            let l = socket::bind_listener(addr, &options)
                .map_err(|source| StartError::bind("listener", addr, source))?;
            listeners.push((addr, l));
        }
        Ok(Starting {
            config,
            metrics,
            resolver,
            link,
            listeners,
        })
    }
}

impl Role for Starting {
    type Error = NodeError;
    type Serving = Serving;

    async fn serve(self, cx: &Context) -> Result<Serving, NodeError> {
        let Starting {
            config,
            metrics,
            resolver,
            link,
            listeners,
        } = self;
        let readiness = Arc::new(Readiness::default());
        let admin_state = cx.admin.clone();
        let mut bound = Vec::new();
        for (addr, l) in listeners {
            let l = TcpListener::from_std(l)
                .map_err(|source| StartError::bind("listener", addr, source))?;
            bound.push(l);
        }
        let node = Arc::new(Node::new(
            config.clone(),
            Arc::new(resolver),
            cx.drain.clone(),
        ));
        let memory_task = tokio::spawn(crate::serve::memory::return_after_floods(
            node.drain.tracker.clone(),
        ));
        let listener_metrics = Arc::new(metrics.listener(LISTENER));
        let mut accept_tasks = Vec::new();
        let mut addresses = Vec::new();
        for l in bound {
            addresses.push(
                l.local_addr()
                    .map_or_else(|e| e.to_string(), |a| a.to_string()),
            );
            let admission = Admission {
                metrics: metrics.clone(),
                listener: listener_metrics.clone(),
                tracker: node.drain.tracker.clone(),
                max_connections: config.limits.max_connections,
            };
            let stop = node.drain.listeners_stop();
            let node = node.clone();
            let handle = move |accepted| node.clone().handle(accepted);
            accept_tasks.push(tokio::spawn(accept_loop(l, admission, stop, handle)));
        }
        // Link management: ready once the address is in place too.
        let link_task = match (link, &config.interface) {
            (Some((manager, events)), Some(iface)) => Some(tokio::spawn(manage_link(
                manager,
                iface.check_interval,
                events,
                readiness.clone(),
                admin_state.clone(),
            ))),
            _ => {
                readiness.address.store(true, Ordering::SeqCst);
                None
            }
        };
        // Nothing can fail the start any more: what started is said now.
        for address in addresses {
            tracing::info!(address, "listening");
        }
        tracing::info!(upstream = %format!("{}:{}", config.upstream.address.host, config.upstream.address.port), "node serving");
        readiness.bound.store(true, Ordering::SeqCst);
        readiness.publish(&admin_state);
        Ok(Serving {
            readiness,
            admin: admin_state,
            accept_tasks,
            link_task,
            memory_task,
        })
    }
}

/// The serving node: its accept loops and the tasks beside them.
struct Serving {
    readiness: Arc<Readiness>,
    admin: Arc<AdminState>,
    accept_tasks: Vec<tokio::task::JoinHandle<()>>,
    link_task: Option<tokio::task::JoinHandle<()>>,
    memory_task: tokio::task::JoinHandle<()>,
}

impl process::Serving for Serving {
    fn draining(&mut self) {
        // The link task publishes readiness too: it must not turn it on again.
        self.readiness.draining.store(true, Ordering::SeqCst);
        self.readiness.publish(&self.admin);
    }

    async fn stop(self) {
        for t in self.accept_tasks {
            let _ = t.await;
        }
        if let Some(t) = self.link_task {
            t.abort();
        }
        self.memory_task.abort();
        tracing::info!("node stopped; the address stays in place (use --cleanup to remove it)");
    }
}

async fn manage_link(
    mut manager: link::LinkManager,
    interval: Duration,
    mut events: tokio::sync::mpsc::Receiver<()>,
    readiness: Arc<Readiness>,
    admin: Arc<AdminState>,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The last failure logged: the same one again (every event and tick) goes to debug.
    let mut last_error = None;
    loop {
        match manager.reconcile().await {
            Ok(changes) => {
                if changes != link::Changes::default() {
                    tracing::info!(changes = %changes, link = manager.link(), "address reconciled");
                }
                last_error = None;
                readiness.address.store(true, Ordering::SeqCst);
            }
            Err(e) => {
                let text = e.to_string();
                let repeated = last_error.as_ref() == Some(&text);
                match (e.is_permission_denied(), repeated) {
                    (_, true) => {
                        tracing::debug!(error = %e, "cannot manage the advertise address")
                    }
                    (true, false) => tracing::error!(
                        error = %e,
                        capability = "CAP_NET_ADMIN",
                        "cannot manage the advertise address: the process lacks the \
                         CAP_NET_ADMIN capability (needed to add the address and create the \
                         link); not ready while the address is not in place"
                    ),
                    (false, false) => {
                        tracing::error!(error = %e, "cannot manage the advertise address")
                    }
                }
                last_error = Some(text);
                let in_place = manager.is_in_place().await.unwrap_or(false);
                readiness.address.store(in_place, Ordering::SeqCst);
            }
        }
        readiness.publish(&admin);
        tokio::select! {
            _ = tick.tick() => {}
            Some(()) = events.recv() => {
                // Let a burst of events settle, then check once.
                tokio::time::sleep(Duration::from_millis(50)).await;
                while events.try_recv().is_ok() {}
            }
        }
    }
}

/// What every connection of the node shares.
struct Node {
    config: Arc<NodeConfig>,
    /// What every connection is counted and logged under ([`ROUTE`]); it has no backends,
    /// as every connection goes to `upstream`.
    route: Route,
    /// The gateway: an address, or a name resolved on every connect.
    upstream: BackendAddress,
    /// Reaches the gateway and opens the tunnel.
    dialer: Tunneled<Direct>,
    /// The process's drain.
    drain: Arc<Drain>,
}

impl Node {
    fn new(config: Arc<NodeConfig>, resolver: Arc<Resolver>, drain: Arc<Drain>) -> Self {
        let upstream = match config.upstream.address.host.parse::<std::net::IpAddr>() {
            Ok(ip) => BackendAddress::Ip(SocketAddr::new(ip, config.upstream.address.port)),
            Err(_) => BackendAddress::Dns {
                host: config.upstream.address.host.clone(),
                port: config.upstream.address.port,
            },
        };
        let route = Route::new::<&str, &str>(ROUTE, &[], &[], Vec::new(), Vec::new())
            .unwrap_or_else(|_| unreachable!("a route without keys is never too long"));
        let hello = match &config.upstream.protocol() {
            UpstreamProtocol::HttpConnect {
                header,
                destination,
            } => Hello::Connect {
                authority: format!("{}:443", config.upstream.address.host),
                header: header.clone(),
                destination: destination.clone(),
            },
            UpstreamProtocol::ProxyV2 => Hello::ProxyV2,
        };
        let dialer = Tunneled {
            inner: Direct {
                zone: None,
                connect_timeout: config.timeouts.connect,
                keepalive: (
                    config.keepalive.upstream.idle,
                    config.keepalive.upstream.interval,
                ),
                family: config.upstream.ip_family,
                resolver,
            },
            hello,
            handshake_timeout: config.timeouts.handshake,
        };
        Node {
            config,
            route,
            upstream,
            dialer,
            drain,
        }
    }

    /// Forwards one client connection to the gateway: links it in a box that is freed
    /// before the relay, so the task keeps only the relay's state.
    fn handle(
        self: Arc<Self>,
        accepted: Accepted<TcpStream>,
    ) -> impl Future<Output = ()> + Send + 'static {
        let link = Box::pin(self.clone().link(accepted));
        async move {
            let Some(linked) = link.await else {
                return;
            };
            linked.relay(&self.drain.hard_stop).await;
        }
    }

    /// Dials the gateway for one client connection (`None`: it ended there).
    async fn link(
        self: Arc<Self>,
        accepted: Accepted<TcpStream>,
    ) -> Option<Linked<TcpStream, TcpStream>> {
        let Accepted {
            stream,
            guard,
            mut record,
        } = accepted;
        // The address the client dialled: the advertise address, which a PROXY v2 header
        // carries as its destination.
        let local = stream.local_addr().map_or(record.peer, normalize);
        record.target = Some(local.to_string());
        record.local = Some(local);
        let routed = Routed {
            client: stream,
            to_backend: Vec::new(),
            record,
            guard,
            route: &self.route,
            to: Dest::Address(&self.upstream),
            limits: Limits {
                idle: self.config.timeouts.idle,
                half_close: self.config.timeouts.half_close,
                max_duration: None,
                progress: None,
            },
        };
        link(routed, &self.dialer, Reply::None).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The size of what `f` returns, without calling it.
    fn returned_size<A, B, R>(_: impl FnOnce(A, B) -> R) -> usize {
        std::mem::size_of::<R>()
    }

    /// As on the gateway: an idle connection's task holds the relay's state, not the
    /// dialing stage's locals beside it.
    #[test]
    fn a_connection_task_holds_the_relay_not_the_dialing() {
        let future = returned_size(Node::handle);
        let link = returned_size(Node::link);
        eprintln!("task future {future} B, link {link} B");
        assert!(future <= 700, "the task's future is {future} bytes");
        // A connection in its handshake holds the boxed stage: it stays small too (the dial,
        // large and short-lived, is boxed within it).
        assert!(link <= 2048, "the boxed stage is {link} bytes");
    }
}
