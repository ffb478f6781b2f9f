//! Descriptors of every access mode through every read mode (issue 19 §4): a descriptor
//! that cannot be read through (opened write-only, or `O_PATH`) is refused with the same
//! `EBADF` error in each mode; read-only and read-write descriptors load the exact bytes.
//!
//! `ReadMode::Direct` used to reopen `/proc/self/fd/N` with `O_RDONLY | O_DIRECT`, a new
//! open file description whose access the kernel checks against the file's permissions,
//! not against the caller's descriptor: so it read through write-only and `O_PATH`
//! descriptors that buffered and drop-behind reads refuse.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use numapin::store::{
    ExpertSource, LayerSpec, Layout, Piece, PinStore, ReadFallback, ReadMode, StoreOptions,
};
use numapin::{Errno, Error};

use numapin_testkit::synthetic::SyntheticModel;

/// 5 experts of 3 pieces each over a file of `LEN` bytes: aligned and unaligned offsets
/// and lengths, so that a direct read goes both straight into a slot and through the
/// bounce buffer.
const LEN: usize = (1 << 20) + 333;
const PIECES: [[(u64, usize); 2]; 5] = [
    [(0, 4096), (4096, 512)],
    [(7, 70_001), (70_008, 5)],
    [(1 << 19, 8192), (1000, 1)],
    [(LEN as u64 - 4099, 4099), (512, 512)],
    [(12_345, 200_000), (LEN as u64 - 1, 1)],
];

/// How each descriptor is opened.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Access {
    ReadOnly,
    ReadWrite,
    WriteOnly,
    Path,
}

impl Access {
    const ALL: [Access; 4] = [
        Access::ReadOnly,
        Access::ReadWrite,
        Access::WriteOnly,
        Access::Path,
    ];

    fn open(self, path: &Path) -> File {
        let mut options = OpenOptions::new();
        match self {
            Access::ReadOnly => options.read(true),
            Access::ReadWrite => options.read(true).write(true),
            Access::WriteOnly => options.write(true),
            // O_PATH ignores the access mode; `F_GETFL` then reports 0 (O_RDONLY).
            Access::Path => options
                .read(true)
                .custom_flags(rustix::fs::OFlags::PATH.bits() as i32),
        };
        options.open(path).unwrap()
    }

    fn readable(self) -> bool {
        matches!(self, Access::ReadOnly | Access::ReadWrite)
    }
}

fn write_file(dir: &Path) -> PathBuf {
    let path = dir.join("model.bin");
    let mut bytes = vec![0u8; LEN];
    SyntheticModel::expected_bytes(0, &mut bytes);
    std::fs::write(&path, &bytes).unwrap();
    path
}

fn expected(pieces: &[(u64, usize)]) -> Vec<u8> {
    let mut out = Vec::new();
    for &(offset, len) in pieces {
        let mut b = vec![0u8; len];
        SyntheticModel::expected_bytes(offset, &mut b);
        out.extend_from_slice(&b);
    }
    out
}

/// What `ReadMode::Direct` runs as for `file`: direct where statx reports a direct-I/O
/// alignment, else buffered with the reason.
fn direct_outcome(file: &File) -> (ReadMode, Option<ReadFallback>) {
    use rustix::fs::{AtFlags, StatxFlags};
    let stat = rustix::fs::statx(file, c"", AtFlags::EMPTY_PATH, StatxFlags::DIOALIGN).unwrap();
    if stat.stx_mask & StatxFlags::DIOALIGN.bits() != 0 && stat.stx_dio_offset_align > 0 {
        (ReadMode::Direct, None)
    } else {
        (ReadMode::Buffered, Some(ReadFallback::NoDirectIoAlignment))
    }
}

/// Packs the layer from `file` in `mode`: the error, or checks the bytes.
fn pack(file: &File, mode: ReadMode, threads: usize) -> Result<(), Error> {
    let sources: Vec<ExpertSource> = PIECES
        .iter()
        .map(|[w, s]| ExpertSource::File {
            weights: vec![Piece::new(file, w.0, w.1)],
            scales: vec![Piece::new(file, s.0, s.1)],
        })
        .collect();
    let spec = LayerSpec::fitting(&sources).unwrap();
    let options = StoreOptions::default()
        .read_mode(mode)
        .loader_threads(threads);
    let store = PinStore::new(Layout::Unplaced, options).unwrap();
    // Residency before the load (a drop-behind load of an earlier case evicts the file);
    // none for a descriptor that cannot be mapped for reading, whose load fails anyway.
    let before = numapin_testkit::cache::cached_pages(file).ok();
    let report = store.pack_layer(0, &spec, &sources)?;
    let outcome = match mode {
        ReadMode::Direct => direct_outcome(file),
        // Auto reads a file at least half cached buffered, others as Direct does.
        ReadMode::Auto => match before {
            Some((cached, pages)) if cached * 2 >= pages => (ReadMode::Buffered, None),
            _ => direct_outcome(file),
        },
        other => (other, None),
    };
    assert_eq!((report.read_mode, report.read_fallback), outcome);
    for (e, [w, s]) in PIECES.iter().enumerate() {
        assert!(
            store.weights(0, e).unwrap() == expected(&[*w]),
            "{mode}: expert {e} weights"
        );
        assert!(
            store.scales(0, e).unwrap() == expected(&[*s]),
            "{mode}: expert {e} scales"
        );
    }
    Ok(())
}

fn every_access_in_every_mode(dir: &Path, what: &str) {
    let path = write_file(dir);
    for access in Access::ALL {
        let file = access.open(&path);
        let mut refusals: Vec<(ReadMode, String)> = Vec::new();
        for mode in ReadMode::ALL {
            // One loader thread: the first piece read is the same in every mode, so the
            // error names the same piece.
            match (pack(&file, mode, 1), access.readable()) {
                (Ok(()), true) => {}
                (Err(e), false) => {
                    assert!(
                        matches!(&e, Error::Io { op: "pread", .. }),
                        "{what}: {access:?} {mode}: {e:?}"
                    );
                    assert_eq!(
                        e.errno(),
                        Some(Errno::BADF),
                        "{what}: {access:?} {mode}: {e}"
                    );
                    refusals.push((mode, e.to_string()));
                    let io = std::io::Error::from(e);
                    assert_eq!(io.raw_os_error(), Some(Errno::BADF.raw_os_error()));
                }
                (Err(e), true) => panic!("{what}: {access:?} {mode}: {e}"),
                (Ok(()), false) => {
                    panic!(
                        "{what}: {access:?} {mode}: read through a descriptor that refuses reads"
                    )
                }
            }
        }
        // The same error, word for word, in every mode.
        for (mode, message) in refusals.iter().skip(1) {
            assert_eq!(
                message, &refusals[0].1,
                "{what}: {access:?}: {mode} and {} differ",
                refusals[0].0
            );
        }
        if !access.readable() {
            assert_eq!(refusals.len(), ReadMode::ALL.len());
            assert!(
                refusals[0].1.contains("layer 0 expert 0 weights")
                    && refusals[0].1.contains("4096 bytes at file offset 0"),
                "{what}: {access:?}: {}",
                refusals[0].1
            );
        }
    }
}

/// On the target directory's file system (ext4 here: direct reads run direct).
#[test]
fn every_descriptor_answers_alike_in_every_read_mode() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("read-descriptors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    every_access_in_every_mode(&dir, "target dir");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// On tmpfs, where direct reads fall back to buffered ones.
#[test]
fn every_descriptor_answers_alike_on_tmpfs() {
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        println!("NOT RUN: every_descriptor_answers_alike_on_tmpfs needs /dev/shm (tmpfs)");
        return;
    }
    let dir = shm.join(format!("numapin-read-descriptors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    every_access_in_every_mode(&dir, "tmpfs");
    std::fs::remove_dir_all(&dir).unwrap();
}
