//! A test's scratch directory that is removed when the test ends, passed or panicked.
//!
//! Tests write their files under Cargo's `CARGO_TARGET_TMPDIR`, which nothing empties: on
//! the host it grows by every run's files (hundreds of MB), and in the VM, where that path
//! is in the initramfs's ramfs, the files stay in memory — unreclaimable, on whichever node
//! the test ran — until a later placement finds its node full.

use std::ops::Deref;
use std::path::{Path, PathBuf};

/// A directory created by [`ScratchDir::new`] and removed, with everything in it, on drop.
#[derive(Debug)]
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    /// Creates (after removing any stale one) `base/name-PID`.
    ///
    /// # Panics
    /// If the directory cannot be created: a test cannot run without it.
    pub fn new(base: &Path, name: &str) -> ScratchDir {
        let dir = base.join(format!("{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("create_dir_all {}: {e}", dir.display()));
        ScratchDir(dir)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Deref for ScratchDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for ScratchDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::ScratchDir;

    #[test]
    fn the_directory_and_its_files_are_gone_after_drop_even_on_panic() {
        let base = std::env::temp_dir();
        let kept;
        {
            let d = ScratchDir::new(&base, "scratch-unit");
            std::fs::create_dir_all(d.join("a/b")).unwrap();
            std::fs::write(d.join("a/b/f"), b"x").unwrap();
            kept = d.path().to_path_buf();
            assert!(kept.join("a/b/f").exists());
        }
        assert!(!kept.exists());
        let path = std::panic::catch_unwind(|| {
            let d = ScratchDir::new(&base, "scratch-unit-panic");
            std::fs::write(d.join("f"), b"x").unwrap();
            std::panic::panic_any(d.path().to_path_buf());
        })
        .unwrap_err()
        .downcast::<std::path::PathBuf>()
        .unwrap();
        assert!(!path.exists());
    }
}
