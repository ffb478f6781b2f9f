//! A minimal writer of the `newc` cpio format the kernel unpacks as an initramfs.

use std::collections::BTreeSet;
use std::io::Write;

#[derive(Default)]
pub struct Archive {
    out: Vec<u8>,
    dirs: BTreeSet<String>,
    ino: u32,
}

impl Archive {
    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.ino += 1;
        let name = name.trim_start_matches('/');
        let header = format!(
            "070701{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            self.ino,
            mode,
            0,
            0,
            1,
            0,
            data.len(),
            0,
            0,
            0,
            0,
            name.len() + 1,
            0
        );
        self.out.extend_from_slice(header.as_bytes());
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad();
        self.out.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.out.len().is_multiple_of(4) {
            self.out.push(0);
        }
    }

    /// Adds `path`'s parent directories that are not in the archive yet.
    fn parents(&mut self, path: &str) {
        let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        for i in 1..parts.len() {
            let dir = parts[..i].join("/");
            if self.dirs.insert(dir.clone()) {
                self.entry(&dir, 0o040755, &[]);
            }
        }
    }

    pub fn dir(&mut self, path: &str) {
        self.parents(&format!("{path}/x"));
    }

    pub fn file(&mut self, path: &str, data: &[u8], executable: bool) {
        self.parents(path);
        self.entry(path, if executable { 0o100755 } else { 0o100644 }, data);
    }

    pub fn finish(mut self, mut to: impl Write) -> std::io::Result<()> {
        self.entry("TRAILER!!!", 0, &[]);
        to.write_all(&self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_aligned_and_directories_come_first() {
        let mut a = Archive::default();
        a.file("/bin/x", b"abc", true);
        let mut out = Vec::new();
        a.finish(&mut out).unwrap();
        assert_eq!(out.len() % 4, 0);
        let text = String::from_utf8_lossy(&out);
        let bin = text.find("bin\0").unwrap();
        let file = text.find("bin/x\0").unwrap();
        assert!(bin < file);
        assert!(text.contains("TRAILER!!!"));
        // mode of bin/x: 100755
        assert!(text.contains("000081ed"));
    }
}
