//! The process skeleton every role (gateway, node, agent, controller) runs in, as ztunnel
//! wraps each of its components in one `run_with_drain`: [`run`] installs the signal
//! handlers, lets the role bind what it serves, binds and starts the admin endpoint, hands
//! the role its [`Context`] (readiness, the [`Drain`], SIGHUP) to start serving, and on
//! SIGTERM or SIGINT drains: fails readiness, stops the accept loops, lets connections
//! finish until the deadline, then asks the role to stop. The start errors every role
//! shares ([`StartError`]) are defined here once; each role's error wraps them.
//!
//! It never knows what a role serves: no listener protocol, no configuration file, no role
//! type. Readiness is the role's to turn on; the skeleton only turns it off.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use thiserror::Error;
use tokio::sync::{mpsc, watch};

use super::drain::{Drain, DrainTimes};
use crate::admin::{self, AdminState, Metrics, RoutesJson};

/// Why a role's process could not start, for the reasons every role shares.
#[derive(Debug, Error)]
pub enum StartError {
    /// Another process already listens on an address the role binds.
    #[error("cannot bind {what} on {address}: another process already listens there ({source})")]
    InUse {
        /// What was bound: `listener NAME`, `listener`, `admin`, `debug endpoint`.
        what: String,
        /// The address.
        address: SocketAddr,
        /// The error (`EADDRINUSE`).
        source: std::io::Error,
    },
    /// An address could not be bound (or its server could not be started).
    #[error("cannot bind {what} on {address}: {source}")]
    Bind {
        /// What was bound: `listener NAME`, `listener`, `admin`, `tunnel socket`, ...
        what: String,
        /// The address.
        address: SocketAddr,
        /// The error.
        source: std::io::Error,
    },
    /// Signal handlers could not be installed (or a thread or socket the role starts with
    /// could not be set up).
    #[error("signal handling: {0}")]
    Signals(std::io::Error),
}

impl StartError {
    /// A failed bind of `what` on `address`: [`StartError::InUse`] when the address is
    /// taken, [`StartError::Bind`] otherwise.
    pub(crate) fn bind(
        what: impl Into<String>,
        address: SocketAddr,
        source: std::io::Error,
    ) -> Self {
        let what = what.into();
        if source.kind() == std::io::ErrorKind::AddrInUse {
            StartError::InUse {
                what,
                address,
                source,
            }
        } else {
            StartError::Bind {
                what,
                address,
                source,
            }
        }
    }
}

/// What the skeleton does for a role, decided before it starts.
pub(crate) struct Spec {
    /// The process's metrics, served on `/metrics`.
    pub metrics: Arc<Metrics>,
    /// The admin endpoint's address (`None`: the role serves none).
    pub admin: Option<SocketAddr>,
    /// The debug endpoint's address (`/routes`, see [`Role::routes`]), bound right after
    /// the admin endpoint.
    pub debug: Option<SocketAddr>,
    /// Whether SIGHUP is handled (it reaches the role through [`Context::hangup`]); without
    /// it, SIGHUP keeps its default action.
    pub hangup: bool,
    /// How the drain runs after SIGTERM/SIGINT (`None`: the role stops at once, and the
    /// signal is not logged).
    pub drain: Option<DrainTimes>,
}

impl Spec {
    /// A role with its admin endpoint at `admin` that drains per `drain`: no debug
    /// endpoint, SIGHUP left alone.
    pub(crate) fn new(metrics: Arc<Metrics>, admin: SocketAddr, drain: DrainTimes) -> Self {
        Spec {
            metrics,
            admin: Some(admin),
            debug: None,
            hangup: false,
            drain: Some(drain),
        }
    }
}

/// What a serving role gets from the skeleton.
pub(crate) struct Context {
    /// What the admin endpoint serves: the role turns readiness on, the drain turns it off.
    pub admin: Arc<AdminState>,
    /// The process's drain: its tracker counts the role's connections, its listeners' stop
    /// closes the role's accept loops and its hard stop cuts the relays at the deadline.
    pub drain: Arc<Drain>,
    /// Changes on every SIGHUP (when [`Spec::hangup`]).
    pub hangup: watch::Receiver<()>,
}

/// A role, bound and ready to start serving: what it hands the skeleton.
pub(crate) trait Role: Sized {
    /// The role's errors: its own and the shared [`StartError`].
    type Error: From<StartError>;
    /// The role while it serves.
    type Serving: Serving;

    /// `/routes` of the debug endpoint, asked for once when [`Spec::debug`] is set.
    fn routes(&self) -> Option<RoutesJson> {
        None
    }

    /// Starts serving, once the admin endpoint is up.
    fn serve(self, cx: &Context) -> impl Future<Output = Result<Self::Serving, Self::Error>>;
}

/// A serving role.
pub(crate) trait Serving {
    /// Runs what the role runs in the foreground until it ends by itself (which drains the
    /// process as a signal does, but unlogged); cancelled at SIGTERM/SIGINT. The default
    /// never ends: the role serves on tasks and threads of its own.
    fn run(&mut self) -> impl Future<Output = ()> {
        std::future::pending()
    }

    /// Called as the drain starts, before readiness fails.
    fn draining(&mut self) {}

    /// Ends what the role still runs once the drain is over, and says that it stopped.
    fn stop(self) -> impl Future<Output = ()>;
}

/// A signal the skeleton acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Signal {
    /// SIGTERM: drain and stop.
    Terminate,
    /// SIGINT: drain and stop.
    Interrupt,
    /// SIGHUP: re-read files.
    Hangup,
}

/// Where signals come from: the process's handlers, or a channel in tests.
pub(crate) enum Signals {
    /// The process's handlers.
    Process {
        /// SIGTERM.
        term: tokio::signal::unix::Signal,
        /// SIGINT.
        int: tokio::signal::unix::Signal,
        /// SIGHUP, when handled.
        hup: Option<tokio::signal::unix::Signal>,
    },
    /// Signals sent on a channel (tests).
    #[cfg_attr(not(test), expect(dead_code, reason = "tests drive the skeleton so"))]
    Channel(mpsc::UnboundedReceiver<Signal>),
}

impl Signals {
    /// Installs the handlers of SIGTERM, SIGINT and, with `hangup`, SIGHUP.
    pub(crate) fn install(hangup: bool) -> Result<Self, StartError> {
        use tokio::signal::unix::{SignalKind, signal};
        let term = signal(SignalKind::terminate()).map_err(StartError::Signals)?;
        let int = signal(SignalKind::interrupt()).map_err(StartError::Signals)?;
        let hup = match hangup {
            true => Some(signal(SignalKind::hangup()).map_err(StartError::Signals)?),
            false => None,
        };
        Ok(Signals::Process { term, int, hup })
    }

    /// The next signal (never, once a test's channel is closed).
    pub(crate) async fn recv(&mut self) -> Signal {
        match self {
            Signals::Process { term, int, hup } => {
                let hangup = async {
                    match hup {
                        Some(h) => h.recv().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = term.recv() => Signal::Terminate,
                    _ = int.recv() => Signal::Interrupt,
                    _ = hangup => Signal::Hangup,
                }
            }
            Signals::Channel(rx) => match rx.recv().await {
                Some(s) => s,
                None => std::future::pending().await,
            },
        }
    }
}

/// Runs a role from start to exit: installs the signal handlers, calls `bind` (the role
/// binds its listeners, so an address it cannot have fails the start before the admin
/// endpoint answers), binds and starts the admin endpoint, starts the role serving, waits
/// for SIGTERM or SIGINT (passing SIGHUP on), then drains and stops the role.
pub(crate) async fn run<R: Role>(
    spec: Spec,
    bind: impl FnOnce() -> Result<R, R::Error>,
) -> Result<(), R::Error> {
    let signals = Signals::install(spec.hangup)?;
    run_with(spec, signals, bind).await
}

/// [`run`] with the signals from `signals`.
pub(crate) async fn run_with<R: Role>(
    spec: Spec,
    mut signals: Signals,
    bind: impl FnOnce() -> Result<R, R::Error>,
) -> Result<(), R::Error> {
    let role = bind()?;
    let admin = Arc::new(AdminState::new(spec.metrics.clone()));
    let server = match spec.admin {
        Some(address) => Some(start_admin(address, spec.debug, &role, admin.clone())?),
        None => None,
    };
    let (hup_tx, hangup) = watch::channel(());
    let cx = Context {
        admin,
        drain: Arc::new(Drain::default()),
        hangup,
    };
    let mut serving = role.serve(&cx).await?;
    let signal = {
        let run = serving.run();
        tokio::pin!(run);
        loop {
            tokio::select! {
                () = &mut run => break None,
                s = signals.recv() => match s {
                    Signal::Hangup => {
                        hup_tx.send_replace(());
                    }
                    s => break Some(s),
                },
            }
        }
    };
    if spec.drain.is_some() {
        match signal {
            Some(Signal::Terminate) => tracing::info!("SIGTERM: draining"),
            Some(Signal::Interrupt) => tracing::info!("SIGINT: draining"),
            Some(Signal::Hangup) | None => {}
        }
    }
    // Drain: fail readiness at once, keep accepting for the drain delay, close the
    // listeners, let connections finish until the deadline, cut the rest.
    serving.draining();
    cx.admin.set_ready(false);
    if let Some(times) = spec.drain {
        cx.drain.run(times).await;
    }
    serving.stop().await;
    drop(server);
    Ok(())
}

/// Binds the admin endpoint (and the debug endpoint, when given) and starts their server.
fn start_admin<R: Role>(
    address: SocketAddr,
    debug: Option<SocketAddr>,
    role: &R,
    state: Arc<AdminState>,
) -> Result<admin::Server, StartError> {
    let admin_sock =
        admin::bind(address).map_err(|source| StartError::bind("admin", address, source))?;
    let debug = match debug {
        Some(d) => {
            let sock =
                admin::bind(d).map_err(|source| StartError::bind("debug endpoint", d, source))?;
            role.routes().map(|routes| (sock, routes))
        }
        None => None,
    };
    // Probes, metrics and /routes run on a thread of their own.
    admin::Server::start(admin_sock, debug, state).map_err(|source| StartError::Bind {
        what: "admin".into(),
        address,
        source,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use super::*;
    use crate::admin::metrics::Role as MetricsRole;
    use crate::serve::tracker::ConnGuard;

    /// What the test role did, in order.
    type Log = Arc<Mutex<Vec<String>>>;

    fn said(log: &Log, what: impl Into<String>) {
        log.lock().unwrap().push(what.into());
    }

    /// Turns ready on and holds one connection open until `release` is sent.
    struct Test {
        log: Log,
        release: Option<tokio::sync::oneshot::Receiver<()>>,
        fail: bool,
    }

    struct TestServing {
        log: Log,
        admin: Arc<AdminState>,
        hangup: watch::Receiver<()>,
    }

    impl Role for Test {
        type Error = StartError;
        type Serving = TestServing;

        async fn serve(self, cx: &Context) -> Result<TestServing, StartError> {
            said(&self.log, "serve");
            if self.fail {
                return Err(StartError::Signals(std::io::Error::other("role failed")));
            }
            cx.admin.set_ready(true);
            if let Some(release) = self.release {
                let guard: ConnGuard = cx.drain.tracker.admit(usize::MAX).unwrap();
                let log = self.log.clone();
                tokio::spawn(async move {
                    let _ = release.await;
                    said(&log, "connection ended");
                    drop(guard);
                });
            }
            Ok(TestServing {
                log: self.log,
                admin: cx.admin.clone(),
                hangup: cx.hangup.clone(),
            })
        }
    }

    impl Serving for TestServing {
        async fn run(&mut self) {
            loop {
                if self.hangup.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
                said(&self.log, "hangup");
            }
        }

        fn draining(&mut self) {
            said(&self.log, "draining");
        }

        async fn stop(self) {
            let ready = self.admin.ready.load(std::sync::atomic::Ordering::SeqCst);
            said(&self.log, format!("stop ready={ready}"));
        }
    }

    /// Drains for up to 30 s, SIGHUP handled; the admin endpoint at `admin`, if any.
    fn spec(admin: Option<SocketAddr>) -> Spec {
        let metrics = Arc::new(Metrics::new(MetricsRole::Node));
        let drain = DrainTimes {
            delay: Duration::ZERO,
            timeout: Duration::from_secs(30),
        };
        let unused = SocketAddr::from(([127, 0, 0, 1], 0));
        Spec {
            admin,
            hangup: true,
            ..Spec::new(metrics, unused, drain)
        }
    }

    fn channel() -> (mpsc::UnboundedSender<Signal>, Signals) {
        let (tx, rx) = mpsc::unbounded_channel();
        (tx, Signals::Channel(rx))
    }

    /// Runs the test role (without an admin endpoint) holding one connection until
    /// `release` is sent; its signals come from the sender returned.
    fn start(
        log: &Log,
        release: tokio::sync::oneshot::Receiver<()>,
    ) -> (
        mpsc::UnboundedSender<Signal>,
        tokio::task::JoinHandle<Result<(), StartError>>,
    ) {
        let (signal, signals) = channel();
        let role = Test {
            log: log.clone(),
            release: Some(release),
            fail: false,
        };
        let running = tokio::spawn(run_with(spec(None), signals, move || Ok(role)));
        (signal, running)
    }

    /// SIGHUP reaches the role and does not stop it; SIGTERM drains: the role is told,
    /// readiness fails, and the role is stopped only once its open connection ended.
    #[tokio::test(start_paused = true)]
    async fn sighup_is_passed_on_and_sigterm_drains_until_connections_end() {
        let log = Log::default();
        let (release_tx, release) = tokio::sync::oneshot::channel();
        let (signal, running) = start(&log, release);
        tokio::time::sleep(Duration::from_millis(10)).await;
        signal.send(Signal::Hangup).unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(*log.lock().unwrap(), ["serve", "hangup"]);
        assert!(!running.is_finished(), "SIGHUP does not stop the role");
        signal.send(Signal::Terminate).unwrap();
        // Well inside the drain timeout, the connection is still open: no stop yet.
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(*log.lock().unwrap(), ["serve", "hangup", "draining"]);
        assert!(!running.is_finished());
        release_tx.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(1), running)
            .await
            .expect("stops once the connection ended")
            .unwrap()
            .unwrap();
        assert_eq!(
            *log.lock().unwrap(),
            [
                "serve",
                "hangup",
                "draining",
                "connection ended",
                "stop ready=false"
            ]
        );
    }

    /// A connection still open at the deadline does not hold the process: the role is
    /// stopped after the drain timeout (and the cut's window and grace).
    #[tokio::test(start_paused = true)]
    async fn the_drain_ends_at_its_deadline() {
        let log = Log::default();
        let (_release_tx, release) = tokio::sync::oneshot::channel();
        let (signal, running) = start(&log, release);
        signal.send(Signal::Interrupt).unwrap();
        tokio::time::timeout(Duration::from_secs(30 + 3 + 2 + 1), running)
            .await
            .expect("stops after the deadline")
            .unwrap()
            .unwrap();
        assert_eq!(
            *log.lock().unwrap(),
            ["serve", "draining", "stop ready=false"]
        );
    }

    /// An admin address already taken fails the start with the shared error, before the
    /// role serves anything; a role's own error is returned as it is.
    #[tokio::test]
    async fn a_taken_admin_address_fails_the_start_before_the_role_serves() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = taken.local_addr().unwrap();
        let log = Log::default();
        let (_signal, signals) = channel();
        let role = Test {
            log: log.clone(),
            release: None,
            fail: false,
        };
        let e = run_with(spec(Some(address)), signals, move || Ok(role))
            .await
            .unwrap_err();
        assert!(
            matches!(&e, StartError::InUse { what, .. } if what == "admin"),
            "{e:?}"
        );
        assert!(log.lock().unwrap().is_empty(), "the role never served");

        let (_signal, signals) = channel();
        let role = Test {
            log: log.clone(),
            release: None,
            fail: true,
        };
        let e = run_with(spec(None), signals, move || Ok(role))
            .await
            .unwrap_err();
        assert_eq!(e.to_string(), "signal handling: role failed");
        assert_eq!(*log.lock().unwrap(), ["serve"], "not drained, not stopped");
    }

    #[test]
    fn a_taken_address_is_said_to_be_in_use() {
        let address = SocketAddr::from(([127, 0, 0, 1], 1));
        let in_use = std::io::Error::from(std::io::ErrorKind::AddrInUse);
        let e = StartError::bind("listener", address, in_use);
        assert!(matches!(e, StartError::InUse { .. }), "{e:?}");
        assert!(
            e.to_string().starts_with(
                "cannot bind listener on 127.0.0.1:1: another process already listens there ("
            ),
            "{e}"
        );
        let denied = std::io::Error::from(std::io::ErrorKind::PermissionDenied);
        let e = StartError::bind("admin", address, denied);
        assert!(matches!(e, StartError::Bind { .. }), "{e:?}");
        assert!(!e.to_string().contains("another process"), "{e}");
    }
}
