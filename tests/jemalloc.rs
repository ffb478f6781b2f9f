//! jemalloc as the global allocator with `retain:false` baked into the binary: purge
//! brings resident memory back to the live bytes after a load-like burst. A process-wide
//! configuration, so this binary is its own (`--features jemalloc`).

use numapin::diag;
use numapin::jemalloc::{self, Jemalloc};

#[global_allocator]
static ALLOCATOR: Jemalloc = Jemalloc;

#[allow(non_upper_case_globals)]
#[unsafe(export_name = "_rjem_malloc_conf")]
pub static malloc_conf: &[u8; 13] = b"retain:false\0";

const MIB: usize = 1 << 20;

#[test]
fn retain_is_off_as_baked_in() {
    assert!(!jemalloc::retain_enabled().unwrap());
}

#[test]
fn purge_after_a_burst_brings_resident_back_to_live_bytes() {
    let live: Vec<u8> = vec![1; 16 * MIB];
    // A load-like burst: buffers of mixed sizes, written, then all freed.
    let sizes = [4096, 24 * 1024, 256 * 1024, 1 << 20, 3 << 20];
    let mut burst: Vec<Vec<u8>> = Vec::new();
    let mut total = 0;
    let mut i = 0;
    while total < 320 * MIB {
        let size = sizes[i % sizes.len()] + (i % 7) * 512;
        burst.push(vec![(i % 251) as u8; size]);
        total += size;
        i += 1;
    }
    // The buffers are never read: without this, an optimised build may drop the fills.
    std::hint::black_box(&mut burst);
    let rss_peak = diag::rss_bytes().unwrap();

    drop(burst);
    let before = jemalloc::stats().unwrap();

    jemalloc::purge_all().unwrap();
    let after = jemalloc::stats().unwrap();
    let rss_after = diag::rss_bytes().unwrap();
    assert!(
        after.resident <= after.allocated + after.allocated / 10 + 8 * MIB,
        "resident {} vs allocated {}",
        after.resident,
        after.allocated
    );
    assert!(after.allocated >= live.len());
    // The process RSS falls accordingly: by most of the burst, freed and purged
    // (retain:false unmaps large extents at free; the purge returns the dirty rest).
    assert!(
        rss_peak - rss_after >= total as u64 * 8 / 10,
        "RSS {rss_peak} -> {rss_after} after freeing a {total}-byte burst (jemalloc before purge: {before:?})"
    );
    assert_eq!(live[live.len() - 1], 1);
}
