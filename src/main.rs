//! Command line: parse arguments, load and validate the config, hand over to the library.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};

/// trellis: L4 data plane for hosted Kubernetes control planes.
#[derive(Parser)]
#[command(version = trellis::VERSION, about, after_help = after_help())]
struct Cli {
    /// Log format on stderr.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Json,
    Text,
}

#[derive(Subcommand)]
enum Command {
    /// Run the seed ingress gateway.
    Gateway {
        /// GatewayConfiguration file.
        #[arg(long)]
        config: PathBuf,
    },
    /// Run the shoot node daemon (the local `kubernetes` service endpoint).
    Node {
        /// NodeConfiguration file.
        #[arg(long)]
        config: PathBuf,
        /// Remove the managed address and exit.
        #[arg(long)]
        cleanup: bool,
        /// The kube-apiserver advertise address: listen on `IP:443` and manage `IP` on the
        /// file's `interface` (the file may then leave `listen` and `interface.address` out;
        /// if it has them, they must agree).
        #[arg(long, value_name = "IP")]
        advertise_address: Option<std::net::IpAddr>,
    },
    /// Run the shoot side of a WireGuard tunnel: a user-space peer of the gateway that dials
    /// targets in the shoot, without privileges.
    Agent {
        /// AgentConfiguration file.
        #[arg(long)]
        config: PathBuf,
    },
    /// The controller: the seed's objects -> routing tables. With `--config`, watches the
    /// API server and writes the table to `output.file` on every change.
    #[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
    Controller {
        /// ControllerConfiguration file.
        #[arg(long, required = true)]
        config: Option<PathBuf>,
        #[command(subcommand)]
        command: Option<ControllerCommand>,
    },
    /// Run the Gardener extension: the controller of trellis' Extension types and the HTTPS
    /// server of their mutating webhooks.
    Extension {
        /// ExtensionConfiguration file.
        #[arg(long)]
        config: PathBuf,
    },
    /// Validate trellis configuration and routing table files, and the files they name;
    /// exit 1 if any is invalid.
    #[command(after_help = check_after_help())]
    Check {
        /// Files to check, each of the kind it names.
        #[arg(required = true, value_name = "FILE")]
        files: Vec<PathBuf>,
        /// Read the files a configuration meant for a pod names as the pod would: what the
        /// pod sees at MOUNT_PATH (a volume's mount path, or one file's) is at LOCAL_PATH
        /// here, as in the pod's volumeMounts. A FILE under a LOCAL_PATH is taken to be at
        /// its MOUNT_PATH, so names relative to it are resolved as in the pod. Repeatable.
        #[arg(long = "mount", value_name = "MOUNT_PATH=LOCAL_PATH", value_parser = parse_mount)]
        mounts: Vec<(PathBuf, PathBuf)>,
        /// Do not read the files the configurations name (keys, certificates, CA bundles,
        /// routing tables, kubeconfigs); the output lists each as not checked.
        #[arg(long, conflicts_with = "mounts")]
        skip_files: bool,
    },
}

#[derive(Subcommand)]
enum ControllerCommand {
    /// Render the routing table from manifest files offline: the table (JSON) on stdout,
    /// what was skipped and why on stderr.
    Render {
        /// Directory of `*.yaml`, `*.yml` and `*.json` files (multi-document, `kind: List`).
        #[arg(long)]
        manifests: PathBuf,
        /// ControllerConfiguration file (default: the seed's default gateway, no fallback).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Write the table to this file instead of stdout, and the egress TLS files it names
        /// beside it, as the controller does (only what changed; egress files it no longer
        /// names are removed). Without it those files are not written.
        #[arg(long)]
        output: Option<PathBuf>,
    },
}

/// The environment variable that says what is logged: a `tracing` filter (`info` unless set).
const LOG_ENV: &str = "TRELLIS_LOG";

/// Each kind of file and its commented example in the repository.
const EXAMPLES: [(&str, &str); 6] = {
    use trellis::config::ConfigKind;
    use trellis::config::{agent, controller, extension, gateway, node, routes};
    [
        (gateway::GatewayConfig::KIND, "config/gateway.yaml"),
        (routes::LoadedTable::KIND, "config/routes.yaml"),
        (node::NodeConfig::KIND, "config/node.yaml"),
        (agent::AgentConfig::KIND, "config/agent.yaml"),
        (controller::ControllerConfig::KIND, "config/controller.yaml"),
        (extension::ExtensionConfig::KIND, "config/extension.yaml"),
    ]
};

/// `trellis --help` after the commands: the environment, the kinds of files and their
/// examples.
fn after_help() -> String {
    let zone = trellis::config::gateway::ZONE_ENV;
    let mut text = format!(
        "Environment:
  {LOG_ENV}   what is logged, as a tracing filter (default: info), e.g. {LOG_ENV}=debug
                or {LOG_ENV}=info,trellis::tunnel=debug
  {zone}  the gateway's availability zone (wins over `zone` in its file)

Files: YAML or JSON with `apiVersion: {}` and a `kind`;
`trellis check FILE...` validates any of them. The repository's config/ holds a commented
example of each kind:
",
        trellis::config::API_VERSION
    );
    for (kind, example) in EXAMPLES {
        text += &format!("  {kind:<25}{example}\n");
    }
    text
}

/// `trellis check --help` after the options: the kinds and the files they name.
fn check_after_help() -> String {
    format!(
        "Kinds: {}.

Besides the file itself, check reads the files it names as its role reads them at start: a
gateway's routing table (and the TLS files of its routes), certificates, keys and CA
bundles (a key must match its certificate), WireGuard private keys, kubeconfigs. Every
problem is one line, FILE:LINE:COL: field: message, the field being the one that names a
file that is missing, unreadable or unusable.

A configuration meant for a pod names files that exist only there: give each volume the
pod mounts, e.g.
  trellis check --mount /etc/trellis/config=./config --mount /etc/trellis/tls=./tls \\
    ./config/gateway.yaml
or check the configuration alone with --skip-files. Files a kubeconfig names itself
(client-certificate, certificate-authority, ...) are read where it says, not through
--mount.",
        trellis::config::KINDS.join(", ")
    )
}

/// `MOUNT_PATH=LOCAL_PATH` of `--mount`.
fn parse_mount(text: &str) -> Result<(PathBuf, PathBuf), String> {
    match text.split_once('=') {
        Some((path, local)) if path.starts_with('/') && !local.is_empty() => {
            Ok((PathBuf::from(path), PathBuf::from(local)))
        }
        _ => Err(format!(
            "expected MOUNT_PATH=LOCAL_PATH with an absolute MOUNT_PATH (as in the pod), got {text:?}"
        )),
    }
}

fn init_logging(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env(LOG_ENV).unwrap_or_else(|_| EnvFilter::new("info"));
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Json => builder.json().flatten_event(true).init(),
        LogFormat::Text => builder.init(),
    }
}

/// The access log's format for `--log-format`.
fn access_format(format: LogFormat) -> trellis::access_log::Format {
    match format {
        LogFormat::Json => trellis::access_log::Format::Json,
        LogFormat::Text => trellis::access_log::Format::Text,
    }
}

use trellis::config::controller::ControllerConfig;

fn check(files: &[PathBuf], mounts: &[(PathBuf, PathBuf)], skip_files: bool) -> ExitCode {
    let referenced = trellis::config::Referenced {
        mounts: trellis::config::Mounts::new(mounts.iter().cloned()),
        skip: skip_files,
        kubeconfig: kubeconfig_loader(),
    };
    let mut ok = true;
    for file in files {
        match trellis::config::check_file(file, &referenced) {
            Ok(checked) => {
                let note = match &checked.file {
                    trellis::config::AnyFile::Node(n) if n.listen.is_empty() => {
                        " (without listen: `trellis node` needs --advertise-address IP to start \
                         with it)"
                    }
                    _ => "",
                };
                println!("{}: valid {}{note}", file.display(), checked.file.kind());
                let mut whys: Vec<&str> = checked.unread.iter().map(|u| u.why).collect();
                whys.sort_unstable();
                whys.dedup();
                for why in whys {
                    let said = match why {
                        trellis::config::SKIPPED => "--skip-files",
                        other => other,
                    };
                    println!("  files it names, not checked ({said}):");
                    for u in checked.unread.iter().filter(|u| u.why == why) {
                        println!("    {}: {}", u.field, u.path.display());
                    }
                }
            }
            Err(e) => {
                ok = false;
                eprintln!("{e}");
            }
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// How `check` loads a kubeconfig: as `trellis controller` and `trellis extension` do at
/// start, into a Kubernetes client (which connects to nothing until asked).
#[cfg(feature = "controller")]
fn kubeconfig_loader() -> Option<&'static trellis::config::LoadKubeconfig> {
    fn load(file: &std::path::Path) -> Result<(), String> {
        use trellis::controller::watch::{WatchError, client};
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("starting the async runtime: {e}"))?;
        let said = match runtime.block_on(client(Some(file))) {
            Ok(_) => return Ok(()),
            // The field is `kubeconfig` already.
            Err(WatchError::Kubeconfig { source, .. }) => source.to_string(),
            Err(e) => e.to_string(),
        };
        // One line per problem: the YAML parser's snippet of the file is left out.
        Err(said.lines().next().unwrap_or_default().to_owned())
    }
    Some(&load)
}

#[cfg(not(feature = "controller"))]
fn kubeconfig_loader() -> Option<&'static trellis::config::LoadKubeconfig> {
    None
}

fn render(
    manifests: &std::path::Path,
    config_file: Option<&std::path::Path>,
    output: Option<&std::path::Path>,
) -> ExitCode {
    let config = match config_file.map(trellis::config::load::<ControllerConfig>) {
        None => ControllerConfig::default(),
        Some(Ok(c)) => c,
        Some(Err(e)) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    match trellis::controller::render(manifests, &config) {
        Ok(rendered) => {
            let table = trellis::controller::to_json(&rendered.table);
            match output {
                None => print!("{table}"),
                Some(file) => {
                    let mut writer = trellis::controller::output::Writer::new(file.to_owned());
                    if let Err(e) = writer.write(&table, &rendered.files) {
                        eprintln!("{e}");
                        return ExitCode::FAILURE;
                    }
                }
            }
            // The report is data for whoever reads it next (a script, a diff): JSON.
            match serde_json::to_string_pretty(&rendered.report) {
                Ok(r) => eprintln!("{r}"),
                Err(e) => eprintln!("report: {e}"),
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(feature = "controller")]
fn controller(config_file: &std::path::Path) -> anyhow::Result<ExitCode> {
    let config = match trellis::config::load::<ControllerConfig>(config_file) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return Ok(ExitCode::FAILURE);
        }
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let result = runtime.block_on(trellis::controller::watch::run(config));
    runtime.shutdown_timeout(std::time::Duration::from_millis(500));
    result?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(not(feature = "controller"))]
fn controller(_config_file: &std::path::Path) -> anyhow::Result<ExitCode> {
    anyhow::bail!(
        "this trellis was built without the `controller` feature: only `trellis controller \
         render` is available"
    )
}

fn gateway(config_file: &std::path::Path) -> anyhow::Result<ExitCode> {
    let mut config =
        match trellis::config::load::<trellis::config::gateway::GatewayConfig>(config_file) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("{e}");
                return Ok(ExitCode::FAILURE);
            }
        };
    // Each worker has its own socket per listener and its own event loop.
    let workers = config.workers.max(1);
    let fixed = trellis::net::fds::Budget::fixed(workers, config.listeners.len());
    config.limits.max_connections = budget(config.limits.max_connections, fixed)?;
    // The control plane (signals, admin, table reloads) runs here; connections run on the
    // gateway's own worker threads.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let result = runtime.block_on(trellis::gateway::run(config));
    // Blocking tasks still running (a table read, a heap trim) must not hold the exit.
    runtime.shutdown_timeout(std::time::Duration::from_millis(500));
    result?;
    Ok(ExitCode::SUCCESS)
}

fn node(
    config_file: &std::path::Path,
    cleanup: bool,
    advertise_address: Option<std::net::IpAddr>,
) -> anyhow::Result<ExitCode> {
    let config = match trellis::config::load::<trellis::config::node::NodeConfig>(config_file) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return Ok(ExitCode::FAILURE);
        }
    };
    // `--cleanup` never listens: without the flag it needs only the file's
    // `interface.address` (and says so when that is missing too).
    let completed = if cleanup && advertise_address.is_none() {
        Ok(config)
    } else {
        config.with_advertise_address(advertise_address)
    };
    let mut config = match completed {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{}: {e}", config_file.display());
            return Ok(ExitCode::FAILURE);
        }
    };
    if !cleanup {
        // One event loop (the runtime's I/O driver) and a socket per listen address.
        let fixed = trellis::net::fds::Budget::fixed(1, config.listen.len());
        config.limits.max_connections = budget(config.limits.max_connections, fixed)?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .worker_threads(2)
        .thread_name("trellis-node")
        .build()
        .context("starting the async runtime")?;
    let result = if cleanup {
        runtime.block_on(trellis::node::cleanup(&config))
    } else {
        runtime.block_on(trellis::node::run(config))
    };
    // Blocking tasks still running must not hold the exit.
    runtime.shutdown_timeout(std::time::Duration::from_millis(500));
    result?;
    Ok(ExitCode::SUCCESS)
}

/// Loads `config_file` as a `K` and runs `role` on it on two worker threads named
/// `threads`, until it returns (SIGTERM/SIGINT, or a failure).
fn run_loaded<K, F, E>(
    config_file: &std::path::Path,
    threads: &str,
    role: impl FnOnce(K) -> F,
) -> anyhow::Result<ExitCode>
where
    K: for<'a> trellis::config::ConfigKind<Context<'a> = ()>,
    F: std::future::Future<Output = Result<(), E>>,
    E: std::error::Error + Send + Sync + 'static,
{
    let config = match trellis::config::load::<K>(config_file) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return Ok(ExitCode::FAILURE);
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .worker_threads(2)
        .thread_name(threads)
        .build()
        .context("starting the async runtime")?;
    let result = runtime.block_on(role(config));
    // Blocking tasks still running (a name lookup, a request to the API server) must not
    // hold the exit.
    runtime.shutdown_timeout(std::time::Duration::from_millis(500));
    result?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(feature = "extension")]
fn extension(config_file: &std::path::Path) -> anyhow::Result<ExitCode> {
    run_loaded(config_file, "trellis-extension", trellis::extension::run)
}

#[cfg(not(feature = "extension"))]
fn extension(_config_file: &std::path::Path) -> anyhow::Result<ExitCode> {
    anyhow::bail!("this trellis was built without the `extension` feature")
}

fn agent(config_file: &std::path::Path) -> anyhow::Result<ExitCode> {
    run_loaded(config_file, "trellis-agent", trellis::agent::run)
}

/// Divides the open-files limit and returns the connections the process can admit:
/// `limits.maxConnections`, or fewer when the limit cannot hold them (said at start).
fn budget(requested: usize, fixed: u64) -> anyhow::Result<usize> {
    let budget = trellis::net::fds::apply(requested, fixed);
    if budget.max_connections == 0 {
        anyhow::bail!(
            "the open files limit ({}) leaves no descriptor for connections: it must be above {}",
            budget.nofile,
            budget.reserve + trellis::net::fds::SOCKETS_PER_CONNECTION
        );
    }
    Ok(budget.max_connections)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    let result = match &cli.command {
        Command::Check {
            files,
            mounts,
            skip_files,
        } => Ok(check(files, mounts, *skip_files)),
        Command::Controller {
            command:
                Some(ControllerCommand::Render {
                    manifests,
                    config,
                    output,
                }),
            ..
        } => Ok(render(manifests, config.as_deref(), output.as_deref())),
        Command::Controller {
            command: None,
            config,
        } => match config {
            Some(config) => controller(config),
            // clap requires `--config` without a subcommand.
            None => Ok(ExitCode::FAILURE),
        },
        Command::Gateway { config } => {
            trellis::access_log::init(access_format(cli.log_format));
            gateway(config)
        }
        Command::Node {
            config,
            cleanup,
            advertise_address,
        } => {
            trellis::access_log::init(access_format(cli.log_format));
            node(config, *cleanup, *advertise_address)
        }
        Command::Agent { config } => {
            trellis::access_log::init(access_format(cli.log_format));
            agent(config)
        }
        Command::Extension { config } => extension(config),
    };
    // Access-log lines still waiting for their writer thread.
    trellis::access_log::flush();
    match result {
        Ok(code) => code,
        Err(e) => {
            let message = render_error(&e);
            if tracing::enabled!(tracing::Level::ERROR) {
                tracing::error!("{message}");
            } else {
                // TRELLIS_LOG filters errors out: a failed start must still say why.
                eprintln!("trellis: {message}");
            }
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes, each said once: a cause whose text its parent's message
/// already includes (`"cannot bind ...: {source}"`) is not repeated.
fn render_error(e: &anyhow::Error) -> String {
    let mut out = String::new();
    let mut parent = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if parent.is_empty() || !parent.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
        parent = text;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::render_error;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot bind: {0}")]
    struct Bind(#[source] std::io::Error);

    #[test]
    fn each_cause_is_said_once() {
        let io = || std::io::Error::other("address in use");
        let e = anyhow::Error::new(Bind(io())).context("starting");
        assert_eq!(render_error(&e), "starting: cannot bind: address in use");
        // A cause whose text only happens to appear in an earlier message is kept.
        let e = anyhow::Error::new(std::io::Error::other("timed out"))
            .context("cannot connect")
            .context("timed out waiting for the table");
        assert_eq!(
            render_error(&e),
            "timed out waiting for the table: cannot connect: timed out"
        );
    }
}
