//! Round 11's readahead guard, attacked: a drop-behind placement cancelled halfway (a
//! progress hook that stops it, as the Python binding's does when a callback raises)
//! leaves nothing it read cached. The guard holds what the kernel's readahead from a
//! piece still to be read could reach; once the placement stops, no fill reads that
//! piece, and nothing else would advise what was held for it.

use super::*;
use numapin::store::{ProgressHook, ReadMode};
use numapin_testkit::cache::{cached_pages, evict, evictable};
use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

#[test]
fn a_cancelled_drop_behind_placement_leaves_nothing_it_read_cached() {
    let dir = numapin_testkit::scratch::ScratchDir::new(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        "attack-r11-cancel",
    );
    // 4 layers of 8 merged experts: each layer's gate, up and down regions 17.6 MB,
    // read side by side expert by expert.
    let path = dir.join("model.gguf");
    drop_behind::merged_gguf(&path, 4, 8, 1000, 1100);
    let checkpoint = Checkpoint::open(&path).unwrap();
    let file = checkpoint.files()[0].file();
    if !evictable(file) {
        println!(
            "NOT RUN: a_cancelled_drop_behind_placement_leaves_nothing_it_read_cached needs \
             a file system whose page cache can be dropped ({} is tmpfs or ramfs)",
            path.display()
        );
        return;
    }
    // No kernel readahead on the descriptor the placement reads through: what is cached
    // is what the loaders read and did not advise away.
    rustix::fs::fadvise(file, 0, None, rustix::fs::Advice::Random).unwrap();
    evict(file).unwrap();
    assert_eq!(cached_pages(file).unwrap().0, 0);
    // Cancel the first experts' layer (a layer of over 40 MB) at its first report past
    // 16 MiB: its gate, up and down regions are read up to some expert, the rest not.
    let cancelled = Arc::new(AtomicBool::new(false));
    let hook = {
        let cancelled = cancelled.clone();
        ProgressHook::cancellable(move |p| {
            if p.bytes_total > 40 << 20 && p.bytes_done > 0 && !p.is_done() {
                cancelled.store(true, Ordering::Relaxed);
                return ControlFlow::Break(());
            }
            ControlFlow::Continue(())
        })
    };
    let options = options()
        .loader_threads(1)
        .read_mode(ReadMode::DropBehind)
        .progress(Some(hook));
    let placed = checkpoint.place(&plan(common::nodes()), options);
    assert!(
        matches!(placed, Err(Error::Cancelled { .. })),
        "{:?}",
        placed.map(|_| ())
    );
    assert!(cancelled.load(Ordering::Relaxed));
    let (left, pages) = cached_pages(file).unwrap();
    println!("{left} of {pages} pages cached after the cancelled placement");
    // The last folio a fill's end-of-fill advice rounds to, and nothing held: the guard
    // held two reaches (at least 4 MiB: twice a folio) of the up and down regions.
    let folio = (2 << 20) / numapin::page_size();
    assert!(
        left <= 2 * folio,
        "{left} of {pages} pages left cached after a cancelled drop-behind placement"
    );
}
