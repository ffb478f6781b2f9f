//! Shared memory that safe code cannot change: an exported store is frozen and sealed,
//! and attaching refuses every file whose bytes another process could still change.

mod common;

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;

use numapin::store::{ExpertSource, Kind, LayerSpec, Layout, Manifest, PinStore, StoreOptions};
use numapin::{Error, NodeSet, Region, Seals};

const EXPERTS: usize = 4;
const WEIGHTS: usize = 3 * 4096 + 100;
const SCALES: usize = 512;

fn tensor(layer: usize, expert: usize, kind: Kind, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((layer * 5 + expert * 11 + kind as usize * 17 + i) % 251) as u8)
        .collect()
}

fn shared_store(layers: usize) -> PinStore {
    let options = StoreOptions::default().shared(true);
    let store = PinStore::new(Layout::Interleave(NodeSet::allowed().unwrap()), options).unwrap();
    for layer in 0..layers {
        let data: Vec<(Vec<u8>, Vec<u8>)> = (0..EXPERTS)
            .map(|e| {
                (
                    tensor(layer, e, Kind::Weights, WEIGHTS),
                    tensor(layer, e, Kind::Scales, SCALES),
                )
            })
            .collect();
        let sources: Vec<ExpertSource> = data
            .iter()
            .map(|(w, s)| ExpertSource::Memory {
                weights: w,
                scales: s,
            })
            .collect();
        store.pack_layer(layer, &spec(), &sources).unwrap();
    }
    store
}

fn spec() -> LayerSpec {
    LayerSpec {
        experts: EXPERTS,
        weight_bytes: WEIGHTS,
        scale_bytes: SCALES,
    }
}

fn assert_frozen<T: std::fmt::Debug>(result: numapin::Result<T>) {
    match result {
        Err(Error::Frozen { .. }) => {}
        other => panic!("expected Error::Frozen, got {other:?}"),
    }
}

fn assert_unchanged(store: &PinStore, layers: usize) {
    for layer in 0..layers {
        for e in 0..EXPERTS {
            assert_eq!(
                store.weights(layer, e).unwrap(),
                &tensor(layer, e, Kind::Weights, WEIGHTS)[..]
            );
            assert_eq!(
                store.scales(layer, e).unwrap(),
                &tensor(layer, e, Kind::Scales, SCALES)[..]
            );
        }
    }
}

#[test]
fn an_exported_store_is_frozen_and_its_files_cannot_change() {
    let mut store = shared_store(2);
    let export = store.export().unwrap();
    assert_eq!(export.files.len(), 4);

    // The exporter can no longer change what attached processes hold.
    assert_frozen(store.release(0, 1));
    assert_frozen(store.release_kind(1, 0, Kind::Scales));
    let (w, s) = (vec![0u8; 10], vec![0u8; 10]);
    let source = ExpertSource::Memory {
        weights: &w,
        scales: &s,
    };
    assert_frozen(store.ensure(0, 0, &source));
    assert_frozen(store.pack_layer(2, &spec(), &vec![source.clone(); EXPERTS]));

    // Nor can anyone holding the files: the kernel refuses every change.
    for file in &export.files {
        let eperm = Some(libc::EPERM);
        assert_eq!(file.set_len(0).unwrap_err().raw_os_error(), eperm);
        assert_eq!(file.set_len(1 << 30).unwrap_err().raw_os_error(), eperm);
        assert_eq!(file.write_at(b"x", 0).unwrap_err().raw_os_error(), eperm);
        let punch = rustix::fs::fallocate(
            file,
            rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE,
            0,
            4096,
        );
        assert_eq!(punch, Err(rustix::io::Errno::PERM));
        // SAFETY: a new mapping that is refused; nothing aliases it.
        let writable = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                4096,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::SHARED,
                file,
                0,
            )
        };
        assert_eq!(writable.err(), Some(rustix::io::Errno::PERM));
        let seals = rustix::fs::fcntl_get_seals(file).unwrap();
        assert!(seals.contains(
            rustix::fs::SealFlags::WRITE
                | rustix::fs::SealFlags::SHRINK
                | rustix::fs::SealFlags::GROW
        ));
    }
    assert_unchanged(&store, 2);

    // Exporting again hands out the same, still sealed, bytes.
    let again = store.export().unwrap();
    assert_eq!(again.manifest, export.manifest);
    let attached = PinStore::attach(&again.manifest, again.files).unwrap();
    assert_unchanged(&attached, 2);
    assert_unchanged(&store, 2);
}

#[test]
fn an_exported_store_keeps_its_pages_mapped_and_counted() {
    let mut store = shared_store(1);
    let before = store.stats().unwrap();
    store.export().unwrap();
    let after = store.stats().unwrap();
    assert_eq!(after.bytes, before.bytes);
    assert_eq!(after.experts_loaded, before.experts_loaded);
    // The re-mapped arenas are faulted in again: every loaded byte is resident.
    assert!(
        after.resident_bytes >= before.bytes,
        "{after:?} against {before:?}"
    );
}

#[test]
fn an_attached_store_refuses_changes_with_frozen() {
    let mut exporter = shared_store(1);
    let export = exporter.export().unwrap();
    let mut store = PinStore::attach(&export.manifest, export.files).unwrap();
    assert_unchanged(&store, 1);
    assert_frozen(store.release(0, 0));
    let (w, s) = (vec![1u8; 10], vec![1u8; 10]);
    let source = ExpertSource::Memory {
        weights: &w,
        scales: &s,
    };
    assert_frozen(store.ensure(0, 0, &source));
    assert_frozen(store.pack_layer(1, &spec(), &vec![source; EXPERTS]));
}

/// A manifest with one weights region of `len` bytes and a single loaded slot.
fn one_region(len: usize) -> Manifest {
    Manifest::parse(&format!(
        "numapin-store 2\nregion layer=0 kind=weights len={len} stride={len} slot_bytes={len} slots=1 loaded={len}\n"
    ))
    .unwrap()
}

fn assert_refused(manifest: &Manifest, file: File, needle: &str) {
    match PinStore::attach(manifest, vec![file]) {
        Err(e) => assert!(e.to_string().contains(needle), "{needle:?} not in: {e}"),
        Ok(_) => panic!("attach accepted a file that can change ({needle})"),
    }
}

fn memfd_with(seals: Seals, len: usize) -> File {
    let region = Region::memfd("numapin-sealed-test", len).unwrap();
    // SAFETY: the duplicate only gets seals added and is handed to attach, which refuses
    // or maps it read-only; this test writes nothing through it.
    let file = unsafe { region.memfd_file() }.unwrap().try_clone().unwrap();
    drop(region); // no writable mapping left, so WRITE can be sealed
    if !seals.is_empty() {
        rustix::fs::fcntl_add_seals(&file, to_kernel(seals)).unwrap();
    }
    file
}

fn to_kernel(seals: Seals) -> rustix::fs::SealFlags {
    let mut k = rustix::fs::SealFlags::empty();
    for (ours, theirs) in [
        (Seals::WRITE, rustix::fs::SealFlags::WRITE),
        (Seals::SHRINK, rustix::fs::SealFlags::SHRINK),
        (Seals::GROW, rustix::fs::SealFlags::GROW),
        (Seals::FUTURE_WRITE, rustix::fs::SealFlags::FUTURE_WRITE),
    ] {
        if seals.contains(ours) {
            k |= theirs;
        }
    }
    k
}

#[test]
fn attach_refuses_files_that_can_change() {
    let len = 2 * numapin::page_size();
    let manifest = one_region(len);

    // A plain disk file: anyone who can write it could truncate it (SIGBUS) or write it.
    let dir = std::env::temp_dir().join(format!("numapin-sealed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("plain.bin");
    File::create(&path)
        .unwrap()
        .write_all(&vec![1u8; len])
        .unwrap();
    // On ext4 F_GET_SEALS answers EINVAL ("not a memfd"); on tmpfs (the VM's /tmp) a
    // plain file reports F_SEAL_SEAL and no others: refused either way.
    let needle = if rustix::fs::fcntl_get_seals(File::open(&path).unwrap()).is_ok() {
        "not WRITE | SHRINK | GROW"
    } else {
        "not a memfd"
    };
    assert_refused(&manifest, File::open(&path).unwrap(), needle);
    std::fs::remove_dir_all(&dir).unwrap();

    // Memfds without the three seals: what the old export left (GROW | SHRINK), one
    // that only refuses future writers, and one with no seals.
    assert_refused(
        &manifest,
        memfd_with(Seals::GROW | Seals::SHRINK, len),
        "not WRITE | SHRINK | GROW",
    );
    assert_refused(
        &manifest,
        memfd_with(Seals::FUTURE_WRITE | Seals::GROW | Seals::SHRINK, len),
        "not WRITE | SHRINK | GROW",
    );
    assert_refused(&manifest, memfd_with(Seals::empty(), len), "not WRITE");

    // Sealed, but shorter than the manifest says: reading past its end would SIGBUS.
    assert_refused(
        &manifest,
        memfd_with(Seals::IMMUTABLE, len / 2),
        "past the end of the file",
    );

    // Sealed and long enough: accepted, and reads the (zero) bytes.
    let store = PinStore::attach(&manifest, vec![memfd_with(Seals::IMMUTABLE, len)]).unwrap();
    assert_eq!(store.weights(0, 0).unwrap(), &vec![0u8; len][..]);
}

#[test]
fn attach_shared_checks_seals_too() {
    let len = numapin::page_size();
    assert!(Region::attach_shared(memfd_with(Seals::SHRINK, len), len).is_err());
    let region = Region::attach_shared(memfd_with(Seals::IMMUTABLE, len), len).unwrap();
    assert!(region.seals().unwrap().contains(Seals::IMMUTABLE));
    assert!(region.sealed_file().is_some());
    assert_eq!(region.as_slice(), &vec![0u8; len][..]);
}

#[test]
fn attach_refuses_a_manifest_that_names_a_region_twice_or_a_layer_too_far() {
    let len = numapin::page_size();
    let region = numapin::store::ManifestRegion {
        layer: 0,
        kind: Kind::Weights,
        len,
        stride: len,
        slot_bytes: len,
        loaded: vec![Some(len)],
    };
    let twice = Manifest {
        regions: vec![region.clone(), region.clone()],
    };
    let files = vec![
        memfd_with(Seals::IMMUTABLE, len),
        memfd_with(Seals::IMMUTABLE, len),
    ];
    let err = PinStore::attach(&twice, files).unwrap_err().to_string();
    assert!(err.contains("appears twice"), "{err}");
    let far = Manifest {
        regions: vec![numapin::store::ManifestRegion {
            layer: 1 << 20,
            ..region
        }],
    };
    // A layer index past the store's table is an index out of range, like an expert's.
    let err = PinStore::attach(&far, vec![memfd_with(Seals::IMMUTABLE, len)]).unwrap_err();
    assert!(
        matches!(
            err,
            numapin::Error::OutOfRange {
                index: 0x10_0000,
                ..
            }
        ),
        "{err:?}"
    );
}
