//! `PlacedModel::verify` re-reads in the load's read mode: after a direct placement of a
//! cold checkpoint and its verify, the page cache holds at most 2% of the files' pages
//! (counted with `mincore`, `numapin_testkit::cache`), where a buffered re-read caches
//! them all.

use super::*;
use numapin::store::ReadMode;
use numapin_testkit::cache::{cached_pages, evict};

/// `(cached, total)` pages of every file of the checkpoint.
fn cached(checkpoint: &Checkpoint) -> (usize, usize) {
    checkpoint
        .files()
        .iter()
        .map(|f| cached_pages(f.file()).unwrap())
        .fold((0, 0), |(c, t), (fc, ft)| (c + fc, t + ft))
}

#[test]
fn a_direct_placement_verifies_without_filling_the_page_cache() {
    let Some(dir) = fixtures("a_direct_placement_verifies_without_filling_the_page_cache") else {
        return;
    };
    let nodes = common::nodes();
    for name in ["st-sharded", "gguf-single", "gguf-split"] {
        let checkpoint = open_fixture(&dir, name);
        if common::dio_align(checkpoint.files()[0].file()).is_none() {
            println!("NOT RUN: {name}: no direct I/O under {}", dir.display());
            return;
        }
        for f in checkpoint.files() {
            evict(f.file()).unwrap();
        }
        assert_eq!(cached(&checkpoint).0, 0, "{name}: evicted");
        let options = options().read_mode(ReadMode::Direct);
        let model = checkpoint.place(&plan(nodes), options).unwrap();
        assert_eq!(model.read_mode(), ReadMode::Direct, "{name}");
        let verify = model.verify(&checkpoint).unwrap();
        assert!(verify.verified(), "{name}: {verify}");
        read_in_place(name, &checkpoint, &model, &verify);
        let (after, pages) = cached(&checkpoint);
        assert!(
            after * 50 <= pages,
            "{name}: {after} of {pages} pages cached after a direct place and verify"
        );
        // The count can fail: a buffered re-read caches what it read.
        let buffered = model
            .verify_in_mode(&checkpoint, ReadMode::Buffered)
            .unwrap();
        assert!(buffered.verified(), "{name}: {buffered}");
        let (after, _) = cached(&checkpoint);
        assert!(
            after * 2 > pages,
            "{name}: a buffered verify cached only {after} of {pages} pages"
        );
    }
}

/// What the direct re-reads did (one pass over every class, the experts' slots too):
/// windows read at aligned offsets into aligned buffers, so all but each window's partial
/// last unit lands in place (at most one blocking read a window: its bounced tail),
/// through `io_uring` wherever the load used one; the window reads cover every byte
/// compared, at most a unit more per window (its aligned start).
fn read_in_place(
    name: &str,
    checkpoint: &Checkpoint,
    model: &numapin::model::PlacedModel,
    verify: &numapin::model::WholeVerify,
) {
    let (_, unit) = common::dio_align(checkpoint.files()[0].file()).unwrap();
    let d = verify.direct;
    // The file bytes compared: every tensor with copies of its own, and the experts'
    // merged tensors (compared slot by slot); each range of the files once.
    let compared: u64 = checkpoint
        .tensors()
        .iter()
        .filter(|t| {
            model.tensor_copies(t.name()).is_ok()
                || model.tensor(t.name()).unwrap().class() == TensorClass::RoutedExperts
        })
        .map(|t| t.len())
        .sum();
    println!(
        "{name}: {compared} bytes compared, {} window reads, {d:?}",
        verify.reads
    );
    assert!(verify.reads > 0, "{name}");
    // On the ring at most one blocking read a window (its bounced tail); where io_uring
    // is denied (the containers' seccomp filters), every read is a blocking one.
    if d.uring_reads > 0 {
        assert!(d.blocking_reads <= verify.reads as u64, "{name}: {d:?}");
    }
    assert!(
        d.in_place_bytes + verify.reads as u64 * unit >= compared,
        "{name}: {} of {compared} bytes read in place ({d:?})",
        d.in_place_bytes
    );
    let load_ring: u64 = model.report().map_or(0, |r| {
        r.measured.iter().map(|c| c.direct_reads.uring_reads).sum()
    });
    assert_eq!(
        d.uring_reads > 0,
        load_ring > 0,
        "{name}: {d:?}, load {load_ring}"
    );
}
