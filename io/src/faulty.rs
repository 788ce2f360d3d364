//! [`FaultyFs`]: a seeded fault-injecting wrapper over [`StdFs`] for crash and corruption tests.
//!
//! It remembers, per file, the content at the last `sync` and which directory entries were made
//! durable by `sync_dir`. [`FaultyFs::crash`] then rewinds the files to what a power cut would
//! leave: unsynced data is lost, renames, creations and removals (of files and of directories)
//! not followed by a directory fsync are undone (a rename over an existing file brings that
//! file back, and so does a removal, with its content at its last sync; a directory whose entry
//! was not made durable goes with everything in it). Configured faults (a torn write that
//! leaves only a prefix, a failing fsync, rename or directory fsync, a flipped bit in written
//! data) fire at a chosen step; each operation is one step. A power cut at a step stops the
//! file system there: that operation and every later one that would change a file or a
//! directory fails without effect, as if the process died, so that [`FaultyFs::crash`] then
//! sees exactly the operations before it (a failure at a step lets the caller go on, clean up
//! and retry, which a real power cut never does). Every injected failure prints its seed so a
//! failing test can be replayed. A running job's step numbers depend on timing: a test of one
//! arms a fault instead ([`FaultyFs::arm`], [`FaultyFs::arm_for`]), which fires at the next
//! operation of its kind.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::IoError;
use crate::fs::{FsFile, Mapped, StdFs};
use crate::Fs;

/// A fault armed while the file system is in use ([`FaultyFs::arm`]): it fires at the next
/// operation of its kind, once. For tests of running jobs, whose step numbers depend on timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The next `write_at` stores only a prefix and fails (as `tear_write_at_step`).
    TearWrite,
    /// The next fsync fails (as `fail_sync_at_step`).
    FailSync,
    /// The next rename fails without renaming (as `fail_rename_at_step`).
    FailRename,
    /// The next hard link fails without linking (as `fail_link_at_step`).
    FailLink,
    /// The next directory fsync fails (as `fail_sync_dir_at_step`).
    FailSyncDir,
}

/// Which faults to inject. Steps count `write_at`, `sync`, `rename`, `hard_link`, `sync_dir`,
/// `remove` and `remove_dir` calls from 0 (not `create`, `create_dir_all` or reads).
#[derive(Debug, Clone, Copy, Default)]
pub struct FaultConfig {
    /// Seed of the pseudo-random choices (prefix length of a torn write, flipped bit).
    pub seed: u64,
    /// At this step, a write stores only a prefix and fails.
    pub tear_write_at_step: Option<u64>,
    /// At this step, an fsync fails (and the unsynced data is considered lost).
    pub fail_sync_at_step: Option<u64>,
    /// At this step, a rename fails without renaming.
    pub fail_rename_at_step: Option<u64>,
    /// At this step, a write silently stores one flipped bit.
    pub flip_bit_at_step: Option<u64>,
    /// At this step, a hard link fails without linking.
    pub fail_link_at_step: Option<u64>,
    /// At this step, a directory fsync fails (and the directory changes it would have made
    /// durable stay undone by a crash).
    pub fail_sync_dir_at_step: Option<u64>,
    /// At this step the power goes: this operation and every later one that would change a
    /// file or a directory (creations and `start_writeback` included) fail without effect.
    pub power_cut_at_step: Option<u64>,
}

#[derive(Debug, Default)]
struct State {
    step: u64,
    rng: u64,
    /// Content as of the last fsync of each file that was written since.
    durable: HashMap<PathBuf, Vec<u8>>,
    /// Files written since their last fsync.
    dirty: HashSet<PathBuf>,
    /// Files whose directory entry is not yet durable.
    created_unsynced: HashSet<PathBuf>,
    /// Renames and removals not yet made durable by a directory fsync, in order.
    unsynced: Vec<Unsynced>,
    /// Directories `create_dir_all` made whose entry in their parent is not yet durable.
    dirs_unsynced: HashSet<PathBuf>,
    /// The power went at this step (see [`FaultConfig::power_cut_at_step`]).
    cut_at: Option<u64>,
    /// The faults [`FaultyFs::arm`] set that have not fired, each with the start of the file
    /// names it fires on (any if empty), in the order they were armed.
    armed: Vec<(Fault, String)>,
}

/// A directory change that a crash undoes until the directory holding the entry is synced.
#[derive(Debug)]
enum Unsynced {
    Rename {
        from: PathBuf,
        to: PathBuf,
        /// The durable content of the file that `to` named before, which a crash brings back
        /// (`publish_file` replaces a checkpoint's metadata this way).
        replaced: Option<Vec<u8>>,
    },
    /// A removed file and its content at its last sync; `None` if its own creation was not
    /// durable either, so that a crash would not bring it back anyway.
    Remove {
        path: PathBuf,
        durable: Option<Vec<u8>>,
    },
    /// A removed (empty) directory.
    RemoveDir(PathBuf),
}

impl Unsynced {
    /// The entry whose directory must be synced to make the change durable.
    fn entry(&self) -> &Path {
        match self {
            Unsynced::Rename { to, .. } => to,
            Unsynced::Remove { path, .. } | Unsynced::RemoveDir(path) => path,
        }
    }
}

impl State {
    /// Whether `fault` is armed for `path`; disarms the first such if so (it fires now).
    fn fire_armed(&mut self, fault: Fault, path: &Path) -> bool {
        let file = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let at = self
            .armed
            .iter()
            .position(|(f, name)| *f == fault && file.starts_with(name.as_str()));
        at.map(|i| self.armed.remove(i)).is_some()
    }

    /// The content a crash would leave at `path` if its entry stayed: none if its creation
    /// was not durable, its content at its last sync if written since, else what it holds.
    fn durable_content(&self, path: &Path) -> Option<Vec<u8>> {
        if self.created_unsynced.contains(path) {
            None
        } else if self.dirty.contains(path) {
            self.durable.get(path).cloned()
        } else {
            std::fs::read(path).ok()
        }
    }

    fn next_rand(&mut self) -> u64 {
        // splitmix64: deterministic from the seed.
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

#[derive(Debug)]
struct Shared {
    config: FaultConfig,
    state: Mutex<State>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking test thread must not hide the state from the next assertion.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn injected(&self, step: u64, what: &'static str, path: &Path) -> IoError {
        eprintln!(
            "FaultyFs: injecting '{what}' on {} at step {step} (seed {})",
            path.display(),
            self.config.seed
        );
        IoError::Injected {
            seed: self.config.seed,
            step,
            what,
            path: path.to_owned(),
        }
    }
}

/// Fault-injecting [`Fs`] over the real file system (see the module docs).
#[derive(Debug, Clone)]
pub struct FaultyFs {
    shared: Arc<Shared>,
}

impl FaultyFs {
    pub fn new(config: FaultConfig) -> FaultyFs {
        FaultyFs {
            shared: Arc::new(Shared {
                config,
                state: Mutex::new(State {
                    rng: config.seed,
                    ..State::default()
                }),
            }),
        }
    }

    /// The seed, for messages.
    pub fn seed(&self) -> u64 {
        self.shared.config.seed
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.shared.lock().step
    }

    /// Arm `fault`: the next operation of its kind fails, once. Faults armed before and not
    /// fired yet stay armed.
    pub fn arm(&self, fault: Fault) {
        self.arm_for(fault, "");
    }

    /// Arm `fault` for the next operation of its kind on a file whose name starts with
    /// `name` (a rename's source, a link's destination).
    pub fn arm_for(&self, fault: Fault, name: &str) {
        self.shared.lock().armed.push((fault, name.to_owned()));
    }

    /// Whether a fault [`Self::arm`] or [`Self::arm_for`] set has not fired yet.
    pub fn is_armed(&self) -> bool {
        !self.shared.lock().armed.is_empty()
    }

    /// Whether a power cut stopped the file system ([`FaultConfig::power_cut_at_step`]).
    pub fn power_is_cut(&self) -> bool {
        self.shared.lock().cut_at.is_some()
    }

    /// Simulate a power cut: undo directory changes not followed by `sync_dir` and drop data
    /// written since the last `sync`. Open handles must not be used afterwards. The file system
    /// works again afterwards (the machine came back), the power-cut step included.
    pub fn crash(&self) -> Result<(), IoError> {
        let mut st = self.shared.lock();
        let st = &mut *st;
        // Newest first, so that a removal after a rename (or a rename after a removal) is
        // undone in the right order.
        for change in std::mem::take(&mut st.unsynced).into_iter().rev() {
            match change {
                Unsynced::Rename { from, to, replaced } => {
                    if to.exists() {
                        std::fs::rename(&to, &from)
                            .map_err(|e| IoError::os("crash: undo rename", &to, e))?;
                    }
                    for set in [&mut st.dirty, &mut st.created_unsynced] {
                        if set.remove(&to) {
                            set.insert(from.clone());
                        }
                    }
                    if let Some(d) = st.durable.remove(&to) {
                        st.durable.insert(from.clone(), d);
                    }
                    if let Some(old) = replaced {
                        std::fs::write(&to, old)
                            .map_err(|e| IoError::os("crash: restore", &to, e))?;
                    }
                }
                Unsynced::Remove { path, durable } => {
                    // A file made at the same name since is not durable either (the same
                    // directory sync would have made the removal durable): the old one wins.
                    st.created_unsynced.remove(&path);
                    st.dirty.remove(&path);
                    st.durable.remove(&path);
                    match durable {
                        Some(old) => std::fs::write(&path, old)
                            .map_err(|e| IoError::os("crash: undo remove", &path, e))?,
                        None if path.exists() => std::fs::remove_file(&path)
                            .map_err(|e| IoError::os("crash: remove", &path, e))?,
                        None => {}
                    }
                }
                Unsynced::RemoveDir(dir) => {
                    std::fs::create_dir_all(&dir)
                        .map_err(|e| IoError::os("crash: undo remove directory", &dir, e))?;
                }
            }
        }
        for path in std::mem::take(&mut st.created_unsynced) {
            st.dirty.remove(&path);
            st.durable.remove(&path);
            if path.exists() {
                std::fs::remove_file(&path).map_err(|e| IoError::os("crash: remove", &path, e))?;
            }
        }
        for path in std::mem::take(&mut st.dirty) {
            let content = st.durable.get(&path).cloned().unwrap_or_default();
            if path.exists() {
                std::fs::write(&path, content)
                    .map_err(|e| IoError::os("crash: rewind", &path, e))?;
            }
        }
        st.durable.clear();
        // Outermost first: a directory that goes takes the ones inside it along.
        let mut dirs: Vec<PathBuf> = std::mem::take(&mut st.dirs_unsynced).into_iter().collect();
        dirs.sort_by_key(|d| d.components().count());
        for dir in dirs {
            if dir.exists() {
                std::fs::remove_dir_all(&dir)
                    .map_err(|e| IoError::os("crash: remove directory", &dir, e))?;
            }
        }
        st.cut_at = None;
        Ok(())
    }

    /// Flip one bit of a file in place (corruption at rest).
    pub fn flip_bit(path: &Path, byte_offset: u64, bit: u8) -> Result<(), IoError> {
        let mut b = std::fs::read(path).map_err(|e| IoError::os("read", path, e))?;
        let i = byte_offset as usize;
        assert!(i < b.len(), "flip_bit past the end of {}", path.display());
        b[i] ^= 1 << (bit % 8);
        std::fs::write(path, b).map_err(|e| IoError::os("write", path, e))
    }

    /// The next step, or the power-cut error if the power is (or goes) off at it.
    fn take_step(&self, path: &Path) -> Result<(u64, MutexGuard<'_, State>), IoError> {
        let mut st = self.shared.lock();
        let step = st.step;
        st.step += 1;
        if st.cut_at.is_none() && self.shared.config.power_cut_at_step == Some(step) {
            st.cut_at = Some(step);
            drop(st);
            return Err(self.shared.injected(step, "power cut", path));
        }
        self.powered(st, path).map(|st| (step, st))
    }

    /// `st` if the power is on, else the power-cut error (not printed again).
    fn powered<'a>(
        &self,
        st: MutexGuard<'a, State>,
        path: &Path,
    ) -> Result<MutexGuard<'a, State>, IoError> {
        match st.cut_at {
            None => Ok(st),
            Some(step) => Err(IoError::Injected {
                seed: self.shared.config.seed,
                step,
                what: "power cut",
                path: path.to_owned(),
            }),
        }
    }
}

#[derive(Debug)]
struct FaultyFile {
    inner: Box<dyn FsFile>,
    fs: FaultyFs,
}

impl FsFile for FaultyFile {
    fn path(&self) -> &Path {
        self.inner.path()
    }

    fn write_at(&mut self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        let cfg = self.fs.shared.config;
        let path = self.inner.path().to_owned();
        let (step, mut st) = self.fs.take_step(&path)?;
        if !st.dirty.contains(&path) && !st.durable.contains_key(&path) {
            // Remember the pre-write content: that is what a crash rewinds to.
            let before = std::fs::read(&path).unwrap_or_default();
            st.durable.insert(path.clone(), before);
        }
        st.dirty.insert(path.clone());
        if cfg.tear_write_at_step == Some(step) || st.fire_armed(Fault::TearWrite, &path) {
            let keep = if buf.is_empty() {
                0
            } else {
                (st.next_rand() % buf.len() as u64) as usize
            };
            drop(st);
            self.inner.write_at(offset, &buf[..keep])?;
            return Err(self.fs.shared.injected(step, "torn write", &path));
        }
        if cfg.flip_bit_at_step == Some(step) && !buf.is_empty() {
            let r = st.next_rand();
            drop(st);
            let mut copy = buf.to_vec();
            let i = (r % copy.len() as u64) as usize;
            copy[i] ^= 1 << ((r >> 32) % 8);
            eprintln!(
                "FaultyFs: flipping a bit of {} at byte {} (seed {}, step {step})",
                path.display(),
                offset + i as u64,
                cfg.seed
            );
            return self.inner.write_at(offset, &copy);
        }
        drop(st);
        self.inner.write_at(offset, buf)
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        self.inner.read_at(offset, buf)
    }

    fn start_writeback(&mut self, offset: u64, len: u64) -> Result<(), IoError> {
        // Not a step: started writeback makes nothing durable, so a crash still rewinds the
        // file to its last sync.
        drop(self.fs.powered(self.fs.shared.lock(), self.inner.path())?);
        self.inner.start_writeback(offset, len)
    }

    fn sync(&mut self) -> Result<(), IoError> {
        let path = self.inner.path().to_owned();
        let (step, mut st) = self.fs.take_step(&path)?;
        if self.fs.shared.config.fail_sync_at_step == Some(step)
            || st.fire_armed(Fault::FailSync, &path)
        {
            // Linux may drop the dirty pages of a failed fsync: model the worst case at crash.
            return Err(self.fs.shared.injected(step, "fsync failure", &path));
        }
        drop(st);
        self.inner.sync()?;
        st = self.fs.shared.lock();
        st.dirty.remove(&path);
        st.durable.remove(&path);
        Ok(())
    }

    fn len(&self) -> Result<u64, IoError> {
        self.inner.len()
    }
}

impl Fs for FaultyFs {
    fn create(&self, path: &Path) -> Result<Box<dyn FsFile>, IoError> {
        drop(self.powered(self.shared.lock(), path)?);
        let inner = StdFs.create(path)?;
        let mut st = self.shared.lock();
        st.created_unsynced.insert(path.to_owned());
        st.durable.insert(path.to_owned(), Vec::new());
        st.dirty.insert(path.to_owned());
        drop(st);
        Ok(Box::new(FaultyFile {
            inner,
            fs: self.clone(),
        }))
    }

    fn open(&self, path: &Path) -> Result<Box<dyn FsFile>, IoError> {
        Ok(Box::new(FaultyFile {
            inner: StdFs.open(path)?,
            fs: self.clone(),
        }))
    }

    fn rename(&self, from: &Path, to: &Path) -> Result<(), IoError> {
        let (step, mut st) = self.take_step(from)?;
        if self.shared.config.fail_rename_at_step == Some(step)
            || st.fire_armed(Fault::FailRename, from)
        {
            drop(st);
            return Err(self.shared.injected(step, "rename failure", from));
        }
        // The file `to` names now, as a crash would bring it back: its content at its last
        // sync, or none if its own creation was not durable either.
        let replaced = st.durable_content(to);
        StdFs.rename(from, to)?;
        let st = &mut *st;
        // What was known of the replaced file is no longer the file at `to`.
        st.dirty.remove(to);
        st.created_unsynced.remove(to);
        st.durable.remove(to);
        for set in [&mut st.dirty, &mut st.created_unsynced] {
            if set.remove(from) {
                set.insert(to.to_owned());
            }
        }
        if let Some(d) = st.durable.remove(from) {
            st.durable.insert(to.to_owned(), d);
        }
        st.unsynced.push(Unsynced::Rename {
            from: from.to_owned(),
            to: to.to_owned(),
            replaced,
        });
        Ok(())
    }

    fn sync_dir(&self, dir: &Path) -> Result<(), IoError> {
        let (step, mut st) = self.take_step(dir)?;
        if self.shared.config.fail_sync_dir_at_step == Some(step)
            || st.fire_armed(Fault::FailSyncDir, dir)
        {
            drop(st);
            return Err(self.shared.injected(step, "directory fsync failure", dir));
        }
        StdFs.sync_dir(dir)?;
        st.created_unsynced.retain(|p| p.parent() != Some(dir));
        // A directory's removal made durable takes the earlier removals inside it along: it
        // was empty when it went.
        let mut keep: Vec<bool> = st
            .unsynced
            .iter()
            .map(|c| c.entry().parent() != Some(dir))
            .collect();
        for (i, c) in st.unsynced.iter().enumerate() {
            if let Unsynced::RemoveDir(gone) = c {
                if !keep[i] {
                    for (j, earlier) in st.unsynced[..i].iter().enumerate() {
                        keep[j] &= !earlier.entry().starts_with(gone);
                    }
                }
            }
        }
        let mut keep = keep.into_iter();
        st.unsynced.retain(|_| keep.next().unwrap_or(true));
        st.dirs_unsynced.retain(|d| d.parent() != Some(dir));
        Ok(())
    }

    fn remove(&self, path: &Path) -> Result<(), IoError> {
        let (_, mut st) = self.take_step(path)?;
        // What a crash brings back until the directory is synced.
        let durable = st.durable_content(path);
        StdFs.remove(path)?;
        st.dirty.remove(path);
        st.durable.remove(path);
        st.created_unsynced.remove(path);
        st.unsynced.push(Unsynced::Remove {
            path: path.to_owned(),
            durable,
        });
        Ok(())
    }

    fn remove_dir(&self, dir: &Path) -> Result<(), IoError> {
        let (_, mut st) = self.take_step(dir)?;
        StdFs.remove_dir(dir)?;
        // A directory whose own creation was not durable goes at a crash anyway.
        if !st.dirs_unsynced.remove(dir) {
            st.unsynced.push(Unsynced::RemoveDir(dir.to_owned()));
        }
        Ok(())
    }

    fn list_dir(&self, dir: &Path) -> Result<Vec<PathBuf>, IoError> {
        StdFs.list_dir(dir)
    }

    fn create_dir_all(&self, dir: &Path) -> Result<(), IoError> {
        // The directories this call makes: `dir` and its missing ancestors.
        let new: Vec<PathBuf> = dir
            .ancestors()
            .take_while(|d| !d.as_os_str().is_empty() && !d.exists())
            .map(Path::to_path_buf)
            .collect();
        drop(self.powered(self.shared.lock(), dir)?);
        StdFs.create_dir_all(dir)?;
        self.shared.lock().dirs_unsynced.extend(new);
        Ok(())
    }

    fn map_readonly(&self, path: &Path) -> Result<Mapped, IoError> {
        Mapped::map(path)
    }

    fn hard_link(&self, src: &Path, dst: &Path) -> Result<(), IoError> {
        let (step, mut st) = self.take_step(dst)?;
        if self.shared.config.fail_link_at_step == Some(step) || st.fire_armed(Fault::FailLink, dst)
        {
            drop(st);
            return Err(self.shared.injected(step, "hard link failure", dst));
        }
        StdFs.hard_link(src, dst)?;
        // A new directory entry, undone by a crash until its directory is synced. The content
        // is the source's: a crash rewinds it through the source's name if it was not synced.
        st.created_unsynced.insert(dst.to_owned());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::publish_file;

    /// A directory `create_dir_all` made survives a crash only once its parent was synced,
    /// whatever was made durable inside it; its missing ancestors count the same way.
    #[test]
    fn crash_removes_directories_whose_entry_was_not_made_durable() {
        let tmp = tempfile::tempdir().unwrap();
        let fs = FaultyFs::new(FaultConfig::default());
        let (kept, gone) = (tmp.path().join("kept"), tmp.path().join("gone"));
        let deep = gone.join("a").join("b");
        fs.create_dir_all(&kept).unwrap();
        fs.create_dir_all(&deep).unwrap();
        // A durable file in each: synced, and its own entry synced.
        for d in [&kept, &deep] {
            let mut f = fs.create(&d.join("f")).unwrap();
            f.write_at(0, b"durable").unwrap();
            f.sync().unwrap();
            fs.sync_dir(d).unwrap();
        }
        fs.sync_dir(tmp.path()).unwrap();
        // `gone`'s entry is durable now, but not `a`'s inside it.
        fs.crash().unwrap();
        assert_eq!(std::fs::read(kept.join("f")).unwrap(), b"durable");
        assert!(gone.is_dir(), "its entry was synced");
        assert!(
            !gone.join("a").exists(),
            "a directory whose entry was never synced"
        );
        // An existing directory is not the call's to lose.
        fs.create_dir_all(&kept).unwrap();
        fs.crash().unwrap();
        assert!(kept.is_dir());
    }

    /// `create_dir_all_durable` makes every directory it creates survive a crash, and takes no
    /// step where it creates none.
    #[test]
    fn durably_created_directories_survive_a_crash() {
        let tmp = tempfile::tempdir().unwrap();
        let fs = FaultyFs::new(FaultConfig::default());
        let deep = tmp.path().join("x").join("y").join("z");
        crate::fs::create_dir_all_durable(&fs, &deep).unwrap();
        fs.crash().unwrap();
        assert!(deep.is_dir());
        let steps = fs.steps();
        // Nothing created, nothing synced.
        crate::fs::create_dir_all_durable(&fs, &deep).unwrap();
        assert_eq!(fs.steps(), steps);
    }

    #[test]
    fn crash_drops_unsynced_and_undoes_unsynced_rename() {
        let dir = tempfile::tempdir().unwrap();
        let fs = FaultyFs::new(FaultConfig {
            seed: 1,
            ..FaultConfig::default()
        });
        let a = dir.path().join("a");
        let mut f = fs.create(&a).unwrap();
        f.write_at(0, b"durable").unwrap();
        f.sync().unwrap();
        fs.sync_dir(dir.path()).unwrap();
        f.write_at(7, b" lost").unwrap();
        let b = dir.path().join("b");
        let mut g = fs.create(&b).unwrap();
        g.write_at(0, b"never synced").unwrap();
        g.sync().unwrap();
        let c = dir.path().join("c");
        fs.rename(&b, &c).unwrap();
        fs.crash().unwrap();
        assert_eq!(std::fs::read(&a).unwrap(), b"durable");
        assert!(
            !b.exists() && !c.exists(),
            "creation was never made durable"
        );
    }

    #[test]
    fn crash_undoes_an_unsynced_rename_of_a_durable_file() {
        let dir = tempfile::tempdir().unwrap();
        let fs = FaultyFs::new(FaultConfig::default());
        let (b, c) = (dir.path().join("b"), dir.path().join("c"));
        let mut f = fs.create(&b).unwrap();
        f.write_at(0, b"synced").unwrap();
        f.sync().unwrap();
        fs.sync_dir(dir.path()).unwrap();
        fs.rename(&b, &c).unwrap();
        fs.crash().unwrap();
        assert_eq!(std::fs::read(&b).unwrap(), b"synced");
        assert!(!c.exists(), "the rename was never made durable");
    }

    #[test]
    fn crash_brings_back_the_file_an_unsynced_rename_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let fs = FaultyFs::new(FaultConfig::default());
        let (b, c) = (dir.path().join("b"), dir.path().join("c"));
        for (p, bytes) in [(&b, &b"new"[..]), (&c, &b"old"[..])] {
            let mut f = fs.create(p).unwrap();
            f.write_at(0, bytes).unwrap();
            f.sync().unwrap();
        }
        fs.sync_dir(dir.path()).unwrap();
        // `c` was written again but not synced: a crash brings back its synced content.
        fs.open(&c).unwrap().write_at(0, b"OLD?").unwrap();
        fs.rename(&b, &c).unwrap();
        assert_eq!(std::fs::read(&c).unwrap(), b"new");
        fs.crash().unwrap();
        assert_eq!(std::fs::read(&b).unwrap(), b"new");
        assert_eq!(std::fs::read(&c).unwrap(), b"old");
    }

    /// A removal is undone by a crash until its directory is synced: the file comes back with
    /// its content at its last sync, a directory comes back before the files removed from it,
    /// and a file made at the removed name since goes in favour of the old one. A file whose
    /// own creation was never durable stays gone.
    #[test]
    fn crash_undoes_removals_not_made_durable() {
        let tmp = tempfile::tempdir().unwrap();
        let fs = FaultyFs::new(FaultConfig::default());
        let (d, kept, gone) = (
            tmp.path().join("d"),
            tmp.path().join("kept"),
            tmp.path().join("gone"),
        );
        crate::fs::create_dir_all_durable(&fs, &d).unwrap();
        for (p, bytes) in [
            (d.join("a"), &b"a synced"[..]),
            (kept.clone(), b"kept"),
            (gone.clone(), b"gone"),
        ] {
            let mut f = fs.create(&p).unwrap();
            f.write_at(0, bytes).unwrap();
            f.sync().unwrap();
        }
        fs.sync_dir(&d).unwrap();
        fs.sync_dir(tmp.path()).unwrap();
        // Written again without a sync: the removal brings back the synced content.
        fs.open(&d.join("a"))
            .unwrap()
            .write_at(0, b"A unsynced")
            .unwrap();
        let never = d.join("never");
        fs.create(&never).unwrap().write_at(0, b"x").unwrap();
        for p in [d.join("a"), never.clone()] {
            fs.remove(&p).unwrap();
        }
        fs.remove_dir(&d).unwrap();
        // `gone`'s removal is made durable; `kept` is removed and made again, unsynced.
        fs.remove(&gone).unwrap();
        fs.remove(&kept).unwrap();
        let mut f = fs.create(&kept).unwrap();
        f.write_at(0, b"new kept").unwrap();
        f.sync().unwrap();
        // Syncs `tmp`, not `d`: `d`'s own removal from `tmp` is durable now, the rest not.
        fs.sync_dir(tmp.path()).unwrap();
        fs.crash().unwrap();
        assert!(!gone.exists() && !d.exists(), "removals made durable");
        assert_eq!(std::fs::read(&kept).unwrap(), b"new kept");

        // The same without the directory sync: everything removed comes back.
        let fs = FaultyFs::new(FaultConfig::default());
        crate::fs::create_dir_all_durable(&fs, &d).unwrap();
        let mut f = fs.create(&d.join("a")).unwrap();
        f.write_at(0, b"a synced").unwrap();
        f.sync().unwrap();
        fs.sync_dir(&d).unwrap();
        fs.open(&d.join("a")).unwrap().write_at(0, b"A").unwrap();
        fs.create(&never).unwrap().write_at(0, b"x").unwrap();
        fs.remove(&d.join("a")).unwrap();
        fs.remove(&never).unwrap();
        fs.remove_dir(&d).unwrap();
        fs.remove(&kept).unwrap();
        fs.create(&kept).unwrap().write_at(0, b"newer").unwrap();
        fs.crash().unwrap();
        assert_eq!(std::fs::read(d.join("a")).unwrap(), b"a synced");
        assert!(!never.exists(), "its creation was never durable");
        assert_eq!(std::fs::read(&kept).unwrap(), b"new kept");
    }

    /// At a power cut the operation at that step and every later change fail without effect
    /// (creations included, which take no step), so a crash sees only what came before; after
    /// the crash the file system works again.
    #[test]
    fn a_power_cut_stops_every_later_change() {
        let tmp = tempfile::tempdir().unwrap();
        // Steps: write(0) sync(1) sync_dir(2) write(3), the cut.
        let fs = FaultyFs::new(FaultConfig {
            power_cut_at_step: Some(3),
            ..FaultConfig::default()
        });
        let a = tmp.path().join("a");
        let mut f = fs.create(&a).unwrap();
        f.write_at(0, b"durable").unwrap();
        f.sync().unwrap();
        fs.sync_dir(tmp.path()).unwrap();
        assert!(!fs.power_is_cut());
        let cut = |r: Result<(), IoError>| {
            assert!(
                matches!(
                    r,
                    Err(IoError::Injected {
                        what: "power cut",
                        step: 3,
                        ..
                    })
                ),
                "{r:?}"
            );
        };
        cut(f.write_at(0, b"lost"));
        assert!(fs.power_is_cut());
        cut(f.sync());
        cut(f.start_writeback(0, 7));
        cut(fs.create(&tmp.path().join("b")).map(drop));
        cut(fs.create_dir_all(&tmp.path().join("dir")));
        cut(fs.rename(&a, &tmp.path().join("c")));
        cut(fs.hard_link(&a, &tmp.path().join("l")));
        cut(fs.remove(&a));
        cut(fs.sync_dir(tmp.path()));
        assert_eq!(std::fs::read(&a).unwrap(), b"durable", "nothing changed");
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1);
        // Reads still work: a dying process may read before it notices.
        let mut buf = [0u8; 7];
        fs.open(&a).unwrap().read_at(0, &mut buf).unwrap();
        fs.crash().unwrap();
        assert!(!fs.power_is_cut());
        assert_eq!(std::fs::read(&a).unwrap(), b"durable");
        fs.remove(&a).unwrap();
        assert!(!a.exists());
    }

    #[test]
    fn publish_survives_crash_after_completion() {
        let dir = tempfile::tempdir().unwrap();
        let fs = FaultyFs::new(FaultConfig::default());
        let p = dir.path().join("meta");
        publish_file(&fs, &p, b"v1").unwrap();
        fs.crash().unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"v1");
    }

    #[test]
    fn publish_is_all_or_nothing_at_every_failure_step() {
        // Steps of publish_file: write(0) sync(1) rename(2) sync_dir(3). Each fault kind
        // fires only on its own operation: at its step, publish fails and a crash leaves the
        // old file (the rename over it undone, after it, if the directory fsync failed); at
        // another step nothing fires, and the new file survives the crash.
        for step in 0..4u64 {
            for kind in 0..4u64 {
                let dir = tempfile::tempdir().unwrap();
                let p = dir.path().join("meta");
                publish_file(&StdFs, &p, b"old").unwrap();
                let cfg = FaultConfig {
                    seed: step * 10 + kind,
                    tear_write_at_step: (kind == 0).then_some(step),
                    fail_sync_at_step: (kind == 1).then_some(step),
                    fail_rename_at_step: (kind == 2).then_some(step),
                    fail_sync_dir_at_step: (kind == 3).then_some(step),
                    ..FaultConfig::default()
                };
                let fs = FaultyFs::new(cfg);
                let r = publish_file(&fs, &p, b"new contents");
                let fires = kind == step;
                assert_eq!(r.is_err(), fires, "seed {}: {r:?}", fs.seed());
                fs.crash().unwrap();
                let got = std::fs::read(&p).unwrap();
                let want: &[u8] = if fires { b"old" } else { b"new contents" };
                assert_eq!(
                    got,
                    want,
                    "seed {}: got {:?}",
                    fs.seed(),
                    String::from_utf8_lossy(&got)
                );
            }
        }
    }

    /// An armed fault waits for an operation of its kind (others pass), fires once, and is
    /// then disarmed.
    #[test]
    fn an_armed_fault_fires_once_at_the_next_operation_of_its_kind() {
        let dir = tempfile::tempdir().unwrap();
        let fs = FaultyFs::new(FaultConfig::default());
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        let mut f = fs.create(&a).unwrap();
        fs.arm(Fault::FailRename);
        f.write_at(0, b"abc").unwrap();
        f.sync().unwrap();
        assert!(fs.is_armed(), "a write and a sync are not renames");
        assert!(matches!(fs.rename(&a, &b), Err(IoError::Injected { .. })));
        assert!(!fs.is_armed());
        assert!(
            a.exists() && !b.exists(),
            "the failed rename renamed nothing"
        );
        fs.rename(&a, &b).unwrap();
        let mut f = fs.create(&a).unwrap();
        fs.arm(Fault::FailSync);
        f.write_at(0, b"abc").unwrap();
        assert!(f.sync().is_err());
        f.sync().unwrap();
        fs.arm(Fault::TearWrite);
        assert!(f.write_at(0, &[7u8; 1000]).is_err());
        assert!(std::fs::read(&a).unwrap().len() < 1000, "only a prefix");
        f.write_at(0, &[7u8; 1000]).unwrap();
        assert!(!fs.is_armed());
        // Aimed at one file: another's rename passes.
        fs.arm_for(Fault::FailRename, "b");
        fs.rename(&a, &dir.path().join("c")).unwrap();
        assert!(fs.is_armed());
        assert!(fs.rename(&b, &a).is_err());
        assert!(!fs.is_armed());
        // Two armed at once: each fires at its own kind's next operation, in turn.
        fs.arm(Fault::FailLink);
        fs.arm(Fault::FailLink);
        fs.arm(Fault::FailRename);
        let link = dir.path().join("l");
        assert!(fs.hard_link(&b, &link).is_err());
        assert!(fs.rename(&b, &a).is_err());
        assert!(fs.hard_link(&b, &link).is_err());
        assert!(!fs.is_armed() && !link.exists());
        fs.hard_link(&b, &link).unwrap();
        fs.arm(Fault::FailSyncDir);
        f.sync().unwrap();
        assert!(fs.sync_dir(dir.path()).is_err());
        fs.sync_dir(dir.path()).unwrap();
    }

    #[test]
    fn torn_write_keeps_a_prefix_only() {
        let dir = tempfile::tempdir().unwrap();
        let fs = FaultyFs::new(FaultConfig {
            seed: 42,
            tear_write_at_step: Some(0),
            ..FaultConfig::default()
        });
        let p = dir.path().join("t");
        let mut f = fs.create(&p).unwrap();
        let err = f.write_at(0, &[7u8; 1000]).unwrap_err();
        assert!(matches!(err, IoError::Injected { seed: 42, .. }));
        assert!(std::fs::read(&p).unwrap().len() < 1000);
    }
}
