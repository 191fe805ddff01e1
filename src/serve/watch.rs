//! Files re-read when they change: the routing table, and any file a role reloads in place.
//!
//! [`Watched`] wakes its owner when its files may have changed — an event in one of their
//! directories (a ConfigMap or Secret volume swaps a `..data` symlink there), SIGHUP, or a
//! periodic re-read — and [`DirWatches`] lets any number of such groups share one
//! file-system watcher. What to read is decided by a file's [`Stamp`]: a directory event
//! reads a file only when its stamp moved or cannot be trusted yet (the coarse-timestamp
//! rule), while SIGHUP and the period always read. [`Tracked`] applies that rule to one file.
//!
//! This module never parses what it reads: a bad file is its consumer's business (keep the
//! last good version, log, count).

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use tokio::sync::{mpsc, watch};

/// The wall clock, injected so the stamp's racy-window rule is tested without sleeping.
pub(crate) type Clock = Arc<dyn Fn() -> SystemTime + Send + Sync>;

/// Why watched files are looked at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Trigger {
    /// SIGHUP: an operator asked; files are read whatever their stamps say.
    Hup,
    /// An event in a watched directory: a file is read only if its stamp moved.
    Watch,
    /// The periodic re-read: files are read whatever their stamps say.
    Timer,
}

impl Trigger {
    /// The log field.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Trigger::Hup => "sighup",
            Trigger::Watch => "watch",
            Trigger::Timer => "timer",
        }
    }
}

/// How long a burst of directory events (write, rename, symlink swap) may take to settle
/// before the files are looked at.
const SETTLE: Duration = Duration::from_millis(50);

/// Identifies one version of a file without reading it, as git's index does: the file
/// behind every symlink (device, inode), its size, and its modification and change times.
/// Any write moves the change time (short of the clock stepping back), and a ConfigMap
/// update swaps the symlink to a new inode. Only directory events use it: the periodic check
/// and SIGHUP always read, so a change a stamp cannot show (a network file system's cached
/// attributes, a clock stepped back on a file system with coarse times) is still found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stamp {
    /// The device of the file behind every symlink.
    pub(crate) dev: u64,
    /// Its inode.
    pub(crate) ino: u64,
    /// Its size in bytes.
    pub(crate) len: u64,
    /// Its modification time (seconds, nanoseconds).
    pub(crate) mtime: (i64, i64),
    /// Its change time (seconds, nanoseconds).
    pub(crate) ctime: (i64, i64),
}

/// A file changed this recently may change again within the file system's timestamp
/// granularity (a clock tick) without its stamp changing; its stamp is not trusted.
pub(crate) const RACY_STAMP: Duration = Duration::from_secs(1);

impl Stamp {
    /// The file's stamp at `now`, or `None` if it cannot be had or trusted (then it is
    /// read).
    pub(crate) fn of(file: &Path, now: SystemTime) -> Option<Stamp> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(file).ok()?;
        let changed = SystemTime::UNIX_EPOCH
            + Duration::new(u64::try_from(m.ctime()).ok()?, m.ctime_nsec() as u32);
        if now.duration_since(changed).unwrap_or_default() < RACY_STAMP {
            return None;
        }
        Some(Stamp {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        })
    }
}

/// One file and the stamp it had when it was last read.
#[derive(Debug, Clone)]
pub(crate) struct Tracked {
    /// The file, as configured (symlinks are followed when it is read).
    path: PathBuf,
    /// Its stamp at the last read, when that could be trusted.
    read: Option<Stamp>,
}

impl Tracked {
    /// A file not read yet.
    pub(crate) fn new(path: impl Into<PathBuf>) -> Tracked {
        Tracked {
            path: path.into(),
            read: None,
        }
    }

    /// Whether a directory event can skip this file: its stamp at `now` is trusted and the
    /// one it had when last read.
    pub(crate) fn unchanged(&self, now: SystemTime) -> bool {
        let stamp = Stamp::of(&self.path, now);
        stamp.is_some() && stamp == self.read
    }

    /// Reads the file with `read` for `trigger`, unless the trigger is a directory event and
    /// the file is [`unchanged`](Tracked::unchanged) (`None`: nothing was read).
    pub(crate) fn read<T>(
        &mut self,
        trigger: Trigger,
        now: SystemTime,
        read: impl FnOnce(&Path) -> T,
    ) -> Option<T> {
        if trigger == Trigger::Watch && self.unchanged(now) {
            return None;
        }
        Some(self.read_now(now, read))
    }

    /// Reads the file with `read` whatever its stamp says, and remembers the stamp.
    pub(crate) fn read_now<T>(&mut self, now: SystemTime, read: impl FnOnce(&Path) -> T) -> T {
        // Taken before the read: a write after it changes the stamp, so it is read next time.
        let stamp = Stamp::of(&self.path, now);
        let out = read(&self.path);
        // Kept whatever the read returned: a file that cannot be read (or is too large) is
        // not re-read on every event until its stamp changes.
        self.read = stamp;
        out
    }
}

/// The file-system watcher shared by every [`Watched`] group of a process: one inotify
/// instance (and notify's one thread) however many groups there are, each directory watched
/// once for as long as a group needs it, and every event handed to the groups of its
/// directory only. Cheap to clone.
#[derive(Clone)]
pub(crate) struct DirWatches {
    /// Shared with every clone.
    inner: Arc<Inner>,
}

/// What [`DirWatches`] share.
struct Inner {
    /// The watcher, or why it could not be made (groups then rely on SIGHUP and the periodic
    /// re-read). Locked before `dirs` whenever both are, and held while directories are
    /// added and removed, so that those are applied in order.
    notify: Mutex<Result<notify::RecommendedWatcher, String>>,
    /// The watched directories (absolute, normalised) and the groups each wakes. The
    /// watcher's callback locks it, so it is never held while the watcher is called: adding
    /// a watch waits for the watcher's thread, which may be waiting for this lock.
    dirs: Arc<Mutex<HashMap<PathBuf, Dir>>>,
    /// The next group's identity.
    next_id: AtomicU64,
}

/// One watched directory.
#[derive(Default)]
struct Dir {
    /// Whether the watcher watches it (adding the watch may have failed).
    watching: bool,
    /// The groups it wakes: identity and wake-up channel.
    groups: Vec<(u64, mpsc::Sender<()>)>,
}

/// Locks a mutex whose data stays usable if a holder panicked.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `dir` as the watcher reports it: absolute, `.` components dropped.
fn dir_key(dir: &Path) -> PathBuf {
    let dir = if dir.is_absolute() {
        dir.to_owned()
    } else {
        std::env::current_dir().unwrap_or_default().join(dir)
    };
    dir.components().collect()
}

/// The directory watched for `file`.
fn dir_of(file: &Path) -> PathBuf {
    match file.parent() {
        Some(p) if !p.as_os_str().is_empty() => dir_key(p),
        _ => dir_key(Path::new(".")),
    }
}

impl DirWatches {
    /// A watcher for every group to share; if the system refuses one (inotify limits), groups
    /// still wake on SIGHUP and their period, and say so when they start.
    pub(crate) fn new() -> DirWatches {
        let dirs: Arc<Mutex<HashMap<PathBuf, Dir>>> = Arc::default();
        let routed = dirs.clone();
        let watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            if let Ok(ev) = res
                && !ev.kind.is_access()
            {
                wake(&lock(&routed), &ev.paths);
            }
        })
        .map_err(|e| e.to_string());
        DirWatches {
            inner: Arc::new(Inner {
                notify: Mutex::new(watcher),
                dirs,
                next_id: AtomicU64::new(0),
            }),
        }
    }

    /// Adds group `id` to the directory `dir`, watching it if nobody did.
    fn subscribe(&self, dir: &Path, id: u64, tx: &mpsc::Sender<()>, what: &str) {
        use notify::Watcher;
        let mut notify = lock(&self.inner.notify);
        let watching = {
            let mut dirs = lock(&self.inner.dirs);
            let d = dirs.entry(dir.to_owned()).or_default();
            d.groups.push((id, tx.clone()));
            d.watching
        };
        if watching {
            return;
        }
        let added = match &mut *notify {
            Ok(w) => w
                .watch(dir, notify::RecursiveMode::NonRecursive)
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.clone()),
        };
        match added {
            Ok(()) => {
                if let Some(d) = lock(&self.inner.dirs).get_mut(dir) {
                    d.watching = true;
                }
            }
            Err(error) => tracing::warn!(
                error,
                dir = %dir.display(),
                "cannot watch the {what} directory; relying on SIGHUP and the periodic check"
            ),
        }
    }

    /// Removes group `id` from the directory `dir`, unwatching it if nobody is left.
    fn unsubscribe(&self, dir: &Path, id: u64) {
        use notify::Watcher;
        let mut notify = lock(&self.inner.notify);
        let unwatch = {
            let mut dirs = lock(&self.inner.dirs);
            let Some(d) = dirs.get_mut(dir) else {
                return;
            };
            d.groups.retain(|(g, _)| *g != id);
            if !d.groups.is_empty() {
                return;
            }
            dirs.remove(dir).is_some_and(|d| d.watching)
        };
        if unwatch && let Ok(w) = &mut *notify {
            // A directory already gone has no watch left to remove.
            let _ = w.unwatch(dir);
        }
    }

    /// How many directories are watched or wanted (for tests).
    #[cfg(test)]
    fn dirs(&self) -> usize {
        lock(&self.inner.dirs).len()
    }
}

/// Wakes the groups of the directories an event names: the directory of each path, or the
/// path itself when the directory is what changed (removed, moved); every group when the
/// event names no path (the watcher lost events and asks for a rescan).
fn wake(dirs: &HashMap<PathBuf, Dir>, paths: &[PathBuf]) {
    let ping = |d: &Dir| {
        for (_, tx) in &d.groups {
            // A full channel already holds a pending wake-up.
            let _ = tx.try_send(());
        }
    };
    if paths.is_empty() {
        dirs.values().for_each(ping);
        return;
    }
    for path in paths {
        let parent = path.parent().map(|p| p.components().collect::<PathBuf>());
        let own = path.components().collect::<PathBuf>();
        for key in parent.iter().chain([&own]) {
            if let Some(d) = dirs.get(key) {
                ping(d);
            }
        }
    }
}

/// A group of watched files: [`Watched::next`] says when to look at them again. Its
/// directories are watched through a shared [`DirWatches`] and unwatched when it is dropped
/// or its files are replaced ([`Watched::set_files`]).
pub(crate) struct Watched {
    /// The shared watcher.
    watches: DirWatches,
    /// This group's identity in it.
    id: u64,
    /// What the files are, for logs (`routing table`).
    what: &'static str,
    /// The directories this group is subscribed to.
    dirs: BTreeSet<PathBuf>,
    /// Wake-ups from the watcher (one pending at most).
    events: mpsc::Receiver<()>,
    /// The sending side, handed to the directories this group subscribes to.
    tx: mpsc::Sender<()>,
    /// Changes on every SIGHUP.
    hup: watch::Receiver<()>,
    /// The periodic re-read.
    tick: tokio::time::Interval,
    /// A directory event arrived and its burst has not settled yet (kept when
    /// [`Watched::next`] is cancelled while it waits).
    pending: bool,
}

impl Watched {
    /// Watches the directories of `files`; `what` names them in logs. `hup` changes on every
    /// SIGHUP (the signal loop calls `send_replace(())` on its sender; a signal it has not
    /// seen yet counts); `interval` is the period of the unconditional re-read, the first one
    /// an `interval` from now. Call it inside a tokio runtime.
    pub(crate) fn new<'a>(
        watches: &DirWatches,
        what: &'static str,
        files: impl IntoIterator<Item = &'a Path>,
        interval: Duration,
        hup: watch::Receiver<()>,
    ) -> Watched {
        let (tx, events) = mpsc::channel(1);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut w = Watched {
            watches: watches.clone(),
            id: watches.inner.next_id.fetch_add(1, Ordering::Relaxed),
            what,
            dirs: BTreeSet::new(),
            events,
            tx,
            hup,
            tick,
            pending: false,
        };
        w.set_files(files);
        w
    }

    /// Watches the directories of `files` instead of the current ones (directories in both
    /// stay watched without a gap).
    pub(crate) fn set_files<'a>(&mut self, files: impl IntoIterator<Item = &'a Path>) {
        let dirs: BTreeSet<PathBuf> = files.into_iter().map(dir_of).collect();
        for gone in self.dirs.difference(&dirs) {
            self.watches.unsubscribe(gone, self.id);
        }
        for new in dirs.difference(&self.dirs) {
            self.watches.subscribe(new, self.id, &self.tx, self.what);
        }
        self.dirs = dirs;
    }

    /// Waits for the next reason to look at the files: a directory event (after
    /// [`SETTLE`], with the rest of its burst), SIGHUP, or the period. Cancel-safe: an event
    /// received before a cancellation is reported by the next call.
    pub(crate) async fn next(&mut self) -> Trigger {
        if !self.pending {
            tokio::select! {
                Some(()) = self.events.recv() => self.pending = true,
                Ok(()) = self.hup.changed() => return Trigger::Hup,
                _ = self.tick.tick() => return Trigger::Timer,
            }
        }
        // Let a burst of events (write, rename, symlink swap) settle.
        tokio::time::sleep(SETTLE).await;
        while self.events.try_recv().is_ok() {}
        self.pending = false;
        Trigger::Watch
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        for dir in std::mem::take(&mut self.dirs) {
            self.watches.unsubscribe(&dir, self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory for one test, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> TempDir {
            let dir =
                std::env::temp_dir().join(format!("trellis-watch-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn read(p: &Path) -> std::io::Result<Vec<u8>> {
        std::fs::read(p)
    }

    /// The next trigger, within a time limit.
    async fn next(w: &mut Watched) -> Trigger {
        tokio::time::timeout(Duration::from_secs(10), w.next())
            .await
            .expect("a wake-up within 10 s")
    }

    fn hup() -> (watch::Sender<()>, watch::Receiver<()>) {
        watch::channel(())
    }

    const HOUR: Duration = Duration::from_secs(3600);

    /// A file changed within the racy window is read on every directory event, as a
    /// second write in the same clock tick may leave its stamp as it was; once the window
    /// has passed, events skip it until it changes, while SIGHUP and the period still read.
    #[test]
    fn a_change_within_the_timestamp_granularity_is_read_again() {
        let dir = TempDir::new("racy");
        let file = dir.0.join("tls.crt");
        std::fs::write(&file, "one").unwrap();
        let now = SystemTime::now();
        let mut t = Tracked::new(&file);
        assert_eq!(t.read(Trigger::Watch, now, read).unwrap().unwrap(), b"one");
        // Same second: nothing about the file moved, yet it is read again.
        assert!(t.read(Trigger::Watch, now, read).is_some());
        assert!(!t.unchanged(now));
        let later = now + RACY_STAMP + Duration::from_millis(100);
        assert!(
            t.read(Trigger::Watch, later, read).is_some(),
            "takes the stamp"
        );
        assert!(t.unchanged(later));
        assert!(t.read(Trigger::Watch, later, read).is_none());
        assert!(t.read(Trigger::Timer, later, read).is_some());
        assert!(t.read(Trigger::Hup, later, read).is_some());
        // Rewritten in place with the same size and the same modification time (a file
        // system with coarse times): the change time still moves.
        let mtime = std::fs::metadata(&file).unwrap().modified().unwrap();
        std::fs::write(&file, "two").unwrap();
        std::fs::File::options()
            .write(true)
            .open(&file)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        let much_later = later + RACY_STAMP * 10;
        let got = t.read(Trigger::Watch, much_later, read);
        assert_eq!(got.unwrap().unwrap(), b"two");
        assert!(t.read(Trigger::Watch, much_later, read).is_none());
    }

    /// A missing file is read (and fails) on every event until it exists: no stamp to trust.
    #[test]
    fn a_missing_file_is_read_on_every_event() {
        let dir = TempDir::new("missing");
        let mut t = Tracked::new(dir.0.join("absent"));
        let later = SystemTime::now() + HOUR;
        assert!(t.read(Trigger::Watch, later, read).unwrap().is_err());
        assert!(t.read(Trigger::Watch, later, read).unwrap().is_err());
    }

    /// A file rewritten in place wakes its owner, which reads the new bytes.
    #[tokio::test]
    async fn a_rewritten_file_wakes_its_owner() {
        let dir = TempDir::new("rewrite");
        let file = dir.0.join("ca.crt");
        std::fs::write(&file, "ca 1").unwrap();
        let watches = DirWatches::new();
        let (_hup_tx, hup_rx) = hup();
        let mut w = Watched::new(&watches, "test", [file.as_path()], HOUR, hup_rx);
        let mut t = Tracked::new(&file);
        assert_eq!(t.read_now(SystemTime::now(), read).unwrap(), b"ca 1");

        std::fs::write(&file, "ca 2").unwrap();
        assert_eq!(next(&mut w).await, Trigger::Watch);
        assert_eq!(t.read_now(SystemTime::now(), read).unwrap(), b"ca 2");
    }

    /// A ConfigMap or Secret volume: `tls.crt` -> `..data/tls.crt`, `..data` -> a timestamped
    /// directory, swapped by renaming a new `..data` symlink over the old one. The owner
    /// wakes, the file's trusted stamp has moved, and it reads the new version through the
    /// same path.
    #[tokio::test]
    async fn a_configmap_style_symlink_swap_wakes_its_owner() {
        let dir = TempDir::new("swap");
        let d = &dir.0;
        std::fs::create_dir(d.join("..v1")).unwrap();
        std::fs::write(d.join("..v1/tls.crt"), "cert 1").unwrap();
        std::os::unix::fs::symlink("..v1", d.join("..data")).unwrap();
        std::os::unix::fs::symlink("..data/tls.crt", d.join("tls.crt")).unwrap();
        let file = d.join("tls.crt");
        let watches = DirWatches::new();
        let (_hup_tx, hup_rx) = hup();
        let mut w = Watched::new(&watches, "test", [file.as_path()], HOUR, hup_rx);
        let mut t = Tracked::new(&file);
        // Trusted stamps from here on (a clock an hour ahead): only a new inode moves them.
        let mut clock = SystemTime::now() + HOUR;
        assert_eq!(t.read_now(clock, read).unwrap(), b"cert 1");
        assert!(t.unchanged(clock));

        std::fs::create_dir(d.join("..v2")).unwrap();
        // The same size, so that only the inode tells the versions apart.
        std::fs::write(d.join("..v2/tls.crt"), "cert 2").unwrap();
        std::os::unix::fs::symlink("..v2", d.join("..data_tmp")).unwrap();
        std::fs::rename(d.join("..data_tmp"), d.join("..data")).unwrap();
        std::fs::remove_dir_all(d.join("..v1")).unwrap();

        assert_eq!(next(&mut w).await, Trigger::Watch);
        clock += HOUR;
        assert!(!t.unchanged(clock), "the swap moves the stamp");
        assert_eq!(t.read_now(clock, read).unwrap(), b"cert 2");
    }

    /// Groups sharing one watcher are woken for their own directories only; replacing a
    /// group's files moves its watches; dropping it unwatches what nobody else needs.
    #[tokio::test]
    async fn groups_share_one_watcher_and_wake_for_their_own_directories() {
        let (a, b, c) = (
            TempDir::new("share-a"),
            TempDir::new("share-b"),
            TempDir::new("share-c"),
        );
        let (fa, fb, fc) = (a.0.join("tls.key"), b.0.join("tls.key"), c.0.join("ca.crt"));
        for f in [&fa, &fb, &fc] {
            std::fs::write(f, "1").unwrap();
        }
        let watches = DirWatches::new();
        let (_hup_tx, hup_rx) = hup();
        let group = |f: &Path| Watched::new(&watches, "test", [f], HOUR, hup_rx.clone());
        let (mut wa, mut wb, mut wc) = (group(&fa), group(&fb), group(&fc));
        assert_eq!(watches.dirs(), 3);

        std::fs::write(&fa, "2").unwrap();
        assert_eq!(next(&mut wa).await, Trigger::Watch);
        // One callback wakes every group an event is for: had `b` been one, it would be now.
        assert!(
            wb.events.try_recv().is_err(),
            "b's directory did not change"
        );
        assert!(
            wc.events.try_recv().is_err(),
            "c's directory did not change"
        );

        // `a` now watches b's directory (shared with `b`) instead of its own.
        wa.set_files([fb.as_path()]);
        assert_eq!(watches.dirs(), 2);
        std::fs::write(&fa, "3").unwrap();
        // Events arrive in order: once c's is seen, a's old directory's would have been.
        std::fs::write(&fc, "3").unwrap();
        assert_eq!(next(&mut wc).await, Trigger::Watch);
        assert!(
            wa.events.try_recv().is_err(),
            "a's old directory is not watched"
        );
        std::fs::write(&fb, "3").unwrap();
        assert_eq!(next(&mut wb).await, Trigger::Watch);
        assert_eq!(next(&mut wa).await, Trigger::Watch);

        drop(wa);
        assert_eq!(watches.dirs(), 2, "b's stays for b");
        drop(wb);
        drop(wc);
        assert_eq!(watches.dirs(), 0);
        // A group made later watches again.
        let mut wd = group(&fa);
        std::fs::write(&fa, "4").unwrap();
        assert_eq!(next(&mut wd).await, Trigger::Watch);
    }

    /// SIGHUP and the period wake a group whatever its files do; a wake-up received when
    /// [`Watched::next`] was cancelled is not lost.
    #[tokio::test(start_paused = true)]
    async fn sighup_and_the_period_wake_a_group() {
        let watches = DirWatches::new();
        let (hup_tx, _) = hup();
        hup_tx.send_replace(());
        let period = Duration::from_secs(30);
        let mut w = Watched::new(&watches, "test", [], period, hup_tx.subscribe());
        // A SIGHUP before the group subscribed is not its business; the period is.
        let started = tokio::time::Instant::now();
        assert_eq!(w.next().await, Trigger::Timer);
        assert_eq!(started.elapsed(), period);
        hup_tx.send_replace(());
        hup_tx.send_replace(());
        assert_eq!(w.next().await, Trigger::Hup);
        assert_eq!(
            tokio::time::timeout(period / 2, w.next()).await.ok(),
            None,
            "two signals before a look are one"
        );
        assert_eq!(w.next().await, Trigger::Timer);

        w.tx.try_send(()).unwrap();
        assert!(
            tokio::time::timeout(SETTLE / 2, w.next()).await.is_err(),
            "cancelled while settling"
        );
        assert_eq!(w.next().await, Trigger::Watch);
        assert_eq!(started.elapsed(), period * 2 + SETTLE * 3 / 2);
    }
}
