//! Name resolution for backends and CONNECT targets: one asynchronous stub resolver per
//! process, shared by every worker thread and every connection.
//!
//! A name is looked up in `/etc/hosts` first (read once at start; a name found there is
//! never asked of DNS, as getaddrinfo does with `hosts: files dns`; `localhost` is the
//! loopback addresses even when the file lacks it, and names under `invalid` never resolve).
//! Other names go to the name servers of `/etc/resolv.conf` (or those configured), A and
//! AAAA at once, through hickory's stub resolver on a thread and event loop of its own.
//!
//! Answers are kept for their TTL (at most [`MAX_CACHED`] names), so a name costs one query
//! per record type per TTL however many connections use it, and none while it is cached.
//! While a name is being looked up, every other caller that needs it waits for that same
//! lookup. At most `lookups` names (the descriptor budget's share, [`super::fds::Budget`])
//! are looked up at once: a name that would be one more fails at once with
//! [`ResolveError::Busy`] instead of queueing. No lookup outlives the resolver's timeout,
//! and a name whose servers never answer fails with [`ResolveError::Timeout`], not as a
//! connect timeout.
//!
//! It never blocks a thread (no getaddrinfo), never spawns more than one task per name in
//! flight, and never connects to the addresses it returns: callers filter them by family
//! and dial.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::future::{BoxFuture, FutureExt, Shared};
use hickory_resolver::config::{
    ConnectionConfig, LookupIpStrategy, NameServerConfig, ResolveHosts, ResolverConfig,
    ResolverOpts,
};
use hickory_resolver::net::NetError;
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::{Resolver as Hickory, TokioResolver};
use thiserror::Error;
use tokio::runtime::Handle;
use tokio::sync::{Semaphore, oneshot};
use tokio::time::Instant;

/// Longest a name lookup may take by default, retries and search-list names included: below
/// the default connect budget (5 s), so a backend whose name never answers leaves time for
/// the next.
pub(crate) const DEFAULT_RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

/// How backend names are resolved (the gateway's `resolver`; the node uses the defaults).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ResolverSettings {
    /// Name servers asked instead of `/etc/resolv.conf`'s (its search list and `ndots` still
    /// apply); empty: its own.
    pub(crate) nameservers: Vec<std::net::SocketAddr>,
    /// Longest a lookup may take, retries and search-list names included.
    pub(crate) timeout: Duration,
}

impl Default for ResolverSettings {
    fn default() -> Self {
        ResolverSettings {
            nameservers: Vec::new(),
            timeout: DEFAULT_RESOLVE_TIMEOUT,
        }
    }
}

/// Most names whose answers are kept at once; past it, expired answers are dropped first,
/// then any one.
pub(crate) const MAX_CACHED: usize = 4096;
/// Where the hosts file is.
const HOSTS_FILE: &str = "/etc/hosts";

/// The addresses of a name, as its answer or the hosts file gave them.
pub(crate) type Addrs = Arc<[IpAddr]>;

/// Why a name gave no address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub(crate) enum ResolveError {
    /// The name servers answered, with no address: no such name, no A or AAAA record, a
    /// server failure, or a name that is not a valid DNS name.
    #[error("the name does not resolve")]
    NotFound,
    /// No answer within the resolver's timeout or the caller's deadline.
    #[error("no answer from the name servers in time")]
    Timeout,
    /// As many names as the resolver may look up at once are being looked up.
    #[error("too many names being looked up at once")]
    Busy,
}

/// Why the resolver could not be set up.
#[derive(Debug, Error)]
pub(crate) enum StartError {
    /// No name servers configured and `/etc/resolv.conf` unusable.
    #[error("reading /etc/resolv.conf: {0} (or set resolver.nameservers)")]
    SystemConfig(String),
    /// The resolver's thread or event loop.
    #[error("starting the resolver's thread: {0}")]
    Thread(#[from] io::Error),
}

/// The process's resolver. Dropping it stops its thread; lookups still in flight then fail.
pub(crate) struct Resolver {
    /// Names from the hosts file (lower case, no trailing dot).
    hosts: HashMap<String, Addrs>,
    /// Cache, lookups in flight and the bound on them.
    flights: Arc<Flights>,
    /// hickory's resolver (its own cache holds negative answers and search-list misses).
    dns: TokioResolver,
    /// The resolver thread's event loop, where every lookup runs.
    runtime: Handle,
    /// Longest a lookup may take, retries and search-list names included.
    timeout: Duration,
    /// Dropped with the resolver: ends its thread.
    _stop: oneshot::Sender<()>,
}

impl std::fmt::Debug for Resolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resolver")
            .field("hosts", &self.hosts.len())
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl Resolver {
    /// Reads the hosts file and the system's resolver configuration (the name servers of
    /// `settings` replace its name servers), and starts the resolver's thread; at most
    /// `lookups` names are looked up at once.
    pub(crate) fn start(settings: &ResolverSettings, lookups: usize) -> Result<Self, StartError> {
        let hosts = match std::fs::read_to_string(HOSTS_FILE) {
            Ok(text) => parse_hosts(&text),
            Err(e) => {
                tracing::warn!(file = HOSTS_FILE, error = %e, "cannot read the hosts file");
                parse_hosts("")
            }
        };
        let (config, mut opts) = system_config(&settings.nameservers)?;
        // Both families at once, one lookup for both; getaddrinfo's order of name servers
        // (one at a time); the hosts file is ours; answers cached by TTL.
        opts.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
        opts.num_concurrent_reqs = 1;
        opts.use_hosts_file = ResolveHosts::Never;
        opts.timeout = settings.timeout;
        opts.cache_size = MAX_CACHED as u64;
        let dns = Hickory::builder_with_config(config, TokioRuntimeProvider::default())
            .with_options(opts)
            .build()
            .map_err(|e| StartError::SystemConfig(e.to_string()))?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("trellis-resolve".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let _ = stopped.await;
                })
            })?;
        Ok(Resolver {
            hosts,
            flights: Flights::new(lookups.max(1), MAX_CACHED),
            dns,
            runtime: handle,
            timeout: settings.timeout,
            _stop: stop,
        })
    }

    /// The addresses of `host` (a name, not an IP literal), by `deadline` at the latest.
    pub(crate) async fn resolve(
        &self,
        host: &str,
        deadline: Instant,
    ) -> Result<Addrs, ResolveError> {
        let key = normalize(host);
        if let Some(addrs) = self.hosts.get(key.as_str()) {
            return Ok(addrs.clone());
        }
        if key == "invalid" || key.ends_with(".invalid") {
            return Err(ResolveError::NotFound);
        }
        let dns = self.dns.clone();
        let timeout = self.timeout;
        // The name as written: a trailing dot skips the search list.
        let name = host.to_owned();
        self.flights
            .resolve(&key, deadline, &self.runtime, move || {
                async move {
                    match tokio::time::timeout(timeout, dns.lookup_ip(name.as_str())).await {
                        Err(_) => Err(ResolveError::Timeout),
                        Ok(Err(e)) => Err(failure(&e)),
                        Ok(Ok(lookup)) => {
                            let ttl = lookup
                                .valid_until()
                                .saturating_duration_since(std::time::Instant::now());
                            Ok((lookup.iter().collect(), ttl))
                        }
                    }
                }
                .boxed()
            })
            .await
    }

    /// A resolver with the system's configuration for unit tests, shared by them: lookups
    /// of names outside the hosts file would leave the machine, so tests use `localhost`.
    #[cfg(test)]
    pub(crate) fn for_tests() -> Arc<Resolver> {
        static SHARED: std::sync::LazyLock<Arc<Resolver>> = std::sync::LazyLock::new(|| {
            let settings = ResolverSettings::default();
            Arc::new(Resolver::start(&settings, 8).unwrap_or_else(|e| panic!("{e}")))
        });
        SHARED.clone()
    }
}

/// The resolver configuration: `/etc/resolv.conf`'s, with `nameservers` (when any) in place
/// of its name servers.
fn system_config(nameservers: &[SocketAddr]) -> Result<(ResolverConfig, ResolverOpts), StartError> {
    let ours = || {
        nameservers
            .iter()
            .map(|a| {
                let mut udp = ConnectionConfig::udp();
                udp.port = a.port();
                let mut tcp = ConnectionConfig::tcp();
                tcp.port = a.port();
                NameServerConfig::new(a.ip(), true, vec![udp, tcp])
            })
            .collect::<Vec<_>>()
    };
    match hickory_resolver::system_conf::read_system_conf() {
        Ok((config, opts)) if nameservers.is_empty() => Ok((config, opts)),
        Ok((config, opts)) => {
            let (domain, search, _) = config.into_parts();
            Ok((ResolverConfig::from_parts(domain, search, ours()), opts))
        }
        Err(_) if !nameservers.is_empty() => Ok((
            ResolverConfig::from_name_servers(ours()),
            ResolverOpts::default(),
        )),
        Err(e) => Err(StartError::SystemConfig(e.to_string())),
    }
}

/// What a failed hickory lookup stands for.
fn failure(e: &NetError) -> ResolveError {
    match e {
        NetError::Timeout => ResolveError::Timeout,
        NetError::Busy => ResolveError::Busy,
        _ => ResolveError::NotFound,
    }
}

/// A name as the cache and the hosts file key it: lower case, without a trailing dot.
fn normalize(host: &str) -> String {
    host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase()
}

/// The names of a hosts file with their addresses, in the file's order; `localhost` is the
/// loopback addresses unless the file says otherwise.
fn parse_hosts(text: &str) -> HashMap<String, Addrs> {
    let mut names: HashMap<String, Vec<IpAddr>> = HashMap::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or_default();
        let mut words = line.split_whitespace();
        let Some(Ok(ip)) = words.next().map(str::parse::<IpAddr>) else {
            continue;
        };
        for name in words {
            let addrs = names.entry(normalize(name)).or_default();
            if !addrs.contains(&ip) {
                addrs.push(ip);
            }
        }
    }
    names
        .entry("localhost".into())
        .or_insert_with(|| vec![Ipv4Addr::LOCALHOST.into(), Ipv6Addr::LOCALHOST.into()]);
    names.into_iter().map(|(n, a)| (n, a.into())).collect()
}

/// What a lookup yields: the addresses and how long they may be used.
type Answer = Result<(Vec<IpAddr>, Duration), ResolveError>;
/// What every caller waiting for a name gets.
type Outcome = Result<Addrs, ResolveError>;
/// A lookup in flight, awaited by every caller that needs its name.
type Flight = Shared<BoxFuture<'static, Outcome>>;

/// The cache of answers, the lookups in flight, and the bound on them: the part of the
/// resolver that knows nothing of DNS.
struct Flights {
    /// Answers and lookups by name.
    state: Mutex<State>,
    /// One permit per lookup in flight.
    permits: Arc<Semaphore>,
    /// Most names cached.
    max_cached: usize,
}

/// Answers and lookups by name.
#[derive(Default)]
struct State {
    /// Answers still valid (or expired and not yet replaced).
    cached: HashMap<Arc<str>, Cached>,
    /// Lookups in flight.
    flying: HashMap<Arc<str>, Flight>,
}

/// A cached answer.
struct Cached {
    /// The addresses.
    addrs: Addrs,
    /// When the answer's TTL runs out.
    until: Instant,
}

/// A name's cached answer, or the lookup to wait for.
enum Joined {
    /// Cached and valid.
    Cached(Addrs),
    /// In flight (started by this caller or another).
    Flight(Flight),
}

impl Flights {
    /// At most `lookups` in flight and `max_cached` answers kept.
    fn new(lookups: usize, max_cached: usize) -> Arc<Self> {
        Arc::new(Flights {
            state: Mutex::new(State::default()),
            permits: Arc::new(Semaphore::new(lookups)),
            max_cached,
        })
    }

    /// The addresses of `key`: cached, from the lookup in flight, or from a lookup that
    /// `lookup` makes and that runs on `runtime` (it applies its own timeout; the caller
    /// stops waiting at `deadline`, the lookup goes on for the others and the cache).
    async fn resolve<F>(
        self: &Arc<Self>,
        key: &str,
        deadline: Instant,
        runtime: &Handle,
        lookup: F,
    ) -> Outcome
    where
        F: FnOnce() -> BoxFuture<'static, Answer>,
    {
        let flight = match self.join(key, runtime, lookup)? {
            Joined::Cached(addrs) => return Ok(addrs),
            Joined::Flight(f) => f,
        };
        match tokio::time::timeout_at(deadline, flight).await {
            Ok(outcome) => outcome,
            Err(_) => Err(ResolveError::Timeout),
        }
    }

    /// Finds `key`'s answer or lookup, or starts one if a permit is free.
    fn join<F>(
        self: &Arc<Self>,
        key: &str,
        runtime: &Handle,
        lookup: F,
    ) -> Result<Joined, ResolveError>
    where
        F: FnOnce() -> BoxFuture<'static, Answer>,
    {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = state.cached.get(key) {
            if c.until > Instant::now() {
                return Ok(Joined::Cached(c.addrs.clone()));
            }
            state.cached.remove(key);
        }
        if let Some(f) = state.flying.get(key) {
            return Ok(Joined::Flight(f.clone()));
        }
        let permit = self
            .permits
            .clone()
            .try_acquire_owned()
            .map_err(|_| ResolveError::Busy)?;
        let key: Arc<str> = key.into();
        let lookup = lookup();
        let flights = self.clone();
        let landing = key.clone();
        // Inserted below before the lock is released, so the task's landing (which takes
        // the lock) always finds the entry it removes.
        let task = runtime.spawn(async move {
            let answer = lookup.await;
            let outcome = flights.land(&landing, answer);
            drop(permit);
            outcome
        });
        let flight = async move {
            // The resolver's event loop stopped under it.
            task.await.unwrap_or(Err(ResolveError::Timeout))
        }
        .boxed()
        .shared();
        state.flying.insert(key, flight.clone());
        Ok(Joined::Flight(flight))
    }

    /// Ends `key`'s lookup: caches a positive answer for its TTL.
    fn land(&self, key: &Arc<str>, answer: Answer) -> Outcome {
        let now = Instant::now();
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.flying.remove(key);
        let (addrs, ttl) = answer?;
        if addrs.is_empty() {
            return Err(ResolveError::NotFound);
        }
        let addrs: Addrs = addrs.into();
        if !ttl.is_zero() {
            if state.cached.len() >= self.max_cached {
                state.cached.retain(|_, c| c.until > now);
            }
            if state.cached.len() >= self.max_cached
                && let Some(any) = state.cached.keys().next().cloned()
            {
                state.cached.remove(&any);
            }
            state.cached.insert(
                key.clone(),
                Cached {
                    addrs: addrs.clone(),
                    until: now + ttl,
                },
            );
        }
        Ok(addrs)
    }

    /// Lookups in flight now.
    #[cfg(test)]
    fn in_flight(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .flying
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn v4(last: u8) -> IpAddr {
        Ipv4Addr::new(192, 0, 2, last).into()
    }

    /// A lookup that counts its calls and answers `addrs` for `ttl` after `delay`.
    fn answering(
        calls: &Arc<AtomicUsize>,
        addrs: Vec<IpAddr>,
        ttl: Duration,
        delay: Duration,
    ) -> impl FnOnce() -> BoxFuture<'static, Answer> + use<> {
        let calls = calls.clone();
        move || {
            calls.fetch_add(1, Ordering::SeqCst);
            async move {
                tokio::time::sleep(delay).await;
                Ok((addrs, ttl))
            }
            .boxed()
        }
    }

    /// A lookup that never answers (the resolver's own timeout is what ends it).
    fn silent(timeout: Duration) -> impl FnOnce() -> BoxFuture<'static, Answer> + use<> {
        move || {
            async move {
                tokio::time::sleep(timeout).await;
                Err(ResolveError::Timeout)
            }
            .boxed()
        }
    }

    /// Callers of one name share one lookup; its answer is served from the cache until its
    /// TTL runs out, and then looked up again.
    #[tokio::test(start_paused = true)]
    async fn one_lookup_per_name_and_ttl() {
        let flights = Flights::new(4, 16);
        let rt = Handle::current();
        let calls = Arc::new(AtomicUsize::new(0));
        let ttl = Duration::from_secs(30);
        let deadline = Instant::now() + Duration::from_secs(5);
        let waiting: Vec<_> = (0..50)
            .map(|_| {
                let (flights, rt) = (flights.clone(), rt.clone());
                let lookup = answering(&calls, vec![v4(1)], ttl, Duration::from_millis(100));
                tokio::spawn(async move { flights.resolve("a.test", deadline, &rt, lookup).await })
            })
            .collect();
        for w in waiting {
            assert_eq!(&*w.await.unwrap().unwrap(), [v4(1)]);
        }
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "one lookup for fifty callers"
        );
        assert_eq!(flights.in_flight(), 0);
        tokio::time::advance(Duration::from_secs(29)).await;
        let lookup = answering(&calls, vec![v4(2)], ttl, Duration::ZERO);
        let deadline = Instant::now() + Duration::from_secs(5);
        let got = flights.resolve("a.test", deadline, &rt, lookup).await;
        assert_eq!(&*got.unwrap(), [v4(1)], "cached within the TTL");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        tokio::time::advance(Duration::from_secs(2)).await;
        let lookup = answering(&calls, vec![v4(2)], ttl, Duration::ZERO);
        let deadline = Instant::now() + Duration::from_secs(5);
        let got = flights.resolve("a.test", deadline, &rt, lookup).await;
        assert_eq!(&*got.unwrap(), [v4(2)], "looked up again after the TTL");
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    /// Past the bound, a new name fails at once with `Busy` (no task, no waiting), while
    /// names in flight still take more callers and cached names still answer; once a lookup
    /// ends, its permit serves the next name.
    #[tokio::test(start_paused = true)]
    async fn past_the_bound_a_new_name_is_busy_at_once() {
        let flights = Flights::new(2, 16);
        let rt = Handle::current();
        let calls = Arc::new(AtomicUsize::new(0));
        let far = Instant::now() + Duration::from_secs(60);
        let ttl = Duration::from_secs(60);
        let cached = flights
            .resolve(
                "cached.test",
                far,
                &rt,
                answering(&calls, vec![v4(9)], ttl, Duration::ZERO),
            )
            .await;
        assert!(cached.is_ok());
        let timeout = Duration::from_secs(2);
        let dark: Vec<_> = ["dark-1.test", "dark-2.test"]
            .into_iter()
            .map(|name| {
                let (flights, rt) = (flights.clone(), rt.clone());
                tokio::spawn(async move { flights.resolve(name, far, &rt, silent(timeout)).await })
            })
            .collect();
        tokio::task::yield_now().await;
        assert_eq!(flights.in_flight(), 2);

        let started = Instant::now();
        let third = flights
            .resolve(
                "third.test",
                far,
                &rt,
                answering(&calls, vec![v4(3)], ttl, Duration::ZERO),
            )
            .await;
        assert_eq!(third, Err(ResolveError::Busy));
        assert_eq!(started.elapsed(), Duration::ZERO, "failed at once");
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "no lookup started past the bound"
        );
        // A name in flight takes another caller without a permit; a cached one answers.
        let joined = {
            let (flights, rt) = (flights.clone(), rt.clone());
            tokio::spawn(async move {
                flights
                    .resolve("dark-1.test", far, &rt, silent(timeout))
                    .await
            })
        };
        let cached = flights
            .resolve(
                "cached.test",
                far,
                &rt,
                answering(&calls, vec![], ttl, Duration::ZERO),
            )
            .await;
        assert_eq!(&*cached.unwrap(), [v4(9)]);

        for d in dark {
            assert_eq!(d.await.unwrap(), Err(ResolveError::Timeout));
        }
        assert_eq!(joined.await.unwrap(), Err(ResolveError::Timeout));
        assert_eq!(
            started.elapsed(),
            timeout,
            "the lookups' own timeout ended them"
        );
        let third = flights
            .resolve(
                "third.test",
                far,
                &rt,
                answering(&calls, vec![v4(3)], ttl, Duration::ZERO),
            )
            .await;
        assert_eq!(&*third.unwrap(), [v4(3)], "the permits came back");
    }

    /// A caller whose deadline comes before the answer fails with `Timeout`; the lookup goes
    /// on and its answer is cached for the next caller.
    #[tokio::test(start_paused = true)]
    async fn a_caller_stops_waiting_at_its_deadline() {
        let flights = Flights::new(2, 16);
        let rt = Handle::current();
        let calls = Arc::new(AtomicUsize::new(0));
        let ttl = Duration::from_secs(60);
        let slow = answering(&calls, vec![v4(5)], ttl, Duration::from_secs(1));
        let soon = Instant::now() + Duration::from_millis(300);
        assert_eq!(
            flights.resolve("slow.test", soon, &rt, slow).await,
            Err(ResolveError::Timeout)
        );
        tokio::time::advance(Duration::from_secs(1)).await;
        tokio::task::yield_now().await;
        let far = Instant::now() + Duration::from_secs(5);
        let again = answering(&calls, vec![v4(6)], ttl, Duration::ZERO);
        assert_eq!(
            &*flights.resolve("slow.test", far, &rt, again).await.unwrap(),
            [v4(5)]
        );
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    /// Failures and empty answers are not cached here; the cache holds at most its size.
    #[tokio::test(start_paused = true)]
    async fn failures_are_not_cached_and_the_cache_is_bounded() {
        let flights = Flights::new(2, 3);
        let rt = Handle::current();
        let calls = Arc::new(AtomicUsize::new(0));
        let far = Instant::now() + Duration::from_secs(5);
        let ttl = Duration::from_secs(60);
        for _ in 0..2 {
            let empty = answering(&calls, vec![], ttl, Duration::ZERO);
            assert_eq!(
                flights.resolve("none.test", far, &rt, empty).await,
                Err(ResolveError::NotFound)
            );
        }
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        for i in 0..10u8 {
            let name = format!("n{i}.test");
            let lookup = answering(&calls, vec![v4(i)], ttl, Duration::ZERO);
            assert!(flights.resolve(&name, far, &rt, lookup).await.is_ok());
            let cached = flights.state.lock().unwrap().cached.len();
            assert!(cached <= 3, "{cached} cached");
        }
    }

    #[test]
    fn the_hosts_file_is_read_as_getaddrinfo_reads_it() {
        let hosts = parse_hosts(
            "# comment\n127.0.0.1 localhost vm\n::1 localhost ip6-localhost\n\
             10.0.0.1  Seed.Example.com.  seed # trailing comment\nnot-an-ip name\n",
        );
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(&*hosts["localhost"], [ip("127.0.0.1"), ip("::1")]);
        assert_eq!(&*hosts["vm"], [ip("127.0.0.1")]);
        assert_eq!(&*hosts["seed.example.com"], [ip("10.0.0.1")]);
        assert_eq!(&*hosts["seed"], [ip("10.0.0.1")]);
        assert!(!hosts.contains_key("name"));
        // `localhost` is loopback even when the file leaves it out.
        let bare = parse_hosts("10.0.0.1 other\n");
        assert_eq!(&*bare["localhost"], [ip("127.0.0.1"), ip("::1")]);
    }

    /// Names in the hosts file (any case, with or without the trailing dot) and names under
    /// `invalid` are answered without a query.
    #[tokio::test]
    async fn hosts_and_invalid_names_need_no_query() {
        let resolver = Resolver::for_tests();
        let soon = Instant::now() + Duration::from_secs(2);
        let addrs = resolver.resolve("LocalHost.", soon).await.unwrap();
        assert!(addrs.iter().all(IpAddr::is_loopback) && !addrs.is_empty());
        assert_eq!(
            resolver.resolve("no-such-name.invalid", soon).await,
            Err(ResolveError::NotFound)
        );
        assert_eq!(resolver.flights.in_flight(), 0);
    }
}
