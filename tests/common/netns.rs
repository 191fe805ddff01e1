//! Network namespaces for tests that need root: created per test, removed on drop, with the
//! processes started in them.

use std::path::Path;
use std::process::{Child, Command, Stdio};

use super::TestDir;

/// Namespaces, processes and files of one test; all removed on drop.
pub(crate) struct Lab {
    pub namespaces: Vec<String>,
    pub children: Vec<Child>,
    pub dir: TestDir,
}

impl Drop for Lab {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for ns in &self.namespaces {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
            let _ = std::fs::remove_dir_all(format!("/etc/netns/{ns}"));
        }
    }
}

/// Why namespace tests cannot run here, if they cannot.
pub(crate) fn skip_reason(tools: &[&str]) -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("not root".into());
    }
    for tool in tools.iter().chain(&["ip"]) {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .stdout(Stdio::null())
            .status();
        if !found.is_ok_and(|s| s.success()) {
            return Some(format!(
                "{tool} is not installed (scripts/test installs it)"
            ));
        }
    }
    None
}

fn ok(c: &mut Command) -> bool {
    c.stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

impl Lab {
    /// Creates namespaces named `trellis-<name>-<pid>` with `lo` up.
    pub(crate) fn new(names: &[&str]) -> Lab {
        let id = std::process::id() % 100_000;
        let lab = Lab {
            namespaces: names.iter().map(|n| format!("trellis-{n}-{id}")).collect(),
            children: Vec::new(),
            dir: TestDir::new("netns"),
        };
        for ns in &lab.namespaces {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
            assert!(
                ok(Command::new("ip").args(["netns", "add", ns])),
                "ip netns add {ns}"
            );
            assert!(lab.sh(ns, &["ip", "link", "set", "lo", "up"]));
        }
        lab
    }

    /// The full name of namespace `i`.
    pub(crate) fn ns(&self, i: usize) -> String {
        self.namespaces[i].clone()
    }

    /// Joins namespaces `a` and `b` with a veth pair; `addr_a`/`addr_b` are CIDRs.
    pub(crate) fn veth(&self, a: usize, addr_a: &str, b: usize, addr_b: &str) {
        let id = std::process::id() % 100_000;
        let (va, vb) = (format!("tv{a}{id}"), format!("tv{b}{id}x"));
        assert!(ok(Command::new("ip").args([
            "link",
            "add",
            &va,
            "netns",
            &self.namespaces[a],
            "type",
            "veth",
            "peer",
            "name",
            &vb,
            "netns",
            &self.namespaces[b]
        ])));
        for (ns, dev, addr) in [
            (&self.namespaces[a], &va, addr_a),
            (&self.namespaces[b], &vb, addr_b),
        ] {
            assert!(self.sh(ns, &["ip", "addr", "add", addr, "dev", dev]));
            assert!(self.sh(ns, &["ip", "link", "set", dev, "up"]));
        }
    }

    /// Makes `name` resolve to `ip` inside namespace `ns` (`ip netns exec` bind-mounts it).
    pub(crate) fn hosts(&self, ns: &str, entries: &str) {
        std::fs::create_dir_all(format!("/etc/netns/{ns}")).unwrap();
        std::fs::write(format!("/etc/netns/{ns}/hosts"), entries).unwrap();
    }

    pub(crate) fn exec(&self, ns: &str, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns]).args(args);
        c
    }

    /// Runs a command in `ns`; true if it succeeded.
    pub(crate) fn sh(&self, ns: &str, args: &[&str]) -> bool {
        ok(&mut self.exec(ns, args))
    }

    /// Runs a command in `ns` and returns its stdout.
    pub(crate) fn output(&self, ns: &str, args: &[&str]) -> String {
        let out = self.exec(ns, args).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Starts a long-running process in `ns`, logging to `log`; returns its index.
    pub(crate) fn spawn(&mut self, ns: &str, args: &[&str], log: &Path) -> usize {
        let log = std::fs::File::create(log).unwrap();
        let child = self
            .exec(ns, args)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.children.push(child);
        self.children.len() - 1
    }

    /// Starts `trellis <role> --config <config>` (JSON logs) in `ns`, logging to `log`.
    pub(crate) fn spawn_trellis(
        &mut self,
        ns: &str,
        role: &str,
        config: &Path,
        log: &Path,
    ) -> usize {
        let config = config.to_str().unwrap();
        let args = [super::BIN, "--log-format", "json", role, "--config", config];
        self.spawn(ns, &args, log)
    }

    /// GET `http://addr/path` from inside `ns`.
    pub(crate) fn http_get(&self, ns: &str, addr: &str, path: &str) -> (u16, String) {
        let out = self.output(
            ns,
            &[
                "curl",
                "-s",
                "-w",
                "\n%{http_code}",
                &format!("http://{addr}{path}"),
            ],
        );
        let (body, code) = out.rsplit_once('\n').unwrap_or(("", "0"));
        (code.trim().parse().unwrap_or(0), body.to_string())
    }
}
