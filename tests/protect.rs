//! Placed weights nobody can overwrite: once loaded, a store's and a cache's regions are
//! `PROT_READ` (a write faults in a child process), `ensure` and cache loads open a
//! region whole and close it after, and the mappings stay as many as they were. The
//! references are the kernel's: the child's signal and `/proc/self/maps` read here.

use std::os::unix::process::ExitStatusExt;
use std::process::Command;

use numapin::NodeSet;
use numapin::cache::{CacheOptions, ExpertCache};
use numapin::store::{ExpertSource, LayerSpec, Layout, PinStore, StoreOptions};

const CHILD: &str = "NUMAPIN_PROTECT_CHILD";
const SIGSEGV: i32 = 11;
/// Printed by a child right before its write, so that a fault is known to be the write's.
const WRITING: &str = "writing now";

fn data(layer: usize, experts: usize, len: usize) -> Vec<Vec<u8>> {
    (0..experts)
        .map(|e| {
            (0..len)
                .map(|i| ((layer * 7 + e * 31 + i) % 251) as u8)
                .collect()
        })
        .collect()
}

/// A store of two layers of 3 experts (weights and scales), loaded from memory and
/// checked byte for byte against the sources.
fn packed(options: StoreOptions) -> (PinStore, Vec<[Vec<Vec<u8>>; 2]>) {
    let store = PinStore::new(
        Layout::Interleave(NodeSet::allowed().unwrap()),
        options.huge_pages(false).loader_threads(2),
    )
    .unwrap();
    let mut all = Vec::new();
    for layer in 0..2 {
        let tensors = [data(layer, 3, 10_000), data(layer + 10, 3, 300)];
        let sources: Vec<ExpertSource<'_>> = (0..3)
            .map(|e| ExpertSource::Memory {
                weights: &tensors[0][e],
                scales: &tensors[1][e],
            })
            .collect();
        store
            .pack_layer(layer, &LayerSpec::fitting(&sources).unwrap(), &sources)
            .unwrap();
        for (e, (w, s)) in tensors[0].iter().zip(&tensors[1]).enumerate() {
            assert_eq!(store.weights(layer, e).unwrap(), &w[..]);
            assert_eq!(store.scales(layer, e).unwrap(), &s[..]);
        }
        all.push(tensors);
    }
    (store, all)
}

/// The lines of `/proc/self/maps` overlapping `[start, end)`, parsed here.
fn maps_lines(start: usize, end: usize) -> Vec<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter(|line| {
            let range = line.split_whitespace().next().unwrap();
            let (a, b) = range.split_once('-').unwrap();
            let (a, b) = (
                usize::from_str_radix(a, 16).unwrap(),
                usize::from_str_radix(b, 16).unwrap(),
            );
            a < end && start < b
        })
        .map(str::to_owned)
        .collect()
}

/// The permissions column (`r--p`) of every maps line over `bytes`.
fn perms(bytes: &[u8]) -> Vec<String> {
    let start = bytes.as_ptr() as usize;
    maps_lines(start, start + bytes.len())
        .iter()
        .map(|l| l.split_whitespace().nth(1).unwrap().to_owned())
        .collect()
}

/// The maps lines over the store's slots (each once, in address order): not the gaps
/// between its regions, where other mappings may lie.
fn store_lines(store: &PinStore) -> Vec<String> {
    let mut lines = std::collections::BTreeSet::new();
    for layer in 0..2 {
        for e in 0..3 {
            for bytes in [
                store.weights(layer, e).unwrap(),
                store.scales(layer, e).unwrap(),
            ] {
                let start = bytes.as_ptr() as usize;
                lines.extend(maps_lines(start, start + bytes.len()));
            }
        }
    }
    lines.into_iter().collect()
}

/// Writes one byte at `ptr` (the child's whole purpose: it dies here when protected).
fn write_at(ptr: *const u8) {
    println!("{WRITING}");
    // SAFETY: `ptr` is a byte of a live mapping of this process; the write is the
    // hostile one the test expects the kernel to refuse with SIGSEGV.
    unsafe { ptr.cast_mut().write_volatile(0xAB) };
    // SAFETY: as above, a read of the same byte.
    let back = unsafe { ptr.read_volatile() };
    println!("wrote {back:#x}");
}

/// Runs this test binary's `test` in a child with `CHILD=mode`.
fn child(test: &str, mode: &str) -> std::process::Output {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(CHILD, mode)
        .output()
        .unwrap()
}

fn child_body(mode: &str) {
    match mode {
        "store" | "store-writable" => {
            let options = StoreOptions::default().writable(mode == "store-writable");
            let (store, _) = packed(options);
            write_at(store.weights(1, 2).unwrap()[17..].as_ptr());
        }
        "cache" => {
            let cache = ExpertCache::new(
                NodeSet::allowed().unwrap(),
                2,
                5000,
                64,
                CacheOptions::default(),
            )
            .unwrap();
            let (w, s) = (vec![3u8; 5000], vec![4u8; 64]);
            let source = ExpertSource::Memory {
                weights: &w,
                scales: &s,
            };
            let entry = cache.get_or_load(0, 1, &source, None).unwrap();
            assert_eq!(entry.weights(), &w[..]);
            write_at(entry.weights().as_ptr());
        }
        other => panic!("unknown child mode {other}"),
    }
}

#[test]
fn a_write_to_placed_weights_faults_in_a_child() {
    const TEST: &str = "a_write_to_placed_weights_faults_in_a_child";
    if let Ok(mode) = std::env::var(CHILD) {
        child_body(&mode);
        return;
    }
    for mode in ["store", "cache"] {
        let out = child(TEST, mode);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains(WRITING),
            "{mode}: the child did not reach its write: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            out.status.signal(),
            Some(SIGSEGV),
            "{mode}: the write went through ({}):\n{stdout}",
            out.status
        );
    }
    // Asked for writable memory: the same write goes through and reads back.
    let out = child(TEST, "store-writable");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}: {stdout}", out.status);
    assert!(stdout.contains("wrote 0xab"), "{stdout}");
}

#[test]
fn loaded_regions_are_read_only_and_ensure_keeps_the_mappings() {
    let (mut store, tensors) = packed(StoreOptions::default());
    for layer in 0..2 {
        for e in 0..3 {
            for bytes in [
                store.weights(layer, e).unwrap(),
                store.scales(layer, e).unwrap(),
            ] {
                assert_eq!(perms(bytes), ["r--p"], "layer {layer} expert {e}");
            }
        }
    }
    let before = store_lines(&store);
    store.release(1, 1).unwrap();
    store.release(0, 2).unwrap();
    for (layer, e) in [(1, 1), (0, 2)] {
        let source = ExpertSource::Memory {
            weights: &tensors[layer][0][e],
            scales: &tensors[layer][1][e],
        };
        store.ensure(layer, e, &source).unwrap();
        assert_eq!(store.weights(layer, e).unwrap(), &tensors[layer][0][e][..]);
        assert_eq!(store.scales(layer, e).unwrap(), &tensors[layer][1][e][..]);
    }
    // The same mappings, line for line (the same ranges, `r--p`), after the fills.
    let after = store_lines(&store);
    let ranges_perms = |lines: &[String]| -> Vec<(String, String)> {
        lines
            .iter()
            .map(|l| {
                let mut f = l.split_whitespace();
                (f.next().unwrap().to_owned(), f.next().unwrap().to_owned())
            })
            .collect()
    };
    assert_eq!(ranges_perms(&after), ranges_perms(&before));
    assert!(
        ranges_perms(&after).iter().all(|(_, p)| p == "r--p"),
        "{after:?}"
    );

    let (writable, _) = packed(StoreOptions::default().writable(true));
    assert_eq!(perms(writable.weights(0, 0).unwrap()), ["rw-p"]);
}

#[test]
fn concurrent_cache_loads_leave_the_regions_read_only() {
    let cache = ExpertCache::new(
        NodeSet::from_nodes([0]).unwrap(),
        64,
        4096 * 3,
        100,
        CacheOptions::default(),
    )
    .unwrap();
    // The lines over the cache's own regions (not over the gaps between them, where
    // the loaders' stacks may land).
    let lines_now = || {
        let mut lines: Vec<String> = (cache.spans().iter())
            .flat_map(|&(s, e)| maps_lines(s, e))
            .collect();
        lines.sort();
        lines.dedup();
        lines
    };
    let before = lines_now();
    let tensors = data(5, 64, 4096 * 3);
    let scales = data(6, 64, 100);
    std::thread::scope(|scope| {
        for t in 0..4 {
            let (cache, tensors, scales) = (&cache, &tensors, &scales);
            scope.spawn(move || {
                for e in (t..64).step_by(4) {
                    let source = ExpertSource::Memory {
                        weights: &tensors[e],
                        scales: &scales[e],
                    };
                    let entry = cache.get_or_load(0, e, &source, None).unwrap();
                    assert_eq!(entry.weights(), &tensors[e][..]);
                    assert_eq!(entry.scales(), &scales[e][..]);
                }
            });
        }
    });
    let lines = lines_now();
    assert!(!lines.is_empty());
    for line in &lines {
        assert_eq!(line.split_whitespace().nth(1), Some("r--p"), "{line}");
    }
    // As many mappings as before the first load: the windows opened and closed whole.
    assert_eq!(lines.len(), before.len(), "{before:?} then {lines:?}");
}

/// The protection of the maps line holding `region`'s first byte.
fn region_perms(region: &numapin::Region) -> String {
    // By address: no slice of the region, which a live slot slice forbids.
    let start = region.as_ptr() as usize;
    let lines = maps_lines(start, start + 1);
    lines
        .iter()
        .map(|l| l.split_whitespace().nth(1).unwrap())
        .collect()
}

#[test]
fn write_windows_are_counted_and_close_the_region_with_the_last() {
    let mut region = numapin::Region::anonymous(3 * 4096).unwrap();
    region.as_mut_slice().unwrap().fill(7);
    region.set_read_only(true).unwrap();
    assert!(region.is_read_only());
    assert_eq!(region_perms(&region), "r--p");
    // Outside a window a write is refused, not faulted.
    assert!(matches!(
        region.as_mut_slice(),
        Err(numapin::Error::InvalidArgument {
            reason: numapin::Invalid::WrongBacking { .. },
            ..
        })
    ));
    let first = region.open_write().unwrap();
    let second = region.open_write().unwrap();
    assert_eq!(region_perms(&region), "rw-p");
    // SAFETY: the one slice of this range; `second` outlives it.
    let slot = unsafe { region.slot_mut_unchecked(4096..8192) }.unwrap();
    slot.fill(9);
    first.close().unwrap();
    // The other window still holds the region open: its writer is not cut off.
    assert_eq!(region_perms(&region), "rw-p");
    slot[0] = 10;
    second.close().unwrap();
    assert_eq!(region_perms(&region), "r--p");
    assert_eq!(&region.as_slice()[4096..4098], &[10, 9]);
    // SAFETY: no slice of the range lives (the window is closed, `slot` is dead).
    assert!(unsafe { region.slot_mut_unchecked(0..4096) }.is_err());
    // A dropped window closes too.
    drop(region.open_write().unwrap());
    assert_eq!(region_perms(&region), "r--p");
    region.set_read_only(false).unwrap();
    assert_eq!(region_perms(&region), "rw-p");
    region.as_mut_slice().unwrap()[0] = 1;
}
