//! `trellis extension`: the controller, the webhook server, the certificates and the
//! heartbeat in one process, on the role skeleton ([`crate::serve::process`]).
//!
//! Start: the Kubernetes client is built and the webhook address bound (an unusable
//! kubeconfig or a taken port fails the start before anything is said to have started), the
//! admin endpoint comes up (not ready); the certificates are read from
//! (or first written to) their Secrets, retried with a growing pause while the API server
//! does not answer; once a key pair is served the controller starts (it renders every webhook
//! configuration with the CA bundle, so it waits for one), and once its watches have listed
//! and the webhooks' state is rebuilt the process is ready. Stop
//! (SIGTERM/SIGINT): readiness fails, the server stops accepting and finishes the reviews
//! in flight, the controller, certificate loop and heartbeat end.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{oneshot, watch};
use tokio::task::JoinSet;

use super::certs::{self, Published, Settings};
use super::metrics::ExtensionMetrics;
use super::server::{self, Bound};
use super::state::State;
use super::{heartbeat, watch as controller};
use crate::admin::{AdminState, Metrics};
use crate::config::extension::ExtensionConfig;
use crate::controller::watch::WatchError;
use crate::serve::process::{self, Context, Role, Spec, StartError};

/// Why the extension could not start.
#[derive(Debug, thiserror::Error)]
pub enum ExtensionError {
    /// A start error every role shares (a taken address, signals).
    #[error(transparent)]
    Start(#[from] StartError),
    /// No Kubernetes client (kubeconfig unreadable, no in-cluster configuration).
    #[error(transparent)]
    Client(#[from] WatchError),
}

/// Longest pause between two tries of the first certificate check.
const FIRST_CHECK_MAX_PAUSE: Duration = Duration::from_secs(10);

/// Runs the extension until SIGTERM or SIGINT.
pub async fn run(config: ExtensionConfig) -> Result<(), ExtensionError> {
    let client = controller::client(config.kubeconfig.as_deref()).await?;
    let bound = server::bind(config.webhook.address.0).await?;
    let own = Arc::new(ExtensionMetrics::new());
    let metrics = Arc::new(Metrics::extension(|r| own.register(r)));
    let spec = Spec {
        metrics,
        admin: Some(config.admin.address.0),
        debug: None,
        hangup: false,
        // The webhook server finishes its reviews itself when it stops (no connection of
        // it outlives a review by more than the request deadline).
        drain: None,
    };
    process::run(spec, move || {
        Ok(Starting {
            config: Arc::new(config),
            metrics: own,
            client,
            bound,
        })
    })
    .await
}

/// The extension before it serves: its client built, its webhook address bound.
struct Starting {
    config: Arc<ExtensionConfig>,
    metrics: Arc<ExtensionMetrics>,
    client: kube::Client,
    bound: Bound,
}

impl Role for Starting {
    type Error = ExtensionError;
    type Serving = Serving;

    async fn serve(self, cx: &Context) -> Result<Serving, ExtensionError> {
        let Starting {
            config,
            metrics,
            client,
            bound,
        } = self;
        let (stop, stopped) = watch::channel(false);
        let mut tasks = JoinSet::new();
        tasks.spawn(run_all(
            client,
            config,
            metrics,
            bound,
            cx.admin.clone(),
            stopped,
        ));
        Ok(Serving { stop, tasks })
    }
}

/// Everything the process runs, started in order (see the module's text).
async fn run_all(
    client: kube::Client,
    config: Arc<ExtensionConfig>,
    metrics: Arc<ExtensionMetrics>,
    bound: Bound,
    admin: Arc<AdminState>,
    mut stop: watch::Receiver<bool>,
) {
    let state = State::new();
    let published = Published::new();
    let settings = Settings::new(&config);
    let secrets = kube::Api::namespaced(client.clone(), &config.namespace);
    let mut tasks = JoinSet::new();
    let holder = std::env::var("HOSTNAME").unwrap_or_else(|_| "trellis-extension".to_owned());
    tasks.spawn(heartbeat::run(
        client.clone(),
        config.namespace.clone(),
        holder,
        config.heartbeat.interval(),
        stopping(stop.clone()),
    ));
    let server = bound.serve(
        state.clone(),
        published.clone(),
        metrics.clone(),
        stop.clone(),
    );
    let server = tasks.spawn(async move {
        if let Err(e) = server.await {
            tracing::error!(error = %e, "webhook server stopped");
        }
    });
    // The first key pair: until it is served, handshakes fail and the process is not ready.
    let mut pause = Duration::from_millis(250);
    loop {
        let checked = tokio::select! {
            checked = certs::check_and_publish(&secrets, &settings, &published, &metrics) => checked,
            // An API server that does not answer must not hold a stop.
            () = server::stopped(&mut stop) => return,
        };
        match checked {
            Ok(()) => break,
            Err(e) => {
                metrics.certificate_errors.inc();
                tracing::warn!(error = %e, retry_in = ?pause, "webhook certificates: first check failed");
            }
        }
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            () = server::stopped(&mut stop) => return,
        }
        pause = (pause * 2).min(FIRST_CHECK_MAX_PAUSE);
    }
    tasks.spawn(certs::run(
        secrets,
        settings,
        published.clone(),
        metrics.clone(),
        stopping(stop.clone()),
    ));
    let (synced, in_sync) = oneshot::channel();
    let types = config.types.join(",");
    let namespace = config.namespace.clone();
    tasks.spawn(controller::run(
        client,
        config,
        state,
        published.bundle(),
        synced,
        stopping(stop.clone()),
    ));
    // Ready once a key pair is served and the controller is in step with the API server
    // (its watches listed, the state rebuilt): before, the webhooks would know no callers,
    // labels or configured shoots and leave every object unchanged.
    tokio::select! {
        in_sync = in_sync => match in_sync {
            Ok(()) => {
                admin.set_ready(true);
                tracing::info!(%namespace, %types, "extension serving");
            }
            Err(_) => tracing::error!("the controller ended before it was in sync"),
        },
        () = server::stopped(&mut stop) => {}
    }
    // The server ends when stopped, or when it failed: then the process stops.
    while let Some(done) = tasks.join_next_with_id().await {
        if done.as_ref().map_or_else(|e| e.id(), |(id, ())| *id) == server.id() {
            break;
        }
    }
    if *stop.borrow() {
        while tasks.join_next().await.is_some() {}
    } else {
        tracing::error!("the webhook server ended; stopping");
        tasks.shutdown().await;
    }
}

/// A future that completes once `stop` is true.
async fn stopping(mut stop: watch::Receiver<bool>) {
    server::stopped(&mut stop).await;
}

/// The serving extension.
struct Serving {
    stop: watch::Sender<bool>,
    tasks: JoinSet<()>,
}

impl process::Serving for Serving {
    /// Ends when the webhook server ends by itself (a failure): the process then stops.
    async fn run(&mut self) {
        let mut stopped = self.stop.subscribe();
        let server_gone = async {
            while !self.tasks.is_empty() {
                if self.tasks.join_next().await.is_some() {
                    return;
                }
            }
        };
        tokio::select! {
            () = server_gone => {}
            () = server::stopped(&mut stopped) => {}
        }
    }

    fn draining(&mut self) {
        tracing::info!("extension stopping");
        self.stop.send_replace(true);
    }

    async fn stop(mut self) {
        self.stop.send_replace(true);
        while self.tasks.join_next().await.is_some() {}
        tracing::info!("extension stopped");
    }
}
