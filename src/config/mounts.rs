//! Where `trellis check` reads the files a configuration meant for a pod names: each
//! `--mount MOUNT_PATH=LOCAL_PATH` says that what the pod sees at `MOUNT_PATH` (a volume's
//! mount path, or one file's) is at `LOCAL_PATH` here, as a pod's `volumeMounts` do. A file
//! the configuration names is read under the mount whose path holds it (the longest), and
//! the file being checked is taken to be where a mount puts it in the pod, so that names
//! relative to it are resolved in the pod's tree, as the role would resolve them there.
//!
//! Paths are compared as written, made absolute and with `.` and `..` taken away (a mount
//! path is a real directory in the pod, so `config/../keys` is `keys` there too); links are
//! not followed. This module never opens files.

use std::path::{Component, Path, PathBuf};

/// The mounts of `trellis check`, as given.
#[derive(Debug, Clone, Default)]
pub struct Mounts(Vec<Mount>);

/// One `--mount`.
#[derive(Debug, Clone)]
struct Mount {
    /// The path in the pod (absolute), `.` and `..` taken away.
    path: PathBuf,
    /// Where it is here, as given (for the paths read).
    local: PathBuf,
    /// [`Mount::local`] made absolute, `.` and `..` taken away (for comparisons).
    absolute: PathBuf,
}

impl Mounts {
    /// Mounts from `(path in the pod, local path)` pairs; the path in the pod must be
    /// absolute (`--mount` refuses any other).
    pub fn new(mounts: impl IntoIterator<Item = (PathBuf, PathBuf)>) -> Mounts {
        Mounts(
            mounts
                .into_iter()
                .map(|(path, local)| Mount {
                    path: normal(&path),
                    absolute: absolute(&local),
                    local,
                })
                .collect(),
        )
    }

    /// Whether no mount was given.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Where the file at `local` is in the pod: under the path of the mount whose local
    /// path holds it (the longest); `None` when no mount does.
    pub fn in_pod(&self, local: &Path) -> Option<PathBuf> {
        let local = absolute(local);
        self.0
            .iter()
            .filter_map(|m| Some((m, local.strip_prefix(&m.absolute).ok()?)))
            .max_by_key(|(m, _)| m.absolute.components().count())
            .map(|(m, rest)| join(&m.path, rest))
    }

    /// Where a file the pod reads at `path` is read here: under the local path of the mount
    /// whose path holds it (the longest); `None` when no mount does (the file is read where
    /// `path` says).
    pub fn local(&self, path: &Path) -> Option<PathBuf> {
        let path = normal(path);
        self.0
            .iter()
            .filter_map(|m| Some((m, path.strip_prefix(&m.path).ok()?)))
            .max_by_key(|(m, _)| m.path.components().count())
            .map(|(m, rest)| join(&m.local, rest))
    }
}

/// `base/rest`, or `base` itself for an empty `rest` (a mount of one file).
fn join(base: &Path, rest: &Path) -> PathBuf {
    if rest.as_os_str().is_empty() {
        base.to_owned()
    } else {
        base.join(rest)
    }
}

/// `path` made absolute (against the working directory), `.` and `..` taken away.
fn absolute(path: &Path) -> PathBuf {
    normal(&std::path::absolute(path).unwrap_or_else(|_| path.to_owned()))
}

/// `path` without `.` and `..` components (`..` takes the component before it away; at the
/// root it stays there).
pub(super) fn normal(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                if !out.pop() && !out.has_root() {
                    out.push("..");
                }
            }
            other => out.push(other),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mounts(list: &[(&str, &str)]) -> Mounts {
        Mounts::new(
            list.iter()
                .map(|(p, l)| (PathBuf::from(p), PathBuf::from(l))),
        )
    }

    #[test]
    fn the_longest_mount_holding_a_path_wins() {
        let m = mounts(&[
            ("/etc/trellis", "/tmp/root"),
            ("/etc/trellis/tls", "/tmp/tls"),
            ("/etc/trellis/agent.key", "/tmp/keys/a.key"),
        ]);
        let local = |p: &str| m.local(Path::new(p)).map(|p| p.display().to_string());
        assert_eq!(
            local("/etc/trellis/tls/ca.crt").as_deref(),
            Some("/tmp/tls/ca.crt")
        );
        assert_eq!(
            local("/etc/trellis/config/../routes/r.json").as_deref(),
            Some("/tmp/root/routes/r.json")
        );
        assert_eq!(
            local("/etc/trellis/agent.key").as_deref(),
            Some("/tmp/keys/a.key")
        );
        // Components, not characters: /etc/trellis-other is not under /etc/trellis.
        assert_eq!(local("/etc/trellis-other/x"), None);
        assert_eq!(local("/etc/trellis/tls/../../x").as_deref(), None);
        assert_eq!(local("relative/x"), None);
    }

    #[test]
    fn a_file_in_a_mount_is_where_the_mount_puts_it_in_the_pod() {
        let m = mounts(&[
            ("/etc/trellis/config", "/work/deploy/seed"),
            (
                "/etc/trellis/config/agent.yaml",
                "/work/deploy/agent/a-0.yaml",
            ),
        ]);
        let pod = |p: &str| m.in_pod(Path::new(p)).map(|p| p.display().to_string());
        assert_eq!(
            pod("/work/deploy/seed/./gateway.yaml").as_deref(),
            Some("/etc/trellis/config/gateway.yaml")
        );
        assert_eq!(
            pod("/work/deploy/agent/a-0.yaml").as_deref(),
            Some("/etc/trellis/config/agent.yaml")
        );
        assert_eq!(pod("/work/deploy/seedling/gateway.yaml"), None);
        assert_eq!(normal(Path::new("../a/./b/../c")), PathBuf::from("../a/c"));
        assert_eq!(normal(Path::new("/../a")), PathBuf::from("/a"));
    }
}
