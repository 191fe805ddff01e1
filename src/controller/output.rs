//! Writes what a translation rendered where a gateway reads it: the table file, and the
//! egress TLS files it names in the same directory. Each file goes to a temporary file beside
//! it that is renamed over it, so a reader sees the old bytes or the new ones, never a part;
//! each is written only when its bytes changed; the files first, then the table that names
//! them, then the egress files no table names any more are removed. Used by the live
//! controller ([`super::watch`]) and by `trellis controller render --output`. This is the
//! controller's only file I/O; it never reads the API.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use thiserror::Error;

use super::model::SecretBytes;
use super::tunnel::{EgressFile, Files};

/// Why a write did not complete (what was written before stays; the next write retries).
#[derive(Debug, Error)]
pub enum WriteError {
    /// A file could not be written or renamed into place.
    #[error("writing {}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The directory could not be listed (for egress files left by an earlier run).
    #[error("listing {}: {source}", path.display())]
    List {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// What one write did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Written {
    /// The table file was written (its bytes changed).
    pub table: bool,
    /// Egress files written (new, or changed).
    pub files: usize,
    /// Egress files removed (no longer named).
    pub removed: usize,
}

impl Written {
    /// Whether anything on disk changed.
    pub fn changed(&self) -> bool {
        self.table || self.files > 0 || self.removed > 0
    }
}

/// The table file and its egress files, as last written.
#[derive(Debug)]
pub struct Writer {
    /// The table file.
    table: PathBuf,
    /// Its directory, where the egress files are.
    dir: PathBuf,
    /// The table's bytes as last written; `None` before the first write.
    last_table: Option<String>,
    /// Each egress file on disk, by name, with its bytes (shared with the rendered files
    /// they were written from, so an unchanged file compares by pointer); `None` until the
    /// directory was read (the first write: files an earlier run left are compared, not
    /// rewritten, and those no table names are removed).
    files: Option<BTreeMap<String, SecretBytes>>,
}

impl Writer {
    /// A writer of the table `table` (its egress files beside it).
    pub fn new(table: PathBuf) -> Writer {
        let dir = match table.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
            _ => PathBuf::from("."),
        };
        Writer {
            table,
            dir,
            last_table: None,
            files: None,
        }
    }

    /// The table file.
    pub fn path(&self) -> &Path {
        &self.table
    }

    /// Writes the table `json` and its `files`: the files whose bytes changed, then the table
    /// if its bytes changed, then removes the egress files `files` does not name.
    pub fn write(&mut self, json: &str, files: &Files) -> Result<Written, WriteError> {
        let mut on_disk = match self.files.take() {
            Some(known) => known,
            None => self.read_dir()?,
        };
        let result = self.write_all(json, files, &mut on_disk);
        self.files = Some(on_disk);
        result
    }

    fn write_all(
        &mut self,
        json: &str,
        files: &Files,
        on_disk: &mut BTreeMap<String, SecretBytes>,
    ) -> Result<Written, WriteError> {
        let mut written = Written::default();
        for (name, bytes) in files {
            if on_disk.get(name) == Some(bytes) {
                continue;
            }
            let private = EgressFile::of(name).is_some_and(EgressFile::is_private);
            let path = self.dir.join(name);
            write_atomic(&path, bytes.as_bytes(), if private { 0o600 } else { 0o644 })
                .map_err(|source| WriteError::Write { path, source })?;
            on_disk.insert(name.clone(), bytes.clone());
            written.files += 1;
        }
        if self.last_table.as_deref() != Some(json) {
            write_atomic(&self.table, json.as_bytes(), 0o644).map_err(|source| {
                WriteError::Write {
                    path: self.table.clone(),
                    source,
                }
            })?;
            self.last_table = Some(json.to_owned());
            written.table = true;
        }
        let stale: Vec<String> = on_disk
            .keys()
            .filter(|name| !files.contains_key(*name))
            .cloned()
            .collect();
        for name in stale {
            let path = self.dir.join(&name);
            match std::fs::remove_file(&path) {
                Ok(()) => written.removed += 1,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => return Err(WriteError::Write { path, source }),
            }
            on_disk.remove(&name);
        }
        Ok(written)
    }

    /// The egress files in the directory now, with their bytes.
    fn read_dir(&self) -> Result<BTreeMap<String, SecretBytes>, WriteError> {
        let list = |source| WriteError::List {
            path: self.dir.clone(),
            source,
        };
        let mut found = BTreeMap::new();
        for entry in std::fs::read_dir(&self.dir).map_err(list)? {
            let entry = entry.map_err(list)?;
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            if EgressFile::of(&name).is_none() {
                continue;
            }
            // Unreadable: rewritten (no rendered file is empty).
            let bytes = std::fs::read(entry.path()).unwrap_or_default();
            found.insert(name, SecretBytes::from(bytes));
        }
        Ok(found)
    }
}

/// Writes `bytes` to a temporary file beside `path` (created with `mode`) and renames it
/// over `path`, so a reader sees the old bytes or the new ones, never a part.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = super::temporary_file(path);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .and_then(|mut f| f.write_all(bytes))
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Dir(PathBuf);

    impl Dir {
        fn new(name: &str) -> Dir {
            let dir =
                std::env::temp_dir().join(format!("trellis-output-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Dir(dir)
        }

        fn names(&self) -> Vec<String> {
            let mut names: Vec<String> = std::fs::read_dir(&self.0)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            names
        }

        /// A file's inode and modification time: what a rewrite (a rename) changes.
        fn stamp(&self, name: &str) -> (u64, std::time::SystemTime) {
            use std::os::unix::fs::MetadataExt;
            let m = std::fs::metadata(self.0.join(name)).unwrap();
            (m.ino(), m.modified().unwrap())
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn files(list: &[(&str, &str)]) -> Files {
        list.iter()
            .map(|(n, b)| ((*n).to_owned(), SecretBytes::from(b.as_bytes().to_vec())))
            .collect()
    }

    #[test]
    fn files_are_written_when_changed_and_removed_when_no_longer_named() {
        let dir = Dir::new("files");
        std::fs::write(dir.0.join("unrelated.txt"), "kept").unwrap();
        let mut w = Writer::new(dir.0.join("routes.json"));
        let first = files(&[
            ("egress.a.crt", "A cert"),
            ("egress.a.key", "A key"),
            ("egress.a.ca.crt", "A ca"),
        ]);
        let done = w.write("{1}", &first).unwrap();
        assert_eq!(
            done,
            Written {
                table: true,
                files: 3,
                removed: 0
            }
        );
        assert_eq!(
            dir.names(),
            [
                "egress.a.ca.crt",
                "egress.a.crt",
                "egress.a.key",
                "routes.json",
                "unrelated.txt"
            ]
        );
        use std::os::unix::fs::PermissionsExt;
        let mode = |n: &str| {
            std::fs::metadata(dir.0.join(n))
                .unwrap()
                .permissions()
                .mode()
                & 0o777
        };
        assert_eq!(mode("egress.a.key"), 0o600);
        assert_eq!(mode("egress.a.crt"), 0o644);
        // Nothing changed: nothing is rewritten.
        let stamps: Vec<_> = ["egress.a.crt", "egress.a.key", "routes.json"]
            .map(|n| dir.stamp(n))
            .to_vec();
        assert_eq!(w.write("{1}", &first).unwrap(), Written::default());
        let again: Vec<_> = ["egress.a.crt", "egress.a.key", "routes.json"]
            .map(|n| dir.stamp(n))
            .to_vec();
        assert_eq!(stamps, again);
        // A rotated certificate: that file alone, the table unchanged.
        let rotated = files(&[
            ("egress.a.crt", "A cert 2"),
            ("egress.a.key", "A key"),
            ("egress.a.ca.crt", "A ca"),
        ]);
        assert_eq!(
            w.write("{1}", &rotated).unwrap(),
            Written {
                table: false,
                files: 1,
                removed: 0
            }
        );
        assert_eq!(
            std::fs::read_to_string(dir.0.join("egress.a.crt")).unwrap(),
            "A cert 2"
        );
        assert_eq!(dir.stamp("egress.a.key"), stamps[1]);
        // Shoot a gone, b new: b's files, the table, then a's removed.
        let b = files(&[
            ("egress.b.crt", "B"),
            ("egress.b.key", "B"),
            ("egress.b.ca.crt", "B"),
        ]);
        assert_eq!(
            w.write("{2}", &b).unwrap(),
            Written {
                table: true,
                files: 3,
                removed: 3
            }
        );
        assert_eq!(
            dir.names(),
            [
                "egress.b.ca.crt",
                "egress.b.crt",
                "egress.b.key",
                "routes.json",
                "unrelated.txt"
            ]
        );
    }

    /// A new writer (a restarted controller) compares the files an earlier run left instead of
    /// rewriting them, and removes those no table names.
    #[test]
    fn a_restarted_writer_keeps_unchanged_files_and_removes_stale_ones() {
        let dir = Dir::new("restart");
        let kept = files(&[
            ("egress.a.crt", "A"),
            ("egress.a.key", "A"),
            ("egress.a.ca.crt", "A"),
        ]);
        Writer::new(dir.0.join("routes.json"))
            .write("{1}", &kept)
            .unwrap();
        std::fs::write(dir.0.join("egress.gone.key"), "old").unwrap();
        let stamp = dir.stamp("egress.a.key");
        let mut w = Writer::new(dir.0.join("routes.json"));
        let done = w.write("{1}", &kept).unwrap();
        assert_eq!(
            done,
            Written {
                table: true,
                files: 0,
                removed: 1
            }
        );
        assert_eq!(dir.stamp("egress.a.key"), stamp);
        assert!(!dir.0.join("egress.gone.key").exists());
    }

    #[test]
    fn a_failed_write_leaves_no_temporary_file_and_is_retried() {
        let dir = Dir::new("fail");
        let mut w = Writer::new(dir.0.join("missing").join("routes.json"));
        assert!(w.write("{1}", &Files::new()).is_err());
        std::fs::create_dir(dir.0.join("missing")).unwrap();
        let done = w.write("{1}", &files(&[("egress.a.crt", "A")])).unwrap();
        assert_eq!(
            done,
            Written {
                table: true,
                files: 1,
                removed: 0
            }
        );
        let mut names: Vec<String> = std::fs::read_dir(dir.0.join("missing"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["egress.a.crt", "routes.json"]);
    }
}
